"""Hypothesis drives random operation sequences through the jitted table and
the plain-Python reference; after every step they must agree."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import given

import funcreplay as fr
from funcreplay.core import selectors as sel
from tests.core.reference import RefTable
from tests.helpers import ITEM, assert_trees_consistent, counters_dict, items_from_ids, jitted

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")

CAP = 7
B_INSERT = 3
B_SAMPLE = 3
K = 3

COMBOS = [
    (fr.Uniform(), fr.Fifo()),
    (fr.Prioritized(0.7), fr.MinHeap()),
    (fr.Fifo(), fr.Lifo()),
    (fr.Lifo(), fr.MaxHeap()),
    (fr.MinHeap(), fr.Fifo()),
    (fr.MaxHeap(), fr.MinHeap()),
    (fr.Prioritized(0.7), fr.Fifo(fill_holes=True)),
    (fr.Fifo(), fr.Fifo()),  # Reverb's queue: the order read off the ring (ring_order)
    (fr.Lifo(), fr.Fifo()),
]


def _spec(sampler, remover, max_times):
  return fr.TableSpec(CAP, ITEM, sampler=sampler, remover=remover, max_times_sampled=max_times,
                      max_staleness=2, metadata=("task",))


def _compare(spec, ref: RefTable, state):
  state = jax.device_get(state)
  occ = np.asarray(state.occupied)
  items = fr.stored_items(spec, state)
  assert occ.tolist() == ref.occ
  for s in np.flatnonzero(occ):
    assert int(state.key[s]) == ref.key[s], f"slot {s} key"
    assert int(state.version[s]) == ref.version[s]
    assert int(state.times_sampled[s]) == ref.times[s]
    assert float(state.priority[s]) == pytest.approx(ref.prio[s])
    assert int(items["x"][s]) == ref.payload[s]
    assert int(state.metadata["task"][s]) == ref.meta["task"][s]
  assert int(state.next_key) == ref.next_key
  got = counters_dict(state)
  for k, v in ref.counters.items():
    assert got[k] == v, f"counter {k}: table {got[k]} != reference {v}"
  assert float(state.max_priority) == pytest.approx(ref.max_priority)
  if spec.needs_remover_tree and ref.size:
    assert int(state.remover_tree[1]) == ref.victim()


op_strategy = st.one_of(
    st.tuples(st.just("insert"), st.lists(st.booleans(), min_size=B_INSERT, max_size=B_INSERT),
              st.one_of(st.none(), st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, -1.0]),
                                            min_size=B_INSERT, max_size=B_INSERT))),
    st.tuples(st.just("sample"), st.booleans()),
    st.tuples(st.just("delete"), st.lists(st.integers(0, CAP - 1), min_size=K, max_size=K),
              st.lists(st.booleans(), min_size=K, max_size=K)),
    st.tuples(st.just("update"), st.lists(st.integers(0, CAP - 1), min_size=K, max_size=K),
              st.lists(st.sampled_from([0.0, 0.25, 1.0, 4.0, float("nan"), -2.0]),
                       min_size=K, max_size=K)),
    st.tuples(st.just("evict_stale")),
    st.tuples(st.just("bump")),
)


@pytest.mark.parametrize("sampler,remover", COMBOS, ids=lambda x: type(x).__name__)
@pytest.mark.parametrize("max_times", [0, 2])
@given(ops=st.lists(op_strategy, min_size=1, max_size=14), seed=st.integers(0, 2**16))
def test_matches_reference(sampler, remover, max_times, ops, seed):
  spec = _spec(sampler, remover, max_times)
  f = jitted(spec)
  state = f["table"].init()
  ref = RefTable(spec)
  version, next_id = 0, 0
  rng = jax.random.PRNGKey(seed)
  for op in ops:
    kind = op[0]
    if kind == "insert":
      mask, prios = op[1], op[2]
      ids = list(range(next_id, next_id + B_INSERT))
      next_id += B_INSERT
      tasks = [i % 3 for i in ids]
      versions = [version] * B_INSERT
      state = f["insert"](state, items_from_ids(ids), version=version, mask=np.array(mask),
                          priority=None if prios is None else np.array(prios, np.float32),
                          metadata={"task": np.array(tasks, np.int32)})
      ref.insert(ids, versions, prios, mask, metadata={"task": tasks})
    elif kind == "sample":
      use_where = op[1]
      where = np.array([s % 2 == 0 for s in range(CAP)]) if use_where else None
      rng, k = jax.random.split(rng)
      state, batch = f["sample"](state, k, batch_size=B_SAMPLE, version=version, where=where)
      valid = np.asarray(batch.valid)
      slots = np.asarray(batch.info.slot)[valid].tolist()
      elig = ref.eligible_slots(version, where)
      # Zero-priority items have probability 0 under prioritized sampling.
      sampleable = [s for s in elig if ref.prio[s] > 0] if spec.prioritized else elig
      assert valid.sum() == min(B_SAMPLE, len(sampleable)), "valid rows != min(B, eligible)"
      assert not valid[int(valid.sum()):].any(), "valid rows must come first"
      assert len(set(slots)) == len(slots), "a slot repeated within a batch"
      assert set(slots) <= set(sampleable), "sampled an ineligible slot"
      assert int(batch.num_eligible) == len(sampleable)
      for row, s in zip(np.flatnonzero(valid), slots):
        assert int(batch.data["x"][row]) == ref.payload[s]
        assert int(batch.info.key[row]) == ref.key[s]
      assert (np.asarray(batch.data["x"])[~valid] == 0).all()
      if sel.is_ordered(spec.sampler):
        assert slots == ref.expected_ordered_sample(B_SAMPLE, version, where)
      ref.apply_sample(slots, version)
    elif kind in ("delete", "update"):
      slots, right_key = op[1], op[2]
      keys = [ref.key[s] if ok else (ref.key[s] + 1) % 2**32 for s, ok in zip(slots, right_key)]
      if kind == "delete":
        state = f["delete"](state, np.array(slots, np.int32), np.array(keys, np.uint32))
        ref.delete(slots, keys)
      else:
        prios = [0.5 * (i + 1) for i in range(K)]
        state = f["update"](state, np.array(slots, np.int32), np.array(keys, np.uint32),
                            np.array(prios, np.float32))
        ref.update_priorities(slots, keys, prios)
    elif kind == "evict_stale":
      state = f["evict"](state, version)
      ref.evict_stale(version)
    elif kind == "bump":
      version += 1
    _compare(spec, ref, state)
  assert_trees_consistent(spec, state)
