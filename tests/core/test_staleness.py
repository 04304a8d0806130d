"""The version index: fresh-item counts equal a brute-force pass in every regime."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcreplay as fr
from funcreplay import checkpoint
from funcreplay.core import indexes, ops, staleness
from tests.helpers import ITEM, assert_trees_consistent, items_from_ids, jitted

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")

CAP = 24


@pytest.mark.parametrize("max_staleness,expected", [
    (0, 8), (3, 8), (4, 16), (100, 256), (2047, staleness.MAX_WINDOW), (2048, 8), (1 << 30, 8)])
def test_window_size(max_staleness, expected):
  assert staleness.window(fr.TableSpec(8, ITEM, max_staleness=max_staleness)) == expected
  assert staleness.window(fr.TableSpec(8, ITEM)) == 0


def _count_fn(spec):
  table = fr.make_table(spec)
  return jax.jit(lambda s, v: (table.count(s, version=v),
                               jnp.sum(ops.eligible_mask(spec, s, v), dtype=jnp.int32)))


# Versions jump around: ahead of and behind the window, negative, far apart.
version_st = st.one_of(st.integers(-3, 12), st.integers(-2000, 2000))


@settings(max_examples=60, deadline=None)
@given(max_staleness=st.sampled_from([0, 2, 5]),
       ops=st.lists(st.one_of(
           st.tuples(st.just("insert"), st.lists(version_st, min_size=1, max_size=6)),
           st.tuples(st.just("delete"), st.lists(st.integers(0, CAP - 1), max_size=5)),
           st.tuples(st.just("sample"), version_st),
           st.tuples(st.just("evict"), version_st)), min_size=1, max_size=12),
       queries=st.lists(version_st, min_size=1, max_size=6))
def test_counts_match_a_full_pass(max_staleness, ops, queries):
  """After any sequence of inserts (any versions, Fifo evictions), deletes, samples
  that free items (max_times_sampled=1) and stale evictions, ``count`` at any
  version equals the O(C) pass, and the index equals a rebuild from the columns."""
  spec = fr.TableSpec(CAP, ITEM, max_staleness=max_staleness, max_times_sampled=1)
  f = jitted(spec)
  count = _count_fn(spec)
  state, next_id = f["table"].init(), 0
  for i, op in enumerate(ops):
    if op[0] == "insert":
      ids = np.arange(next_id, next_id + len(op[1]))
      next_id += len(ids)
      state = f["insert"](state, items_from_ids(ids), version=np.array(op[1], np.int32))
    elif op[0] == "delete":
      slots = np.array(op[1], np.int32)
      state = f["delete"](state, slots, state.key[slots])
    elif op[0] == "sample":
      state, _ = f["sample"](state, jax.random.PRNGKey(i), batch_size=4, version=op[1])
    else:
      state = f["evict"](state, op[1])
    for v in queries + [op[1]] if op[0] in ("sample", "evict") else queries:
      fast, full = count(state, v)
      assert int(fast) == int(full), f"count at version {v}"
  assert_trees_consistent(spec, state)


def test_each_regime_is_exact():
  """Everyone fresh (O(1)), threshold inside the window (O(V)), and the O(C) fallback."""
  spec = fr.TableSpec(64, ITEM, max_staleness=2)  # window of 8 versions
  f = jitted(spec)
  count = _count_fn(spec)
  state = f["table"].init()
  for v in range(0, 40, 2):  # 20 versions, 3 items each: the oldest leave the window
    state = f["insert"](state, items_from_ids(np.arange(3 * v, 3 * v + 3)), version=v)
  hi, n_old, _ = (int(x) for x in state.version_bounds)
  assert hi == 38 and n_old == 3 * 16  # versions 0..30 are older than the window (30, 38]
  young = f["table"].init()  # no item older than the window
  for v in (31, 34, 38):
    young = f["insert"](young, items_from_ids(np.arange(v, v + 2)), version=v)
  assert int(young.version_bounds[1]) == 0
  for st_ in (state, young):
    for v in range(-5, 45):  # every threshold around each boundary
      fast, full = count(st_, v)
      assert int(fast) == int(full), v
  assert int(count(state, 40)[0]) == 3 and int(count(state, 2)[0]) == 60


def test_restoring_a_checkpoint_without_the_index_rebuilds_it(tmp_path):
  """Checkpoints written before the index existed restore with it rebuilt."""
  spec = fr.TableSpec(32, ITEM, max_staleness=1)
  f = jitted(spec)
  state = f["table"].init()
  for v in range(12):
    state = f["insert"](state, items_from_ids(np.arange(4 * v, 4 * v + 4)), version=v)
  path = checkpoint.save(str(tmp_path / "ck"), state, spec)
  mpath = os.path.join(path, "manifest.json")
  with open(mpath) as fh:
    manifest = json.load(fh)
  old = [e for e in manifest["arrays"] if e["leaf"] in (".version_hist", ".version_bounds")]
  assert len(old) == 2
  manifest["arrays"] = [e for e in manifest["arrays"] if e not in old]
  # Those checkpoints were schema 1: no manifest checksum, item rows stored whole.
  assert manifest.pop("rows") is None  # every slot occupied
  manifest.pop("manifest_crc32")
  manifest["schema_version"] = 1
  for e in old:
    os.remove(os.path.join(path, e["file"]))
  with open(mpath, "w") as fh:
    json.dump(manifest, fh)
  restored, _ = checkpoint.restore(path)
  rebuilt = jax.jit(functools.partial(indexes.rebuild, spec))(state)
  np.testing.assert_array_equal(restored.version_hist, rebuilt.version_hist)
  np.testing.assert_array_equal(restored.version_hist, state.version_hist)
  assert int(restored.version_bounds[1]) == int(state.version_bounds[1])
  count = _count_fn(spec)
  for v in (5, 10, 11, 12):
    assert int(count(restored, v)[0]) == int(count(state, v)[1])


@pytest.mark.parametrize("max_staleness,versions,queries", [
    (2**31 - 1, [0, 5], [-2, 0, 2**31 - 1]),              # "no limit" as the int32 maximum
    (2**30, [0, 5], [-2**30 - 5, -2**31, 2**30 + 5]),      # version - max_staleness underflows
    (10, [-2**31 + 3, 7], [-2**31 + 3, -2**31 + 14, 20]),
    (10, [-2**30, 2**30], [2**30, 2**30 + 10, -2**30 + 5]),  # version - item_version overflows
])
def test_extreme_versions_are_exact(max_staleness, versions, queries):
  """Counts, masks and sampled rows agree with exact integer arithmetic for any int32
  versions (no wrap-around in ``version - max_staleness`` or in item ages)."""
  spec = fr.TableSpec(8, ITEM, max_staleness=max_staleness)
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids(np.arange(len(versions))),
                      version=np.array(versions, np.int32))
  count = _count_fn(spec)
  for v in queries:
    truth = sum(int(v) - int(x) <= max_staleness for x in versions)
    fast, full = count(state, np.int32(v))
    assert int(fast) == truth and int(full) == truth, (v, int(fast), int(full), truth)
    _, out = f["sample"](state, jax.random.PRNGKey(0), batch_size=2, version=np.int32(v))
    assert int(out.valid.sum()) == truth and int(out.num_eligible) == truth


def test_staleness_sum_of_a_batch_beyond_65536_rows_is_exact():
  """``sampled_staleness_sum`` adds every valid row's staleness: a sample with replacement
  of 70,000 rows at staleness 65,535 adds 4,587,450,000, which one uint32 half sum of
  16-bit halves wrapped (the kernel's 64-bit sum did not: the executors disagreed;
  found by a review)."""
  b, v = 70_000, 65_535
  spec = fr.TableSpec(16, ITEM)
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids(np.arange(16)), version=0)
  state, batch = f["sample"](state, jax.random.PRNGKey(0), batch_size=b, replace=True,
                             version=v)
  c = {k: fr.counters.to_int(x) for k, x in state.counters.items()}
  assert int(np.sum(batch.valid)) == b == c["samples"]
  assert c["sampled_staleness_sum"] == b * v


@pytest.mark.parametrize("spec_kw", [{}, {"max_staleness": 2**31 - 1}, {"remover": fr.Lifo()}])
def test_staleness_sum_is_exact_for_versions_far_apart(spec_kw):
  """``sampled_staleness_sum`` adds ``max(version - item_version, 0)`` exactly for any two
  int32 versions: in int32 the difference wrapped, so an item 2**32 - 4 versions ahead
  added 4 and one 2**32 - 1 behind added 0 (found by a review). The lean and the general
  sample (a Lifo remover), both executors."""
  spec = fr.TableSpec(8, ITEM, **spec_kw)
  f = jitted(spec)
  vs = np.array([2**31 - 1, -2**31, -2**31 + 2], np.int32)
  state = f["insert"](f["table"].init(), items_from_ids(np.arange(3)), version=vs)
  for v in (-2**31 + 3, 2**31 - 1):
    after, out = f["sample"](state, jax.random.PRNGKey(0), batch_size=3, version=np.int32(v))
    fresh = sum(spec.max_staleness is None or v - x <= spec.max_staleness for x in vs.tolist())
    assert int(out.valid.sum()) == fresh
    picked = np.asarray(out.info.version)[np.asarray(out.valid)].tolist()
    want = sum(max(v - x, 0) for x in picked)
    assert fr.counters.to_int(after.counters["sampled_staleness_sum"]) == want, (v, picked)
