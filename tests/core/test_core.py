"""Core contract tests: distributions, sequence invariants, transforms, counters, errors."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from scipy import stats as sstats

import funcreplay as fr
from funcreplay.core import counters as ctr
from funcreplay.core import indexes
from tests.helpers import ITEM, counters_dict, host_sample, items_from_ids, jitted

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")

# Chi-square tests use fixed seeds; a p-value below this means the
# distribution is wrong (false-alarm rate 1e-4 per test if it were random).
P_MIN = 1e-4


def _fill(spec, n, version=0):
  f = jitted(spec)
  state = f["table"].init()
  return f["insert"](state, items_from_ids(np.arange(n)), version=version)


def _sample_counts(spec, state, n_draws, batch_size, where=None, version=None, replace=False,
                   seed=0):
  table = fr.make_table(spec)

  @jax.jit
  def run(state, key):
    def body(st, k):
      st, b = table.sample(st, k, batch_size=batch_size, where=where, version=version,
                           replace=replace)
      return st, (b.info.slot, b.valid)
    return lax.scan(body, state, jax.random.split(key, n_draws))[1]

  slots, valid = run(state, jax.random.PRNGKey(seed))
  return np.asarray(slots), np.asarray(valid)


def test_uniform_without_replacement_is_uniform_over_eligible():
  spec = fr.TableSpec(20, ITEM, max_staleness=3)
  f = jitted(spec)
  state = f["table"].init()
  # slots 0-9 at version 0 (stale at version 5), 10-19 at version 4
  state = f["insert"](state, items_from_ids(np.arange(10)), version=0)
  state = f["insert"](state, items_from_ids(np.arange(10, 20)), version=4)
  where = jnp.arange(20) % 5 != 0   # also exclude 10 and 15
  slots, valid = _sample_counts(spec, state, 4000, 4, where=where, version=5)
  assert valid.all()
  for row in slots:
    assert len(set(row.tolist())) == 4, "repeated slot within a batch"
  eligible = [s for s in range(10, 20) if s % 5 != 0]
  counts = np.bincount(slots.ravel(), minlength=20)
  assert counts[[s for s in range(20) if s not in eligible]].sum() == 0
  p = sstats.chisquare(counts[eligible]).pvalue
  assert p > P_MIN, f"uniform chi-square p={p}"


def test_ring_window_tracks_holes():
  """A Fifo table samples by ring position exactly while size == filled."""
  from funcreplay.core import sampling
  spec = fr.TableSpec(16, ITEM)
  f = jitted(spec)
  window = lambda st: tuple(int(x) for x in sampling.ring_window(spec, st))  # noqa: E731
  state = _fill(spec, 5)
  assert window(state) == (0, 5) and int(state.size) == 5
  state = f["insert"](state, items_from_ids(np.arange(5, 21)), version=0)  # wraps: 21 written
  assert window(state) == (5, 16) and int(state.size) == 16
  state = f["delete"](state, np.array([7], np.int32), state.key[7:8])
  assert int(state.size) == 15  # a hole: the occupancy tree draws until it is overwritten
  state = f["insert"](state, items_from_ids(np.arange(21, 37)), version=0)
  assert window(state) == (5, 16) and int(state.size) == 16


@pytest.mark.parametrize("holes", [False, True])
def test_uniform_heavy_masks_need_several_rounds(holes):
  """12 of 64 items eligible, batches of 10: the draw needs several rounds (and
  sometimes the O(C) completion), with the ring draw (no holes) or the tree
  draw (holes); either way distinct eligible slots, uniform inclusion, and
  the trees equal a rebuild afterwards."""
  from tests.helpers import assert_trees_consistent
  spec = fr.TableSpec(64, ITEM, max_staleness=0)
  f = jitted(spec)
  state = _fill(spec, 64, version=0)
  eligible = np.arange(64) % 5 == 0  # 13 slots; slot 0 deleted or stale below
  state = f["insert"](state, items_from_ids(np.arange(64, 128)), version=0)
  versions = np.where(eligible, 7, 0).astype(np.int32)
  state = state.replace(version=jnp.asarray(versions))
  if holes:
    state = f["delete"](state, np.array([0, 1], np.int32), state.key[:2])
  else:
    state = state.replace(version=state.version.at[0].set(0))
  eligible[0] = False
  state = jax.jit(functools.partial(indexes.rebuild, spec))(state)  # columns set by hand
  slots, valid = _sample_counts(spec, state, 1500, 10, version=7, seed=3)
  assert valid.all()
  assert all(len(set(r.tolist())) == 10 for r in slots), "repeated slot within a batch"
  counts = np.bincount(slots.ravel(), minlength=64)
  assert counts[~eligible].sum() == 0
  p = sstats.chisquare(counts[eligible]).pvalue
  assert p > P_MIN, f"inclusion chi-square p={p}"
  state, _ = f["sample"](state, jax.random.PRNGKey(9), batch_size=10, version=7)
  assert_trees_consistent(spec, state)


def test_probability_and_num_eligible_reported():
  spec = fr.TableSpec(16, ITEM)
  state = _fill(spec, 10)
  state, b = jitted(spec)["sample"](state, jax.random.PRNGKey(1), batch_size=4)
  np.testing.assert_allclose(np.asarray(b.info.probability), 0.1)
  assert int(b.num_eligible) == 10


@pytest.mark.parametrize("capacity,batch", [(50, 7), (13, 13), (8, 3), (1, 1)])
def test_fifo_ring_keeps_the_live_window(capacity, batch):
  """Strictly increasing payloads: every sample belongs to the last `capacity` inserted."""
  spec = fr.TableSpec(capacity, ITEM)
  f = jitted(spec)
  state = f["table"].init()
  key = jax.random.PRNGKey(0)
  next_id = 0
  for _ in range(5 * capacity // batch + 3):
    state = f["insert"](state, items_from_ids(np.arange(next_id, next_id + batch)), version=0)
    next_id += batch
    key, k = jax.random.split(key)
    bs = min(capacity, 16)
    state, b = f["sample"](state, k, batch_size=bs)
    x = np.asarray(b.data["x"])[np.asarray(b.valid)]
    lo = max(0, next_id - capacity)
    assert ((x >= lo) & (x < next_id)).all(), (x, lo, next_id)
    assert len(x) == min(bs, next_id - lo)
    np.testing.assert_array_equal(np.asarray(b.data["y"])[np.asarray(b.valid)][:, 1], -x)


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


def test_empty_table_sample_is_all_invalid():
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized())
  f = jitted(spec)
  state, b = f["sample"](f["table"].init(), jax.random.PRNGKey(0), batch_size=4)
  assert not np.asarray(b.valid).any()
  np.testing.assert_array_equal(np.asarray(b.info.slot), -1)
  assert counters_dict(state)["samples"] == 0


def test_partial_batch_marks_missing_rows_invalid():
  spec = fr.TableSpec(8, ITEM)
  state = _fill(spec, 3)
  state, b = jitted(spec)["sample"](state, jax.random.PRNGKey(0), batch_size=6)
  np.testing.assert_array_equal(np.asarray(b.valid), [1, 1, 1, 0, 0, 0])
  assert sorted(np.asarray(b.data["x"])[:3].tolist()) == [0, 1, 2]
  np.testing.assert_array_equal(np.asarray(b.data["y"])[3:], 0)


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
  state = _fill(spec, 4)
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
  state = _fill(spec, 4)
  old_key = int(state.key[0])
  state = f["insert"](state, items_from_ids([10]), version=0)  # overwrites slot 0
  state = f["delete"](state, np.array([0, 1], np.int32), np.array([old_key, int(state.key[1])],
                                                                   np.uint32))
  assert np.asarray(state.occupied).tolist() == [True, False, True, True]
  assert counters_dict(state)["deletes"] == 1


def test_rate_limiter_predicates():
  spec = fr.TableSpec(8, ITEM, rate_limiter=fr.MinSize(3))
  table = fr.make_table(spec)
  state = _fill(spec, 2)
  assert not bool(table.can_sample(state, 1))
  state = jitted(spec)["insert"](state, items_from_ids([9]), version=0)
  assert bool(table.can_sample(state, 3)) and not bool(table.can_sample(state, 4))
  q = fr.queue(2, ITEM)
  qt = fr.make_table(q)
  qs = qt.init()
  assert bool(qt.can_insert(qs, 2)) and not bool(qt.can_insert(qs, 3))
  assert not bool(qt.can_sample(qs, 1))


# --- bad input -----------------------------------------------------------------

def test_batch_larger_than_capacity_is_an_error():
  spec = fr.TableSpec(4, ITEM)
  with pytest.raises(ValueError, match="exceeds the table capacity 4"):
    fr.make_table(spec).insert(fr.make_table(spec).init(), items_from_ids(np.arange(5)))


def test_insert_wrong_shape_or_dtype_names_the_leaf():
  spec = fr.TableSpec(4, ITEM)
  table = fr.make_table(spec)
  bad = {"x": jnp.zeros((2,), jnp.int32), "y": jnp.zeros((2, 3), jnp.float32)}
  with pytest.raises(ValueError, match=r"\['y'\].*expected shape \[B, 2\]"):
    table.insert(table.init(), bad)
  bad = {"x": jnp.zeros((2,), jnp.float32), "y": jnp.zeros((2, 2), jnp.float32)}
  with pytest.raises(TypeError, match=r"\['x'\].*expected dtype int32"):
    table.insert(table.init(), bad)


def test_check_items_reports_leaf_expected_and_got():
  sig = fr.Signature(ITEM)
  with pytest.raises(ValueError, match="structure does not match"):
    fr.check_items(sig, {"x": np.zeros((2,), np.int32)})
  with pytest.raises(TypeError, match=r"\['y'\]: expected dtype float32, got float64"):
    fr.check_items(sig, {"x": np.zeros((2,), np.int32), "y": np.zeros((2, 2))})
  with pytest.raises(ValueError, match="disagree on the batch size"):
    fr.check_items(sig, {"x": np.zeros((2,), np.int32), "y": np.zeros((3, 2), np.float32)})
  leaves, b = fr.check_items(sig, {"x": 3, "y": np.zeros((2,), np.float32)}, batched=False)
  assert b == 1 and leaves[0].dtype == np.int32


@pytest.mark.parametrize("kwargs,match", [
    (dict(capacity=0), "capacity"),
    (dict(capacity=4, sampler="uniform"), "sampler must be one of"),
    (dict(capacity=4, remover=fr.Prioritized()), "remover must be one of"),
    (dict(capacity=4, max_times_sampled=-1), "max_times_sampled"),
    (dict(capacity=4, max_staleness=-2), "max_staleness"),
    (dict(capacity=4, metadata=("key",)), "built-in column"),
    (dict(capacity=4, metadata=("a", "a")), "duplicate"),
    (dict(capacity=4, default_priority=float("nan")), "default_priority"),
])
def test_spec_validation(kwargs, match):
  with pytest.raises((ValueError, TypeError), match=match):
    fr.TableSpec(signature=ITEM, **kwargs)


def test_float64_signature_rejected_without_x64():
  with pytest.raises(TypeError, match="float64"):
    fr.TableSpec(4, {"x": np.zeros((2,), np.float64)})


def test_specs_are_hashable_and_compare_by_value():
  a = fr.TableSpec(4, ITEM, sampler=fr.Prioritized(0.5))
  b = fr.TableSpec(4, {"x": np.zeros((), np.int32), "y": np.zeros((2,), np.float32)},
                   sampler=fr.Prioritized(0.5))
  assert a == b and hash(a) == hash(b)
  assert a != a.replace(capacity=5)


def test_where_mask_shape_is_checked():
  spec = fr.TableSpec(4, ITEM)
  table = fr.make_table(spec)
  with pytest.raises(ValueError, match="bool mask of shape \\[4\\]"):
    table.sample(table.init(), jax.random.PRNGKey(0), batch_size=2, where=jnp.ones((3,), bool))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(0, 39), st.integers(0, 1),
                                              st.booleans()), min_size=1, max_size=12))
def test_count_tree_refresh_equals_rebuild(capacity, updates):
  """The one-scatter-add refresh of the occupancy tree matches a from-scratch build."""
  from funcreplay.core import trees
  p = 1 << max(0, (capacity - 1).bit_length())
  leaves = np.zeros(p, np.int32)
  tree = trees.build_sum(jnp.asarray(leaves))
  seen, slots, values, valid = set(), [], [], []
  for slot, value, ok in updates:
    slot %= capacity
    ok = ok and slot not in seen  # valid slots are distinct (the documented contract)
    seen |= {slot} if ok else set()
    slots.append(slot), values.append(value), valid.append(ok)
    if ok:
      leaves[slot] = value
  tree = trees.refresh_count(tree, jnp.asarray(slots, jnp.int32), jnp.asarray(values, jnp.int32),
                             jnp.asarray(valid))
  np.testing.assert_array_equal(np.asarray(tree), np.asarray(trees.build_sum(jnp.asarray(leaves))))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 300), st.lists(st.tuples(st.integers(0, 299), st.floats(0, 10, width=32)),
                                     min_size=1, max_size=6), st.integers(0, 2**16))
def test_sum_tree_block_refresh_is_bit_identical(capacity, updates, seed):
  """Few updates recompute 4 levels per step, many 2: the same bits, and those of a
  tree built from scratch (every node fl(left + right) of its children)."""
  from funcreplay.core import trees
  p = 1 << max(0, (capacity - 1).bit_length())
  leaves = np.random.default_rng(seed).random(p).astype(np.float32)
  tree = trees.build_sum(jnp.asarray(leaves))
  slots = np.array([s % capacity for s, _ in updates], np.int32)
  values = np.array([v for _, v in updates], np.float32)
  _, last = np.unique(slots[::-1], return_index=True)  # one value per slot
  keep = np.zeros(len(slots), bool)
  keep[len(slots) - 1 - last] = True
  few = trees.refresh_sum(tree, jnp.asarray(slots), jnp.asarray(values), jnp.asarray(keep))
  pad = 200 - len(slots)  # > 128 entries: the other block size
  many = trees.refresh_sum(tree, jnp.asarray(np.r_[slots, np.zeros(pad, np.int32)]),
                           jnp.asarray(np.r_[values, np.zeros(pad, np.float32)]),
                           jnp.asarray(np.r_[keep, np.zeros(pad, bool)]))
  np.testing.assert_array_equal(np.asarray(few).view(np.uint32), np.asarray(many).view(np.uint32))
  leaves[slots[keep]] = values[keep]
  np.testing.assert_array_equal(np.asarray(few).view(np.uint32),
                                np.asarray(trees.build_sum(jnp.asarray(leaves))).view(np.uint32))
  np.testing.assert_allclose(np.asarray(few[1]), leaves.astype(np.float64).sum(), rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 12), st.floats(0, 1), st.integers(0, 2**16))
def test_blocked_weight_descent_is_the_binary_descent(log_p, zero_frac, seed):
  """``descend_weight_blocked`` (2 levels per step) takes the binary descent's path, bit
  for bit, zero-weight leaves and targets at the interval ends included."""
  from funcreplay.core import inplace, trees
  rng = np.random.default_rng(seed)
  p = 1 << log_p
  leaves = (rng.random(p) * (rng.random(p) >= zero_frac)).astype(np.float32)
  leaves[rng.integers(p)] = 1.0
  tree = trees.build_sum(jnp.asarray(leaves))
  u = np.r_[rng.random(61), 0.0, 1.0 - 2**-24].astype(np.float32) * np.asarray(tree[1])
  want = trees.descend_weight(tree, jnp.asarray(u))
  for levels, top_depth in ((1, 13), (2, 13), (3, 13), (2, 0), (2, 3), (3, 4)):
    got = trees.descend_weight_blocked(tree, jnp.asarray(u), inplace.materialize, levels,
                                       top_depth)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_sample_enabled_false_changes_nothing():
  """``enabled=False`` (a traced gate): the state comes back unchanged, every row
  is invalid with slot -1, and num_eligible still reports the eligible count."""
  spec = fr.TableSpec(16, ITEM, max_times_sampled=1, max_staleness=2)
  state = _fill(spec, 10, version=3)
  f = jax.jit(lambda s, k, on: host_sample(spec)(s, k, batch_size=4, version=4, enabled=on))
  new, out = f(state, jax.random.PRNGKey(0), False)
  for a, e in zip(jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
  assert not np.asarray(out.valid).any()
  assert (np.asarray(out.info.slot) == -1).all()
  assert not np.asarray(out.data["x"]).any()
  assert int(out.num_eligible) == 10
  new, out = f(state, jax.random.PRNGKey(0), True)
  assert np.asarray(out.valid).all() and int(new.size) == 6  # sampled once, freed


def test_sample_split_key_gives_a_key_sequence():
  """``split_key=True`` returns the next key: same key, same (batch, next key);
  following the sequence gives fresh batches; raw and typed keys keep their type."""
  spec = fr.TableSpec(64, ITEM)
  state = _fill(spec, 64)
  f = jax.jit(lambda s, k: host_sample(spec)(s, k, batch_size=8, split_key=True))
  for key in (jax.random.PRNGKey(3), jax.random.key(3)):
    _, a, k1 = f(state, key)
    _, b, k1b = f(state, key)
    np.testing.assert_array_equal(a.info.slot, b.info.slot)
    np.testing.assert_array_equal(jax.random.key_data(k1) if k1.dtype != jnp.uint32 else k1,
                                  jax.random.key_data(k1b) if k1b.dtype != jnp.uint32 else k1b)
    assert k1.dtype == key.dtype and k1.shape == key.shape
    seen, k = set(), key
    for _ in range(6):
      _, out, k = f(state, k)
      seen.add(tuple(np.asarray(out.info.slot).tolist()))
    assert len(seen) == 6
    # A disabled call samples nothing and keeps the key.
    g = jax.jit(lambda s, k: host_sample(spec)(s, k, batch_size=8, split_key=True,
                                                    enabled=False))
    _, out, k2 = g(state, key)
    assert not np.asarray(out.valid).any()
    np.testing.assert_array_equal(jax.random.key_data(k2) if k2.dtype != jnp.uint32 else k2,
                                  jax.random.key_data(key) if key.dtype != jnp.uint32 else key)
