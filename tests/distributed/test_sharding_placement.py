"""Sharded table (funcreplay.distributed): per-device placement inside jit/scan, the
gather / reshard round trip, errors, and jax.make_mesh's default Explicit axes.

The tests here need 8 devices (the ``mesh`` fixture of conftest.py skips them otherwise);
in a process with fewer, ``test_suite_on_8_cpu_devices`` (test_sharding_processes.py)
re-runs them in a subprocess with 8 fake CPU devices.
"""

import jax
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import distributed as frs
from tests.distributed.common import ITEM, N, draw_counts, leaf_equal, tagged_items


def test_per_device_insert_stays_on_its_device(mesh):
  spec = fr.TableSpec(4 * 4, ITEM)
  t = frs.make_sharded_table(spec, mesh)
  items = t.shard_items(tagged_items(N, 2, 0))
  assert items["tag"].sharding.spec[0] == "data"

  @jax.jit
  def loop(st, key):  # an Anakin-style on-device loop: insert + sample per step
    def step(st, k):
      st = t.insert(st, items, version=0)
      st, out = t.sample(st, k, batch_size=2)
      return st, out.data["tag"]
    return jax.lax.scan(step, st, jax.random.split(key, 3))

  st, tags = loop(jax.jit(t.init)(), jax.random.PRNGKey(0))
  assert tags.shape == (3, N, 2)
  tag_words = jax.tree_util.tree_leaves(st.data)[0]  # "tag" first: its words lead a row
  for shard in tag_words.addressable_shards:
    s = shard.index[0].start
    assert shard.device == mesh.devices[s]
    assert set(np.asarray(shard.data)[..., 0].reshape(-1)) <= {2 * s, 2 * s + 1}
  # Each shard sampled only its own items.
  assert np.all(np.asarray(tags) // 2 == np.arange(N)[None, :, None])


def test_gather_and_reshard_round_trip(unequal):
  t, st, _, _ = unequal
  host = frs.gather_state(st)
  assert isinstance(host.occupied, np.ndarray) and host.occupied.shape == (N, 8)
  back = t.shard_state(host)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(st)):
    if a.size == 0:
      continue  # XLA reports empty leaves (unused trees) as replicated
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
  leaf_equal(frs.gather_state(back), host)
  leaf_equal(back, st)
  # Same leaves, same layout: the same (cached) programs give the same samples.
  counts1 = draw_counts(t, st, 2000, 3, False, 7)[0]
  counts2 = draw_counts(t, back, 2000, 3, False, 7)[0]
  np.testing.assert_array_equal(counts1, counts2)


def test_calls_without_jit_give_states_that_gather_and_save(mesh, tmp_path):
  """Called eagerly (no jit of the caller's), the operations gave the empty leaves of the
  features a spec leaves off (a uniform table's weight tree, the version index) shards
  of the global shape on every device, and ``gather_state`` (so a checkpoint's save)
  failed on them. Each operation is jitted now (``mesh.context``'s ``smap``)."""
  from funcreplay import checkpoint
  spec = fr.TableSpec(4 * 4, ITEM)
  t = frs.make_sharded_table(spec, mesh)
  st = t.insert(t.init(), tagged_items(N, 2, 0))  # both eager
  host = frs.gather_state(st)
  assert host.weight_tree.shape == (N, 0) and host.occupied.sum() == 2 * N
  leaf_equal(host, frs.gather_state(jax.jit(t.insert)(jax.jit(t.init)(),
                                                      tagged_items(N, 2, 0))))
  checkpoint.save(str(tmp_path / "eager"), st, spec)
  leaf_equal(checkpoint.restore(str(tmp_path / "eager"), as_numpy=True).state, host)


def test_errors(mesh):
  with pytest.raises(ValueError, match="multiple"):
    frs.make_sharded_table(fr.TableSpec(10, ITEM), mesh)
  with pytest.raises(ValueError, match="mesh has axes"):
    frs.make_sharded_table(fr.TableSpec(8, ITEM), mesh, axis="model")
  t = frs.make_sharded_table(fr.TableSpec(8, ITEM), mesh)
  st = None  # every check below fires before the state is read
  with pytest.raises(ValueError, match="shard axis first"):
    t.insert(st, tagged_items(2, 2, 0))
  with pytest.raises(ValueError, match=r"insert version"):
    t.insert(st, tagged_items(N, 2, 0), version=np.zeros((3,)))
  with pytest.raises(ValueError, match="slots must be"):
    t.delete(st, np.zeros((2,), np.int32), np.zeros((2,), np.uint32))
  q = frs.make_sharded_table(fr.queue(8, ITEM), mesh)
  with pytest.raises(ValueError, match="no global order"):
    q.sample_global(None, jax.random.PRNGKey(0), batch_size=1)


def test_explicit_mesh():
  """jax.make_mesh's default Explicit axes: inputs are resharded, outputs keep P('data')."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 CPU devices; run by test_suite_on_8_cpu_devices in a subprocess")
  mesh = jax.make_mesh((N,), ("data",))
  t = frs.make_sharded_table(fr.TableSpec(4 * 4, ITEM), mesh)

  @jax.jit
  def go(key):
    st = t.insert(t.init(), tagged_items(N, 3, 0), version=0)
    st, out = t.sample_global(st, key, batch_size=5)
    return t.count(st), out.valid, out.data["tag"]

  n, valid, tags = go(jax.random.PRNGKey(0))
  assert int(n) == 12 and valid.sharding.spec[0] == "data"
  assert int(np.sum(np.asarray(valid))) == 5
  assert set(np.asarray(tags)[np.asarray(valid)]) <= set(range(12))
