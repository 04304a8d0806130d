"""Checkpoints: bit-exact round trips after random op sequences, every (sampler, remover)
pairing, counters near 2**32, determinism, capacity growth and the sharded round trip.

Cheap by construction: tiny capacities, one compiled spec per sampler reused by
every hypothesis example (the host ``Table`` caches its jitted ops per spec),
a handful of examples each. Crash safety, errors and the host table's checkpointing:
test_checkpoint_faults.py.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcreplay as fr
from funcreplay import checkpoint as ck
from funcreplay.checkpoint import spec_codec
from funcreplay.core import counters as ctr
from tests.checkpoint.common import (
  CAP,
  HERE,
  PAIRS,
  assert_samples_equal,
  assert_states_equal,
  child_env,
  items,
  pairing_spec,
)

# --- op sequences on host tables ---------------------------------------------------

# (delete is left out: one more compilation per spec; reuse limits make holes anyway.)
OPS = st.lists(st.tuples(st.sampled_from(["insert", "sample", "prio", "meta", "version"]),
                         st.integers(0, 2**16)), min_size=1, max_size=12)


def _apply(table, ops, last):
  """Run ops on ``table``; ``last`` is the latest sample (for slot/key based ops)."""
  for op, arg in ops:
    if op == "insert":
      table.insert(items(2, arg % 100), priority=np.float32([arg % 7, 1 + arg % 3]),
                   metadata={"task": arg % 3})
    elif op == "sample":
      if table.count() >= 2:
        last = table.sample(2, timeout=0)
    elif op == "prio" and last is not None:
      table.update_priorities(last.info.slot, last.info.key, np.float32([arg % 5, 0.5]))
    elif op == "delete" and last is not None:
      table.delete(last.info.slot[:1], last.info.key[:1])
    elif op == "meta" and last is not None:
      table.set_metadata(last.info.slot, last.info.key, "task", 7)
    elif op == "version":
      table.set_version(table.version + arg % 3)
  return last


@pytest.mark.parametrize("i", range(len(PAIRS)), ids=lambda i: "-".join(
    type(s).__name__ for s in PAIRS[i]))
@settings(max_examples=6)
@given(ops=OPS, seed=st.integers(0, 2**32 - 1))
def test_round_trip_after_random_ops(i, ops, seed):
  spec = pairing_spec(i)
  table = fr.Table(spec, seed=seed)
  table.insert(items(2, 0))
  last = _apply(table, ops, None)
  with tempfile.TemporaryDirectory() as d:
    path = table.save(os.path.join(d, "c"))
    back = fr.Table.restore(path)
  assert back.spec == spec
  assert_states_equal(table.snapshot(), back.snapshot())
  h1, h2 = table.host_state(), back.host_state()
  assert h1["version"] == h2["version"] and h1["rng"].tobytes() == h2["rng"].tobytes()
  # The same future calls give the same results on both tables.
  more = [("insert", 5), ("sample", 0), ("prio", 1), ("insert", 9), ("sample", 0)]
  _apply(table, more, last)
  _apply(back, more, last)
  if table.count() >= 2:
    assert_samples_equal(table.sample(2, timeout=0), back.sample(2, timeout=0))
  assert_states_equal(table.snapshot(), back.snapshot())


@pytest.mark.parametrize("sampler,remover", list(itertools.product(
    [fr.Uniform(), fr.Prioritized(0.5), fr.Fifo(), fr.Lifo(), fr.MinHeap(), fr.MaxHeap()],
    [fr.Uniform(), fr.Fifo(), fr.Lifo(), fr.MinHeap(), fr.MaxHeap()])),
    ids=lambda s: type(s).__name__)
def test_every_pairing_round_trips_arbitrary_bits(sampler, remover, tmp_path):
  """No compilation: fill every leaf of a pairing's state with random bits."""
  spec = fr.TableSpec(5, {"a": jnp.zeros((3,), jnp.bfloat16), "b": [jnp.zeros((), jnp.uint8)]},
                      sampler=sampler, remover=remover, metadata=("m1", "m2"),
                      rate_limiter=fr.SampleToInsertRatio(2.5, 3, 10.0), default_priority=0.25)
  shapes = jax.eval_shape(fr.make_table(spec).init)
  rng = np.random.default_rng(0)

  def random_bits(s):
    nbytes = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(s.dtype).reshape(s.shape)

  state = jax.tree_util.tree_map(random_bits, shapes)
  path = ck.save(tmp_path / "c", state, spec, extra={"step": 3})
  r = ck.restore(path, as_numpy=True)
  assert r.spec == spec and r.extra == {"step": 3} and r.host is None
  assert_states_equal(state, r.state)
  assert spec_codec.spec_from_json(json.loads(json.dumps(spec_codec.spec_to_json(spec)))) == spec


def test_counters_near_2_pow_32_survive(tmp_path):
  spec = pairing_spec(0)
  state = fr.make_table(spec).init()
  big = {name: ctr.from_int(2**32 - 2) for name in state.counters}
  state = state.replace(counters=big, next_key=jnp.uint32(2**32 - 1),
                        limiter_diff=jnp.int32(2**30 - 1))
  # A synthetic state (counters not matching its size): trusted, not checked.
  a = fr.Table.from_state(spec, state, seed=5, check=False)  # reuses the spec's compiled ops
  a.insert(items(2, 0), priority=np.float32([1, 2]))
  a.insert(items(2, 4), priority=np.float32([3, 4]))
  want = a.stats().to_dict()["inserts"]
  assert want == 2**32 + 2
  path = a.save(tmp_path / "c")
  b = fr.Table.restore(path, check=False)
  assert_states_equal(a.snapshot(), b.snapshot())
  st_b = jax.device_get(b.snapshot())
  assert b.stats().to_dict()["inserts"] == want
  assert int(st_b.next_key) == 3  # wrapped past 2**32
  np.testing.assert_array_equal(st_b.key[:4], np.uint32([2**32 - 1, 0, 1, 2]))
  assert int(st_b.limiter_diff) == 2**30  # saturated, as documented
  assert_samples_equal(a.sample(2), b.sample(2))


def test_table_determinism_with_uniform_remover(tmp_path):
  """Inserts split the host key with a Uniform remover: restore continues the stream."""
  spec = pairing_spec(4)  # MinHeap sampler, Uniform remover
  a = fr.Table(spec, seed=11, version=3)
  for k in range(5):
    a.insert(items(2, 10 * k), priority=np.float32([k, 5 - k]))
  path = ck.save_table(a, tmp_path / "c")
  b = ck.restore_table(path)
  assert b.version == 3
  for k in range(4):
    a.insert(items(2, 100 + k))
    b.insert(items(2, 100 + k))
  assert_samples_equal(a.sample(3), b.sample(3))
  assert_states_equal(a.snapshot(), b.snapshot())


# --- capacity growth -----------------------------------------------------------------

def test_capacity_growth_fifo_ring_keeps_order(tmp_path):
  spec = pairing_spec(0)  # Uniform sampler, Fifo remover, capacity 6
  a = fr.Table(spec)
  for k in range(4):  # keys 0..7 into 6 slots: wraps, write_pos = 2
    a.insert(items(2, 2 * k))
  a.delete([3], [3])  # a hole in the ring (key 3 sat in slot 3)
  path = a.save(tmp_path / "c")
  big = spec.replace(capacity=10)
  with pytest.raises(ck.CheckpointError, match="allow_capacity_growth"):
    fr.Table.restore(path, spec=big)
  b = fr.Table.restore(path, spec=big, allow_capacity_growth=True)
  st_b = jax.device_get(b.snapshot())
  # Ring unrolled from write_pos (oldest-written slot first), the hole kept in place.
  np.testing.assert_array_equal(st_b.occupied, [1, 0, 1, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(st_b.key[[0, 2, 3, 4, 5]], [2, 4, 5, 6, 7])
  np.testing.assert_array_equal(fr.stored_items(spec, st_b)["act"][[0, 2, 3, 4, 5]],
                                [2, 4, 5, 6, 7])
  assert int(st_b.write_pos) == 6 and b.size == 5
  assert b.stats().to_dict()["inserts"] == 8 and b.stats().to_dict()["deletes"] == 1
  for k in range(3):  # keys 8..11 fill slots 6..9, key 12 evicts the oldest (2), 13 the hole
    b.insert(items(2, 100 + 2 * k))
  st_b = jax.device_get(b.snapshot())
  assert sorted(st_b.key[st_b.occupied].tolist()) == list(range(4, 14))
  assert int(st_b.occ_tree[1]) == 10 and b.stats().to_dict()["evicted_capacity"] == 3


@pytest.mark.parametrize("i", [1, 2], ids=["Prioritized-Lifo", "Fifo-MinHeap"])
def test_capacity_growth_rebuilds_trees(i, tmp_path):
  spec = pairing_spec(i)
  a = fr.Table(spec)
  for k in range(4):
    a.insert(items(2, 10 * k), priority=np.float32([k + 1, 5 - k]))
  path = a.save(tmp_path / "c")
  big = spec.replace(capacity=11)
  r = ck.restore(path, big, allow_capacity_growth=True, as_numpy=True)
  s, old = r.state, jax.device_get(a.snapshot())
  assert_states_equal(old.counters, s.counters)
  np.testing.assert_array_equal(s.key[:CAP], old.key)  # these removers keep slots
  np.testing.assert_array_equal(s.occupied, np.r_[old.occupied, np.zeros(5, bool)])
  p = big.tree_size
  assert s.occ_tree.shape == (2 * p,) and p == 16
  np.testing.assert_array_equal(s.occ_tree[p:], np.r_[s.occupied, np.zeros(5, bool)])
  np.testing.assert_array_equal(s.occ_tree[1:p], s.occ_tree[2:2 * p:2] + s.occ_tree[3:2 * p:2])
  age = (s.next_key - s.key).astype(np.int64)
  occ = np.flatnonzero(s.occupied)
  if i == 1:  # Prioritized(0.7) sampler, Lifo remover: victim = newest item
    w = np.where(s.occupied, np.power(s.priority, 0.7, dtype=np.float32), 0)
    np.testing.assert_allclose(s.weight_tree[p:p + 11], w, rtol=1e-6)
    np.testing.assert_allclose(s.weight_tree[1], w.sum(), rtol=1e-5)
    assert s.remover_tree[1] == occ[np.argmin(age[occ])]
  else:  # MinHeap remover: lowest priority, ties oldest first
    best = min(occ, key=lambda j: (s.priority[j], -age[j]))
    assert s.remover_tree[1] == best


# --- sharded ---------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_sharded_round_trip_on_4_devices(tmp_path):
  env = child_env()
  env["XLA_FLAGS"] = ("--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 "
                      "--xla_llvm_disable_expensive_passes=true")
  out = subprocess.run([sys.executable, os.path.join(HERE, "checkpoint_worker.py"), "sharded",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=140)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  assert res["devices"] == 4 and res["num_shards"] == 4
  assert res["leaves_equal"] and res["sharded_ok"] and res["same_sample"]
  assert res["numpy_shape"] == [4, 4] and res["grown_shape"] == [4, 8]
  assert res["size"] == res["grown_size"] > 0
  assert "pass mesh=" in res["errors"]["no_mesh"]
  assert "4 shards but mesh axis 'data' has 2" in res["errors"]["wrong_mesh"]
  assert "cannot become a host Table" in res["errors"]["host_table"]
