"""Sharded table (funcreplay.distributed): every shard equals a plain table driven with
its inputs, and global queries / invariants equal an unsharded table's.

The tests here need 8 devices (the ``mesh`` fixture of conftest.py skips them otherwise);
in a process with fewer, ``test_suite_on_8_cpu_devices`` (test_sharding_processes.py)
re-runs them in a subprocess with 8 fake CPU devices.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import distributed as frs
from tests.distributed.common import (
  ITEM,
  SAMPLE_ARGS,
  N,
  count_of,
  leaf_equal,
  stats_of,
  tagged_items,
)


def _jit(t):
  return dict(insert=jax.jit(t.insert), sample=jax.jit(t.sample, static_argnames=SAMPLE_ARGS[:2]),
              update=jax.jit(t.update_priorities), delete=jax.jit(t.delete))


def test_sharded_ops_equal_per_shard_tables(mesh):
  """Every shard of the sharded state equals a plain table driven with that shard's inputs."""
  spec = fr.TableSpec(4 * 8, ITEM, sampler=fr.Prioritized(0.7), max_times_sampled=2,
                      max_staleness=3)
  t = frs.make_sharded_table(spec, mesh)
  js, jl = _jit(t), _jit(t.local)
  st = jax.jit(t.init)()
  assert st.occupied.shape == (N, 8) and st.occupied.sharding.spec[0] == "data"
  refs = [t.local.init() for _ in range(N)]
  rng = jax.random.PRNGKey(3)
  masks = np.array([[1, 1, 1, 1, 1], [1, 0, 1, 0, 0], [0] * 5, [1] * 5], bool)
  for step in range(4):
    items = tagged_items(N, 5, 100 * step)
    st = js["insert"](st, items, version=step, mask=masks)
    refs = [jl["insert"](r, jax.tree_util.tree_map(lambda x, s=s: x[s], items), version=step,
                         priority=jnp.max(jnp.stack([q.max_priority for q in refs])),
                         mask=masks[s]) for s, r in enumerate(refs)]
    rng, k = jax.random.split(rng)
    st, batch = js["sample"](st, k, batch_size=3, version=step + 1)
    outs = []
    for s in range(N):
      refs[s], out = jl["sample"](refs[s], jax.random.fold_in(k, s), batch_size=3,
                                  version=step + 1)
      outs.append(out)
    for s in range(N):
      np.testing.assert_array_equal(batch.info.slot[s], outs[s].info.slot)
      np.testing.assert_allclose(batch.info.probability[s], outs[s].info.probability / N,
                                 rtol=1e-6)
      np.testing.assert_array_equal(batch.data["tag"][s], outs[s].data["tag"])
    new_p = jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3) + 0.5
    st = js["update"](st, batch.info.slot, batch.info.key, new_p)
    refs = [jl["update"](refs[s], batch.info.slot[s], batch.info.key[s], new_p[s])
            for s in range(N)]
  for s in range(N):
    leaf_equal(jax.tree_util.tree_map(lambda x, s=s: x[s], st), refs[s])
  # Global queries are the sums / maxima of the per-shard ones.
  assert count_of(t, st) == sum(int(r.size) for r in refs)
  assert count_of(t, st, version=9) == sum(count_of(t.local, r, version=9) for r in refs)
  got = stats_of(t, st)
  per = [stats_of(t.local, r) for r in refs]
  for k in ("size", "inserts", "samples", "evicted_reuse", "evicted_capacity",
            "sampled_staleness_sum", "removed_reuse_sum"):
    assert got[k] == sum(p[k] for p in per), k
  assert got["max_priority"] == max(p["max_priority"] for p in per)
  assert got["capacity"] == 32
  elig = np.asarray(t.eligible(st, version=6))
  np.testing.assert_array_equal(elig, np.stack([t.local.eligible(r, version=6) for r in refs]))


def test_invariants_match_unsharded_table(mesh):
  """Same items into a sharded and an unsharded table: same sizes, counters, eligibility."""
  spec = fr.TableSpec(4 * 6, ITEM, max_staleness=2)
  t = frs.make_sharded_table(spec, mesh)
  u = fr.make_table(spec)
  st, su = jax.jit(t.init)(), u.init()
  for step in range(3):
    items = tagged_items(N, 2, 10 * step)
    st = jax.jit(t.insert)(st, items, version=step)
    su = jax.jit(u.insert)(su, jax.tree_util.tree_map(lambda x: x.reshape(-1, *x.shape[2:]),
                                                      items), version=step)
  for v in (None, 2, 4, 5):
    assert count_of(t, st, version=v) == count_of(u, su, version=v), v
  assert stats_of(t, st) == stats_of(u, su)
  assert bool(t.can_sample(st, 6)) == bool(u.can_sample(su, 6))
  st2 = jax.jit(t.evict_stale)(st, 4)
  su2 = u.evict_stale(su, 4)
  assert stats_of(t, st2) == stats_of(u, su2)
  assert count_of(t, st2) == int(su2.size) == 8  # only version 2's 8 items are fresh


def test_keyed_calls_check_their_arguments_per_shard(mesh):
  """``delete`` / ``update_priorities`` / ``set_metadata`` take ``[S, K]`` slots and keys
  and values as ``insert``'s per-shard arguments (a scalar, ``[S]`` or ``[S, K]``).
  Flat or ``[S]`` keys were split across the shards unchecked (each shard compared all
  its rows with one key: a silent partial delete), and ``[S]`` priorities were read per
  column, not per shard (found by a review)."""
  spec = fr.TableSpec(4 * 8, ITEM, sampler=fr.Prioritized(1.0), metadata=("task",))
  t = frs.make_sharded_table(spec, mesh)
  st = jax.jit(t.insert)(jax.jit(t.init)(), tagged_items(N, 4, 0))
  slots = np.tile(np.arange(4, dtype=np.int32), (N, 1))
  keys = np.asarray(st.key)[:, :4]
  for bad in (keys.reshape(-1), keys[:, 0], keys[:, :2]):
    for call in (lambda k: t.delete(st, slots, k),
                 lambda k: t.update_priorities(st, slots, k, 1.0),
                 lambda k: t.set_metadata(st, slots, k, "task", 1)):
      with pytest.raises(ValueError, match="keys must be a scalar or of the slots' shape"):
        call(bad)
  with pytest.raises(TypeError, match="slots must be integers"):
    t.delete(st, slots.astype(np.float32), keys)
  with pytest.raises(ValueError, match="keys are uint32"):
    t.delete(st, slots, keys.astype(np.int64) - 2**33)
  with pytest.raises(TypeError, match="priorities must be numbers"):
    t.update_priorities(st, slots, keys, np.ones((N, 4), bool))
  with pytest.raises(TypeError, match="values must be integers"):
    t.set_metadata(st, slots, keys, "task", np.ones((N,), np.float32))
  # A host slot beyond int32 would wrap onto another slot.
  with pytest.raises(ValueError, match="delete: slots must fit int32"):
    t.delete(st, np.full((N, 4), 2**32, np.int64), keys)
  # A host value beyond int32 (it would wrap): ours, not JAX's OverflowError.
  for big in (2**31, [2**31] * N, np.full((N, 4), -2**31 - 1, np.int64)):
    with pytest.raises(ValueError, match="set_metadata: values must fit int32"):
      t.set_metadata(st, slots, keys, "task", big)
  # [S]: one value per shard.
  per_shard = np.arange(1, N + 1, dtype=np.float32)
  up = t.update_priorities(st, slots, keys, per_shard)
  np.testing.assert_array_equal(np.asarray(up.priority)[:, :4], np.repeat(per_shard[:, None], 4, 1))
  meta = t.set_metadata(st, slots, keys, "task", np.arange(N, dtype=np.int32))
  np.testing.assert_array_equal(np.asarray(meta.metadata["task"])[:, :4],
                                np.repeat(np.arange(N)[:, None], 4, 1))
  assert count_of(t, t.delete(st, slots, keys)) == 0
  # Host keys as Python ints (above 2**31 too: a valid uint32 key), a scalar key.
  assert count_of(t, t.delete(st, slots, keys.tolist())) == 0
  assert count_of(t, t.delete(st, slots, [[3_000_000_000] * 4] * N)) == N * 4
  # Keys are numbered per shard: key 0 is slot 0's on every shard.
  assert count_of(t, t.delete(st, slots, int(keys[0, 0]))) == N * 4 - N


@pytest.mark.parametrize("replace", [True, False])
def test_global_sample_weighs_shards_by_totals_below_tiny(mesh, replace):
  """Priorities of 1e-16 and 3e-16 at exponent 2: shard totals of 4e-32 and 3.6e-31, below
  numerics.TINY. Every shard raced (and was chosen) as if its total were TINY: shard 0
  drew about 1 / N of the items instead of 9 / (9 + N - 1), and the probabilities were
  floored too (found by a review)."""
  spec = fr.TableSpec(4 * N, ITEM, sampler=fr.Prioritized(2.0))
  t = frs.make_sharded_table(spec, mesh)
  prio = np.full((N, 4), 1e-16, np.float32)
  prio[0] = 3e-16
  st = jax.jit(t.insert)(jax.jit(t.init)(), tagged_items(N, 4, 0), priority=prio)
  draw = jax.jit(lambda k: t.sample_global(st, k, batch_size=1, replace=replace)[1])
  from_0, draws = 0, 300
  for seed in range(draws):
    b = draw(jax.random.PRNGKey(seed))
    valid = np.asarray(b.valid)
    assert valid.sum() == 1
    from_0 += int(valid[0].any())
    shard = int(np.argmax(valid.any(axis=1)))
    want = (9.0 if shard == 0 else 1.0) / (4 * (9 + N - 1))
    np.testing.assert_allclose(np.asarray(b.info.probability)[valid], want, rtol=1e-5)
  p0 = 9 / (9 + N - 1)  # 0.75 for N = 4
  assert abs(from_0 / draws - p0) < 4 * np.sqrt(p0 * (1 - p0) / draws), from_0 / draws


def test_sharded_position_index_equals_per_shard_tables(mesh):
  """``TableSpec(position_index=True)``: every shard keeps its own index, as a plain table
  driven with that shard's inputs (inserts, deletes, samples with a reuse limit)."""
  from funcreplay.core import position_index

  spec = fr.TableSpec(4 * 8, ITEM, position_index=True, max_times_sampled=2)
  t = frs.make_sharded_table(spec, mesh)
  js, jl = _jit(t), _jit(t.local)
  st = jax.jit(t.init)()
  assert st.position_index.shape == (N, 2, 9)
  refs = [t.local.init() for _ in range(N)]
  rng = jax.random.PRNGKey(5)
  for step in range(4):
    items = tagged_items(N, 5, 100 * step)
    st = js["insert"](st, items)
    refs = [jl["insert"](r, jax.tree_util.tree_map(lambda x, s=s: x[s], items))
            for s, r in enumerate(refs)]
    rng, k = jax.random.split(rng)
    st, batch = js["sample"](st, k, batch_size=3)
    for s in range(N):
      refs[s], _ = jl["sample"](refs[s], jax.random.fold_in(k, s), batch_size=3)
    slots, keys = batch.info.slot[:, :1], batch.info.key[:, :1]  # one delete a shard
    st = js["delete"](st, slots, keys)
    refs = [jl["delete"](refs[s], slots[s], keys[s]) for s in range(N)]
  for s in range(N):
    shard = jax.tree_util.tree_map(lambda x, s=s: x[s], st)
    leaf_equal(shard, refs[s])
    assert not position_index.check(shard.position_index, shard.occupied)
