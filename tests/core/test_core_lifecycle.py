"""Core contract tests, table lifecycle: the table inside ``lax.scan`` and ``vmap``,
counters and keys past 2**32, masked inserts, reuse / staleness eviction, delete,
and the rate limiter's predicates."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import funcreplay as fr
from funcreplay.core import counters as ctr
from tests.core.common import fill
from tests.helpers import ITEM, counters_dict, items_from_ids, jitted

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")


def test_insert_and_sample_inside_scan_train_loop():
  spec = fr.TableSpec(64, ITEM, sampler=fr.Prioritized(0.6), max_times_sampled=3,
                      max_staleness=4)
  table = fr.make_table(spec)

  @jax.jit
  def train(state, key):
    def step(carry, t):
      st, k = carry
      k, k1 = jax.random.split(k)
      ids = t * 4 + jnp.arange(4, dtype=jnp.int32)
      items = {"x": ids, "y": jnp.stack([ids, -ids], -1).astype(jnp.float32)}
      st = table.insert(st, items, version=t)
      st, b = table.sample(st, k1, batch_size=8, version=t)
      st = table.update_priorities(st, b.info.slot, b.info.key,
                                   jnp.abs(b.data["y"][:, 0]) + 1.0)
      return (st, k), (jnp.sum(b.valid), jnp.max(jnp.where(b.valid, t - b.info.version, 0)))
    return lax.scan(step, (state, key), jnp.arange(40, dtype=jnp.int32))

  (state, _), (n_valid, max_stale) = train(table.init(), jax.random.PRNGKey(0))
  assert int(max_stale.max()) <= 4
  assert int(n_valid[-1]) == 8
  live = np.asarray(state.occupied)
  assert np.asarray(state.times_sampled)[live].max() < 3, "an item outlived max_times_sampled"
  c = counters_dict(state)
  assert c["inserts"] == 160
  assert c["samples"] == int(n_valid.sum())
  removed = c["evicted_capacity"] + c["evicted_reuse"] + c["evicted_stale"] + c["deletes"]
  assert c["inserts"] == int(state.size) + removed


def test_vmap_over_four_independent_tables():
  spec = fr.TableSpec(16, ITEM, sampler=fr.Prioritized(1.0))
  table = fr.make_table(spec)
  states = jax.vmap(lambda _: table.init())(jnp.arange(4))
  ids = jnp.arange(4 * 5, dtype=jnp.int32).reshape(4, 5)
  items = {"x": ids, "y": jnp.stack([ids, -ids], -1).astype(jnp.float32)}
  states = jax.jit(jax.vmap(lambda s, it: table.insert(s, it, version=0)))(states, items)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  states, b = jax.jit(jax.vmap(lambda s, k: table.sample(s, k, batch_size=3)))(states, keys)
  x = np.asarray(b.data["x"])
  assert x.shape == (4, 3)
  for t in range(4):  # each table only returns its own items
    assert set(x[t].tolist()) <= set(range(5 * t, 5 * t + 5))
    assert len(set(x[t].tolist())) == 3
  np.testing.assert_array_equal(np.asarray(states.occ_tree[:, 1]), 5)


def test_counters_and_keys_survive_2_pow_32():
  spec = fr.TableSpec(8, ITEM, sampler=fr.Fifo())
  f = jitted(spec)
  state = f["table"].init()
  near = 2**32 - 3
  state = state.replace(
      counters={k: ctr.from_int(near) for k in state.counters},
      next_key=jnp.uint32(2**32 - 8))
  for i in range(4):
    state = f["insert"](state, items_from_ids(np.arange(3 * i, 3 * i + 3)), version=0)
  c = counters_dict(state)
  assert c["inserts"] == near + 12
  assert c["evicted_capacity"] == near + 4
  keys = np.asarray(state.key)
  assert keys.max() == 2**32 - 1 and keys.min() == 0, "keys wrap modulo 2**32"
  # Fifo order is decided by age, so it stays right across the key wrap.
  state, b = f["sample"](state, jax.random.PRNGKey(0), batch_size=8)
  np.testing.assert_array_equal(np.asarray(b.data["x"]), np.arange(4, 12))
  assert counters_dict(state)["samples"] == near + 8


def test_two_word_add_sum_is_exact():
  c = ctr.from_int(2**32 - 10)
  v = jnp.full((1000,), 2**31 + 7, jnp.uint32)
  got = ctr.to_int(jax.jit(ctr.add_sum)(c, v))
  assert got == 2**32 - 10 + 1000 * (2**31 + 7)


@pytest.mark.parametrize("n", [1, 31, 33, 64, 1000, 65_536, 65_537, 300_000])
def test_two_word_totals_are_exact_sums(n):
  # counters.half_sums reduces both 16-bit halves in one reduction; add_sum and the
  # ledger's total (ledger_update.total) build on it.
  from funcreplay.core import ledger_update
  # Beyond counters.CHUNK (65,536) values the halves are summed per chunk: the values are
  # near 2**32 - 1 there, where one uint32 half sum of them all would have wrapped.
  rng = np.random.default_rng(n)
  lo = 0 if n <= ctr.CHUNK else 2**32 - 2**16
  v = rng.integers(lo, 2**32, n, dtype=np.uint64).astype(np.uint32)
  where = rng.random(n) < 0.7
  want = int(v[where].astype(np.uint64).sum())
  c = ctr.from_int(2**32 - 3)
  assert ctr.to_int(jax.jit(ctr.add_sum)(c, jnp.asarray(v), jnp.asarray(where))) == (
      2**32 - 3 + want)
  hi, lo = jax.jit(ledger_update.total)(jnp.asarray(v), jnp.asarray(where))
  assert int(hi) * 2**32 + int(lo) == want


def test_two_word_add_sum_counts_every_element_of_a_2d_array():
  v = np.arange(12, dtype=np.uint32).reshape(3, 4) * np.uint32(70_000)
  assert ctr.to_int(ctr.add_sum(ctr.zero(), jnp.asarray(v))) == int(v.astype(np.uint64).sum())


def test_masked_insert_rows_are_not_inserted():
  spec = fr.TableSpec(8, ITEM)
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids([5, 6, 7, 8]), version=0,
                      mask=np.array([True, False, True, False]))
  assert int(state.size) == 2
  x = np.asarray(fr.stored_items(spec, state)["x"])
  assert sorted(x[np.asarray(state.occupied)].tolist()) == [5, 7]
  assert counters_dict(state)["inserts"] == 2


def test_max_times_sampled_frees_items_and_counts_reuse():
  spec = fr.TableSpec(8, ITEM, max_times_sampled=2)
  f = jitted(spec)
  state = fill(spec, 4)
  for i in range(4):
    state, b = f["sample"](state, jax.random.PRNGKey(i), batch_size=4)
  assert int(state.size) == 0
  c = counters_dict(state)
  assert c["evicted_reuse"] == 4 and c["samples"] == 8 and c["removed_reuse_sum"] == 8
  assert fr.make_table(spec).stats(state).to_dict()["mean_reuse_at_eviction"] == 2.0


def test_evict_stale_and_stats():
  spec = fr.TableSpec(8, ITEM, max_staleness=1)
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids([0, 1, 2]), version=0)
  state = f["insert"](state, items_from_ids([3, 4]), version=2)
  table = fr.make_table(spec)
  assert int(table.count(state, version=2)) == 2
  assert int(table.count(state)) == 5
  state = f["evict"](state, 2)
  assert int(state.size) == 2
  s = table.stats(state).to_dict()
  assert s["evicted_stale"] == 3 and s["size"] == 2


def test_delete_only_where_key_matches():
  spec = fr.TableSpec(4, ITEM)
  f = jitted(spec)
  state = fill(spec, 4)
  old_key = int(state.key[0])
  state = f["insert"](state, items_from_ids([10]), version=0)  # overwrites slot 0
  state = f["delete"](state, np.array([0, 1], np.int32), np.array([old_key, int(state.key[1])],
                                                                   np.uint32))
  assert np.asarray(state.occupied).tolist() == [True, False, True, True]
  assert counters_dict(state)["deletes"] == 1


def test_rate_limiter_predicates():
  spec = fr.TableSpec(8, ITEM, rate_limiter=fr.MinSize(3))
  table = fr.make_table(spec)
  state = fill(spec, 2)
  assert not bool(table.can_sample(state, 1))
  state = jitted(spec)["insert"](state, items_from_ids([9]), version=0)
  assert bool(table.can_sample(state, 3)) and not bool(table.can_sample(state, 4))
  q = fr.queue(2, ITEM)
  qt = fr.make_table(q)
  qs = qt.init()
  assert bool(qt.can_insert(qs, 2)) and not bool(qt.can_insert(qs, 3))
  assert not bool(qt.can_sample(qs, 1))
