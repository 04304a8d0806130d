"""Reverb's table semantics where funcreplay used to differ (issue 23, items 1-6).

dm-reverb cannot be installed here; the expected behaviours below are the ones
measured against dm-reverb 0.14.0 on the same operation sequences (issue 23).
"""

from __future__ import annotations

import fractions
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sstats

import funcreplay as fr
from funcreplay import checkpoint
from funcreplay.checkpoint import format as fmt
from tests.helpers import (
  ITEM,
  assert_trees_consistent,
  counters_dict,
  items_from_ids,
  jitted,
  stored,
)

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")

# Chi-square tests use fixed seeds; a p-value below this means the
# distribution is wrong (false-alarm rate 1e-4 per test if it were random).
P_MIN = 1e-4


def _ids(state):
  """Item ids (payload ``x``) held by the table, as a set."""
  state = jax.device_get(state)
  return set(np.asarray(stored(state)["x"])[np.asarray(state.occupied)].tolist())


def _insert_one_by_one(spec, ids, priorities=None, rng=None):
  f = jitted(spec)
  state = f["table"].init()
  for n, i in enumerate(ids):
    kw = {} if priorities is None else {"priority": np.float32(priorities[n])}
    if rng is not None:
      kw["rng"] = jax.random.fold_in(rng, n)
    state = f["insert"](state, items_from_ids([i]), **kw)
  return state


# --- 1. removers consider the item being inserted ----------------------------

def test_lifo_remover_evicts_the_new_item():
  spec = fr.TableSpec(3, ITEM, remover=fr.Lifo())
  state = _insert_one_by_one(spec, [0, 1, 2, 3])
  assert _ids(state) == {0, 1, 2}
  c = counters_dict(state)
  assert (c["inserts"], c["evicted_capacity"], int(state.size)) == (4, 1, 3)


def test_lifo_remover_rule_applies_per_row_of_a_batch():
  spec = fr.TableSpec(3, ITEM, remover=fr.Lifo())
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids([0, 1]))
  state = f["insert"](state, items_from_ids([2, 3]))   # 2 fills the table, 3 is evicted at once
  state = f["insert"](state, items_from_ids([4, 5, 6]), mask=np.array([True, False, True]))
  assert _ids(state) == {0, 1, 2}
  assert counters_dict(state)["evicted_capacity"] == 3


@pytest.mark.parametrize("remover,prios,keeps", [
    (fr.MinHeap(), [2.0, 3.0, 4.0, 1.0], {0, 1, 2}),   # the new lowest priority goes
    (fr.MinHeap(), [2.0, 3.0, 4.0, 5.0], {1, 2, 3}),
    (fr.MinHeap(), [2.0, 3.0, 4.0, 2.0], {1, 2, 3}),   # tie: the older item goes
    (fr.MaxHeap(), [4.0, 3.0, 2.0, 5.0], {0, 1, 2}),   # the new highest priority goes
    (fr.MaxHeap(), [4.0, 3.0, 2.0, 1.0], {1, 2, 3}),
    (fr.MaxHeap(), [4.0, 3.0, 2.0, 4.0], {1, 2, 3}),
], ids=["min-new", "min-old", "min-tie", "max-new", "max-old", "max-tie"])
def test_heap_remover_considers_the_new_item(remover, prios, keeps):
  spec = fr.TableSpec(3, ITEM, remover=remover)
  state = _insert_one_by_one(spec, [0, 1, 2, 3], prios)
  assert _ids(state) == keeps
  assert counters_dict(state)["evicted_capacity"] == 1


def test_min_heap_remover_keeps_the_highest_priorities_in_a_batch():
  spec = fr.TableSpec(3, ITEM, remover=fr.MinHeap())
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids([0, 1, 2]),
                      priority=np.array([5.0, 1.0, 3.0], np.float32))
  state = f["insert"](state, items_from_ids([3, 4, 5]),
                      priority=np.array([0.5, 4.0, 2.0], np.float32))
  assert _ids(state) == {0, 2, 4}   # priorities 5, 3, 4


def test_uniform_remover_draws_the_victim_among_capacity_plus_one():
  """The victim is uniform over the C items and the new one (C + 1 outcomes)."""
  c, n = 4, 4000
  spec = fr.TableSpec(c, ITEM, remover=fr.Uniform())
  table = fr.make_table(spec)
  full = table.insert(table.init(), items_from_ids(np.arange(c)), rng=jax.random.PRNGKey(1))

  @jax.jit
  def missing(key):
    st = table.insert(full, items_from_ids([c]), rng=key)
    present = jnp.zeros((c + 1,), bool).at[fr.stored_items(spec, st)["x"]].set(st.occupied)
    return jnp.argmin(present)

  victims = np.asarray(jax.vmap(missing)(jax.random.split(jax.random.PRNGKey(0), n)))
  counts = np.bincount(victims, minlength=c + 1)
  assert counts[c] > 0, "the new item is never the victim"
  assert sstats.chisquare(counts).pvalue > P_MIN, counts


def test_uniform_remover_reaches_every_rank_of_a_large_table():
  """The victim's rank is ``below(hi, lo, size + 1)`` of 64 random bits. A float32
  ``u * (size + 1)`` could not reach them all: at 2**25 + 1 items only multiples of 4, and
  never the new item (rank ``size``); among 1M items some ranks had 8 of the 2**23 values
  and some 9. Checked on the rule itself with a table of that size described by its size."""
  from types import SimpleNamespace

  from funcreplay.core import bits
  from funcreplay.core.ops.insert import new_item_is_victim

  size = 2**25 + 1
  state = SimpleNamespace(size=jnp.int32(size))
  keys = jax.random.split(jax.random.PRNGKey(0), 20_000)
  draw = jax.jit(jax.vmap(lambda k: new_item_is_victim(
      fr.Uniform(), state, jnp.float32(1.0), words=bits.words(k, 1))))
  k, new = (np.asarray(x) for x in draw(keys))
  assert set(np.unique(k % 4)) == {0, 1, 2, 3}
  assert k.max() <= size - 1
  # The new item goes with probability 1 / (size + 1): never seen in 20,000 keys; the
  # top rank, taken by the existing items, is reachable (a key that gives it):
  assert not new.any()
  hi = jnp.uint32(0xFFFFFFFF)
  k_top, new_top = new_item_is_victim(fr.Uniform(), state, jnp.float32(1.0),
                                      words=(hi[None], hi[None]))
  assert bool(new_top) and int(k_top) == size - 1


# --- 3. SampleToInsertRatio keeps the exact ratio ------------------------------

@pytest.mark.parametrize("spi,ratio", [(0.3333, (3333, 10000)), (1.0005, (2001, 2000)),
                                       (0.0004, (1, 2500)), (8.0, (8, 1)),
                                       (fractions.Fraction(1, 3), (1, 3))])
def test_sample_to_insert_ratio_is_exact(spi, ratio):
  assert fr.SampleToInsertRatio(spi, 1, (-10.0, 10.0)).ratio == ratio


def test_a_tiny_ratio_still_earns_samples():
  """spi = 0.0004: one sample per 2500 inserts (rounded to 0 it would starve forever)."""
  spec = fr.TableSpec(100, ITEM, rate_limiter=fr.SampleToInsertRatio(0.0004, 1, (-1.0, 1.0)))
  f = jitted(spec)
  can_sample = jax.jit(f["table"].can_sample)
  state = f["table"].init()
  for n in range(25):   # 2500 inserts
    if n == 24:
      # 2400 inserts, one sample: 0.96 - 1 >= -1, a second would need 1.0 - 2 >= -1.
      state, b = f["sample"](state, jax.random.PRNGKey(n), batch_size=1)
      assert bool(b.valid[0])
      assert not bool(can_sample(state))
    state = f["insert"](state, items_from_ids(np.arange(100)))
  assert bool(can_sample(state))   # 2500 inserts: 1 - 2 >= -1


def test_host_table_samples_at_a_tiny_ratio():
  spec = fr.TableSpec(100, ITEM, rate_limiter=fr.SampleToInsertRatio(0.0004, 1, (-1.0, 1.0)))
  table = fr.Table(spec)
  for _ in range(24):
    table.insert(items_from_ids(np.arange(100)))
  table.sample(1, timeout=0)
  with pytest.raises(TimeoutError):
    table.sample(1, timeout=0)
  table.insert(items_from_ids(np.arange(100)))
  assert bool(table.sample(1, timeout=0).valid[0])


def test_unrepresentable_ratio_is_refused():
  with pytest.raises(ValueError, match="Fraction"):
    fr.SampleToInsertRatio(1 / 3, 1, (-10.0, 10.0))


def test_window_that_deadlocks_is_refused():
  with pytest.raises(ValueError, match="min_diff"):
    fr.RateLimiter(1.0, 10, 20.0, 100.0)   # 20 > spi * min_size = 10
  fr.RateLimiter(1.0, 10, 10.0, 100.0)


def test_window_width_rule():
  """Reverb's rule: max_diff - min_diff >= 2 * max(1, spi)."""
  with pytest.raises(ValueError, match="window"):
    fr.SampleToInsertRatio(3.0, 1, (0.0, 5.9))
  fr.SampleToInsertRatio(3.0, 1, (0.0, 6.0))
  with pytest.raises(ValueError, match="window"):
    fr.SampleToInsertRatio(0.5, 1, 0.9)   # width 1.8 < 2


# --- 2. Fifo remover with holes ---------------------------------------------------

def _fifo_with_a_hole(remover):
  spec = fr.TableSpec(3, ITEM, remover=remover)
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids([0, 1, 2]))
  state = f["delete"](state, np.array([1], np.int32), state.key[1:2])
  return f, f["insert"](state, items_from_ids([3]))


def test_fifo_fill_holes_uses_free_slots_first():
  """Reverb's FIFO remover: capacity 3, insert 0, 1, 2, delete 1, insert 3 -> {0, 2, 3}."""
  f, state = _fifo_with_a_hole(fr.Fifo(fill_holes=True))
  assert _ids(state) == {0, 2, 3} and int(state.size) == 3
  state = f["insert"](state, items_from_ids([4, 5]))   # full: the oldest (0, then 2) go
  assert _ids(state) == {3, 4, 5}
  assert counters_dict(state)["evicted_capacity"] == 2


def test_fifo_ring_overwrites_the_oldest_written_slot():
  """The default ring (documented in the Fifo docstring and README): {2, 3}."""
  _, state = _fifo_with_a_hole(fr.Fifo())
  assert _ids(state) == {2, 3} and int(state.size) == 2


# --- 4. zero-priority items are not eligible -------------------------------------

def _zero_priority_table(max_times=0):
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized(0.6), max_times_sampled=max_times)
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids([0, 1, 2]),
                      priority=np.array([0.0, 2.0, 0.0], np.float32))
  return spec, f, state


def test_zero_priority_items_are_not_counted():
  _, f, state = _zero_priority_table()
  assert int(jax.jit(f["table"].count)(state)) == 1
  assert not bool(jax.jit(f["table"].can_sample)(state, 2))
  state, b = f["sample"](state, jax.random.PRNGKey(0), batch_size=2)
  assert int(b.num_eligible) == 1 and np.asarray(b.valid).tolist() == [True, False]
  # N = 1 eligible item with probability 1: its weight (N * P)**-beta is 1.
  np.testing.assert_allclose(np.asarray(fr.importance_weights(b, 0.4))[0], 1.0)
  # Priorities move items in and out of eligibility.
  state = f["update"](state, np.array([0, 1], np.int32), state.key[:2],
                      np.array([3.0, 0.0], np.float32))
  assert int(jax.jit(f["table"].count)(state)) == 1
  state = f["update"](state, np.array([2], np.int32), state.key[2:3], np.array([1.0], np.float32))
  assert int(jax.jit(f["table"].count)(state)) == 2
  state = f["delete"](state, np.array([0], np.int32), state.key[:1])
  assert int(jax.jit(f["table"].count)(state)) == 1


def test_all_zero_priorities_sample_nothing():
  _, f, state = _zero_priority_table()
  state = f["update"](state, np.array([1], np.int32), state.key[1:2], np.array([0.0], np.float32))
  assert int(jax.jit(f["table"].count)(state)) == 0
  state, b = f["sample"](state, jax.random.PRNGKey(0), batch_size=2)
  assert not np.asarray(b.valid).any() and int(b.num_eligible) == 0


def test_host_table_blocks_on_zero_priority_items():
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized(0.6))
  table = fr.Table(spec)
  table.insert(items_from_ids([0, 1, 2]), priority=np.array([0.0, 2.0, 0.0], np.float32))
  assert table.count() == 1
  with pytest.raises(TimeoutError):
    table.sample(2, timeout=0)
  b = table.sample(2, timeout=0, min_valid=1)
  assert np.asarray(b.valid).tolist() == [True, False] and int(b.num_eligible) == 1


# --- 5. heap ties after a priority update -----------------------------------------

def _tied_then_updated(spec, updated=(0,), n=2):
  """Items 0..n-1 inserted with priority 1, then ``updated`` set to priority 1 again."""
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids(list(range(n))),
                      priority=np.ones((n,), np.float32))
  slots = np.asarray(updated, np.int32)
  state = f["update"](state, slots, state.key[slots], np.ones((len(slots),), np.float32))
  return f, state


@pytest.mark.parametrize("sampler", [fr.MinHeap(), fr.MaxHeap()], ids=lambda s: type(s).__name__)
def test_min_heap_tie_prefers_the_least_recently_updated(sampler):
  """Reverb: insert 0 (p=1), insert 1 (p=1), update 0 to p=1, sample -> item 1."""
  spec = fr.TableSpec(4, ITEM, sampler=sampler)
  f, state = _tied_then_updated(spec)
  _, b = f["sample"](state, jax.random.PRNGKey(0), batch_size=1)
  assert int(b.data["x"][0]) == 1


@pytest.mark.parametrize("sampler", [fr.MinHeap(), fr.MaxHeap()], ids=lambda s: type(s).__name__)
def test_heap_ties_follow_the_order_of_updates_within_one_call(sampler):
  """One call's updates touch their items in order (the last of a duplicate counts)."""
  spec = fr.TableSpec(4, ITEM, sampler=sampler)
  f, state = _tied_then_updated(spec, updated=(2, 0, 1, 2), n=4)
  _, b = f["sample"](state, jax.random.PRNGKey(0), batch_size=4)
  assert np.asarray(b.data["x"]).tolist() == [3, 0, 1, 2]


@pytest.mark.parametrize("sampler", [fr.MinHeap(), fr.MaxHeap()], ids=lambda s: type(s).__name__)
def test_negative_zero_priority_is_zero_in_heap_order(sampler):
  """-0.0 passes every >= 0 check; its float32 bits sorted it before every priority, so a
  MaxHeap sampled it first. It is 0.0: after 2.0 and 1.0 (MaxHeap), and tied with an
  earlier 0.0 by age (MinHeap: the 0.0 inserted first)."""
  spec = fr.TableSpec(4, ITEM, sampler=sampler)
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids([0, 1, 2, 3]),
                      priority=np.float32([1.0, 0.0, 2.0, -0.0]))
  _, b = f["sample"](state, jax.random.PRNGKey(0), batch_size=4)
  want = [2, 0, 1, 3] if isinstance(sampler, fr.MaxHeap) else [1, 3, 0, 2]
  assert np.asarray(b.data["x"]).tolist() == want
  t = fr.Table(spec)  # the host table stores it as 0.0
  t.insert(items_from_ids([0, 1]), priority=np.float32([-0.0, 1.0]))
  assert np.signbit(np.asarray(t.peek(2).info.priority)).tolist() == [False, False]
  t.close()


@pytest.mark.parametrize("remover", [fr.MinHeap(), fr.MaxHeap()], ids=lambda s: type(s).__name__)
def test_heap_remover_tie_evicts_the_least_recently_updated(remover):
  """Full table, a tie for the victim: the item touched least recently goes."""
  spec = fr.TableSpec(2, ITEM, remover=remover)
  f, state = _tied_then_updated(spec)
  # A new item that is never the victim: a higher (MinHeap) / lower (MaxHeap) priority.
  new_p = 5.0 if isinstance(remover, fr.MinHeap) else 0.5
  state = f["insert"](state, items_from_ids([2]), priority=np.float32(new_p))
  assert _ids(state) == {0, 2}
  assert_trees_consistent(spec, state)


def test_heap_tie_stamps_survive_checkpoint_and_growth(tmp_path):
  spec = fr.TableSpec(4, ITEM, sampler=fr.MinHeap(), remover=fr.MaxHeap())
  _, state = _tied_then_updated(spec, updated=(0,), n=3)
  path = checkpoint.save(str(tmp_path / "ck"), state, spec)
  restored, _ = checkpoint.restore(path)
  np.testing.assert_array_equal(np.asarray(restored.touched), np.asarray(state.touched))
  big, _ = checkpoint.restore(path, spec.replace(capacity=8), allow_capacity_growth=True)
  for st, sp in ((restored, spec), (big, spec.replace(capacity=8))):
    _, b = jitted(sp)["sample"](st, jax.random.PRNGKey(0), batch_size=3)
    assert np.asarray(b.data["x"]).tolist() == [1, 2, 0]
    assert_trees_consistent(sp, st)


def test_older_checkpoint_without_stamps_keeps_insertion_order(tmp_path):
  """A checkpoint written before ``touched`` existed restores with the stamps taken
  from the keys: ties keep the insertion order it had."""
  spec = fr.TableSpec(4, ITEM, sampler=fr.MinHeap())
  f = jitted(spec)
  state = f["insert"](f["table"].init(), items_from_ids([0, 1, 2]),
                      priority=np.ones((3,), np.float32))
  path = checkpoint.save(str(tmp_path / "ck"), state, spec)
  mpath = os.path.join(path, "manifest.json")
  with open(mpath) as fh:
    manifest = json.load(fh)
  (old,) = [e for e in manifest["arrays"] if e["leaf"] == ".touched"]
  manifest["arrays"].remove(old)
  os.remove(os.path.join(path, old["file"]))
  manifest[fmt.MANIFEST_CRC] = fmt.manifest_crc32(manifest)  # the edit is the test's own
  with open(mpath, "w") as fh:
    json.dump(manifest, fh)
  restored, _ = checkpoint.restore(path)
  assert np.asarray(restored.touched).tolist() == [0, 1, 2, 0, 3]
  state = f["update"](restored, np.array([0], np.int32), restored.key[:1],
                      np.ones((1,), np.float32))
  _, b = f["sample"](state, jax.random.PRNGKey(0), batch_size=3)
  assert np.asarray(b.data["x"]).tolist() == [1, 2, 0]


def test_only_heap_specs_keep_stamps():
  """Other specs pay nothing: ``touched`` is empty, and they keep their native kernels."""
  for sampler, remover, n in ((fr.Uniform(), fr.Fifo(), 0), (fr.Prioritized(0.6), fr.Lifo(), 0),
                              (fr.MinHeap(), fr.Fifo(), 9), (fr.Uniform(), fr.MaxHeap(), 9)):
    spec = fr.TableSpec(8, ITEM, sampler=sampler, remover=remover)
    assert spec.touch_stamps == bool(n)
    assert fr.make_table(spec).init().touched.shape == (n,)
  assert not fr.native.supports_insert(fr.TableSpec(8, ITEM, sampler=fr.MinHeap()))
  assert fr.native.supports_insert(fr.TableSpec(8, ITEM))
