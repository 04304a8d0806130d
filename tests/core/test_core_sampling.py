"""Core contract tests, sampling: distributions (chi-square over the eligible slots),
the ring window, the live window of a Fifo ring, reported probabilities, empty and
partial batches, the ``enabled`` gate and ``split_key``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from scipy import stats as sstats

import funcreplay as fr
from funcreplay.core import indexes
from tests.core.common import fill
from tests.helpers import ITEM, counters_dict, host_sample, items_from_ids, jitted

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")

# Chi-square tests use fixed seeds; a p-value below this means the
# distribution is wrong (false-alarm rate 1e-4 per test if it were random).
P_MIN = 1e-4


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
  state = fill(spec, 5)
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
  state = fill(spec, 64, version=0)
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
  state = fill(spec, 10)
  state, b = jitted(spec)["sample"](state, jax.random.PRNGKey(1), batch_size=4)
  np.testing.assert_allclose(np.asarray(b.info.probability), 0.1)
  assert int(b.num_eligible) == 10


@pytest.mark.parametrize("alpha,priorities,heavy", [
    (2.0, [1e20, 1.0, 1.0, 2.0], [0]),            # 1e40 would overflow float32
    (1.0, [3e38, 3e38, 1.0, 2.0], [0, 1]),        # each fits, their sum would not
    (1.0, [3e38, 1e30, 1.0, np.finfo(np.float32).max], [0, 1, 3]),
])
def test_prioritized_draws_of_weights_beyond_float32_stay_proportional(alpha, priorities,
                                                                     heavy):
  """Weights saturate at ``powers.MAX_WEIGHT`` (2**96), so the sum tree stays finite: the
  heaviest items are drawn, equally often, with probabilities in (0, 1]. Before, the
  total overflowed to inf and every draw took slot 0's neighbour of weight 1 with
  probability 0 (found by a review against Reverb, whose weights are doubles)."""
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized(alpha))
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids(np.arange(4)),
                      priority=jnp.asarray(priorities, jnp.float32))
  assert np.isfinite(float(state.weight_tree[1]))
  slots, valid = _sample_counts(spec, state, 2000, 1, replace=True)
  assert valid.all()
  counts = np.bincount(slots.ravel(), minlength=4)
  assert set(np.flatnonzero(counts)) == set(heavy), counts
  if len(heavy) > 1:
    assert sstats.chisquare(counts[heavy]).pvalue > P_MIN, counts
  _, b = f["sample"](state, jax.random.PRNGKey(3), batch_size=4)
  prob = np.asarray(b.info.probability)
  assert np.all((prob >= 0) & (prob <= 1)) and np.all(np.isfinite(prob))
  np.testing.assert_array_equal(prob[np.isin(np.asarray(b.info.slot), heavy)],
                                np.float32(1 / len(heavy)))


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


def test_empty_table_sample_is_all_invalid():
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized())
  f = jitted(spec)
  state, b = f["sample"](f["table"].init(), jax.random.PRNGKey(0), batch_size=4)
  assert not np.asarray(b.valid).any()
  np.testing.assert_array_equal(np.asarray(b.info.slot), -1)
  assert counters_dict(state)["samples"] == 0


def test_partial_batch_marks_missing_rows_invalid():
  spec = fr.TableSpec(8, ITEM)
  state = fill(spec, 3)
  state, b = jitted(spec)["sample"](state, jax.random.PRNGKey(0), batch_size=6)
  np.testing.assert_array_equal(np.asarray(b.valid), [1, 1, 1, 0, 0, 0])
  assert sorted(np.asarray(b.data["x"])[:3].tolist()) == [0, 1, 2]
  np.testing.assert_array_equal(np.asarray(b.data["y"])[3:], 0)

def test_sample_enabled_false_changes_nothing():
  """``enabled=False`` (a traced gate): the state comes back unchanged, every row
  is invalid with slot -1, and num_eligible still reports the eligible count."""
  spec = fr.TableSpec(16, ITEM, max_times_sampled=1, max_staleness=2)
  state = fill(spec, 10, version=3)
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
  state = fill(spec, 64)
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
