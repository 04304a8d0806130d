"""The position index (``TableSpec(position_index=True)``, ``core.position_index``).

Checked here: the primitives against a reference model of the documented rule (appends
in row order; a removal's r-th hole in row order takes its r-th filler in position
order); every operation keeps the index valid (hypothesis over specs and operation
sequences); the uniform sample takes ``order[x]`` for its positions ``x`` and is uniform
over a table with holes (chi-square); checkpoints keep the index (same key, same batch)
and rebuild or drop it for a spec that differs; the host ``Table``'s native kernels keep
it as the portable programs do; the lean programs stay lean (no conditional, loop or copy).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import funcreplay as fr
from funcreplay import checkpoint
from funcreplay.core import hlo
from funcreplay.core import position_index as pi
from funcreplay.core.sampling import uniform_lean
from tests import helpers
from tests.core.common import SMALL_ITEM, small_items

EXAMPLE = SMALL_ITEM
CAP = 8
_items = small_items


def _assert_valid(state, what=""):
  why = pi.check(state.position_index, state.occupied)
  assert not why, (what, why, np.asarray(state.position_index), np.asarray(state.occupied))


def test_spec_field_and_its_errors():
  assert fr.TableSpec(CAP, EXAMPLE).position_index is False
  spec = fr.TableSpec(CAP, EXAMPLE, position_index=True, max_times_sampled=2)
  assert spec.position_index and spec.replace(capacity=16).position_index
  assert fr.make_table(spec).init().position_index.shape == (2, CAP + 1)
  assert fr.make_table(spec.replace(position_index=False)).init().position_index.shape == (2, 0)
  with pytest.raises(TypeError, match="position_index must be a bool"):
    fr.TableSpec(CAP, EXAMPLE, position_index=1)
  with pytest.raises(ValueError, match="Uniform"):
    fr.TableSpec(CAP, EXAMPLE, position_index=True, sampler=fr.Prioritized(0.6))
  with pytest.raises(ValueError, match="holes=True"):
    fr.TableSpec(CAP, EXAMPLE, position_index=True, holes=False)


# --- the primitives against a reference model ---------------------------------------------


class _Model:
  """The documented rule in plain Python."""

  def __init__(self):
    self.order = []

  def add(self, slots, fresh):
    self.order += [s for s, f in zip(slots, fresh) if f]

  def drop(self, slots, gone):
    where = {s: p for p, s in enumerate(self.order)}
    removed = [where[s] for s, g in zip(slots, gone) if g]
    n_after = len(self.order) - len(removed)
    holes = [p for p in removed if p < n_after]
    fillers = [q for q in range(n_after, len(self.order)) if q not in set(removed)]
    assert len(holes) == len(fillers)
    for h, f in zip(holes, fillers):
      self.order[h] = self.order[f]
    del self.order[n_after:]


_add = jax.jit(pi.add)
_drop = jax.jit(pi.drop)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_add_and_drop_follow_the_rule(data):
  c, b = 12, 5
  model, index = _Model(), jnp.full((2, c + 1), -1, jnp.int32).at[0, c].set(0)
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
  for _ in range(data.draw(st.integers(1, 12))):
    occupied = set(model.order)
    free = [s for s in range(c) if s not in occupied]
    if data.draw(st.booleans()) and free:  # add: fresh rows among others (masked off)
      k = int(rng.integers(0, min(len(free), b) + 1))
      slots = list(rng.permutation(free)[:k])
      fresh = [True] * k
      while len(slots) < b:  # rows that add nothing: any slot, not fresh
        slots.append(int(rng.integers(c)))
        fresh.append(False)
      perm = rng.permutation(b)
      slots, fresh = [int(slots[i]) for i in perm], [fresh[i] for i in perm]
      model.add(slots, fresh)
      index = _add(index, jnp.asarray(slots, jnp.int32), jnp.asarray(fresh))
    elif occupied:
      k = int(rng.integers(0, min(len(occupied), b) + 1))
      slots = [int(s) for s in rng.permutation(sorted(occupied))[:k]]
      gone = [True] * k
      while len(slots) < b:
        slots.append(int(rng.integers(c)))
        gone.append(False)
      perm = rng.permutation(b)
      slots, gone = [slots[i] for i in perm], [gone[i] for i in perm]
      model.drop(slots, gone)
      index = _drop(index, jnp.asarray(slots, jnp.int32), jnp.asarray(gone))
    occ = np.zeros(c, bool)
    occ[model.order] = True
    assert not pi.check(index, occ), pi.check(index, occ)
    assert np.asarray(index)[0, :len(model.order)].tolist() == model.order


def test_rebuild_is_slot_order():
  occ = np.array([0, 1, 1, 0, 1, 0, 0, 1], bool)
  index = np.asarray(pi.rebuild(jnp.asarray(occ)))
  assert index[0, :4].tolist() == [1, 2, 4, 7] and index[0, CAP] == 4
  assert index[1, :CAP].tolist() == [-1, 0, 1, -1, 2, -1, -1, 3]
  assert not pi.check(index, occ)


# --- every operation keeps it -------------------------------------------------------------

SPECS = [
    dict(),
    dict(max_times_sampled=1),
    dict(max_times_sampled=2, max_staleness=1),
    dict(remover=fr.Fifo(fill_holes=True), max_times_sampled=2),
    dict(remover=fr.Uniform()),
    dict(remover=fr.Lifo(), max_times_sampled=1),
    dict(remover=fr.MinHeap(), max_times_sampled=2),
]

_OP = st.sampled_from(["insert", "insert_masked", "sample", "sample_where", "delete",
                       "evict_stale", "update"])


@settings(max_examples=8, deadline=None)
@given(kw=st.sampled_from(SPECS), ops=st.lists(_OP, min_size=4, max_size=14),
       seed=st.integers(0, 2**16))
def test_every_operation_keeps_the_index(kw, ops, seed):
  spec = fr.TableSpec(CAP, EXAMPLE, position_index=True, **kw)
  t = helpers.jitted(spec)
  rng = np.random.default_rng(seed)
  key = jax.random.PRNGKey(seed)
  state, version, n = t["table"].init(), 0, 0
  for op in ["insert"] + ops:
    key, k = jax.random.split(key)
    ver = {"version": version} if spec.max_staleness is not None else {}
    if op.startswith("insert"):
      b = int(rng.integers(1, 6))
      mask = jnp.asarray(rng.random(b) < 0.7) if op == "insert_masked" else None
      state = t["insert"](state, _items(b, n), version=version, mask=mask, rng=k)
      n += b
    elif op.startswith("sample"):
      where = jnp.asarray(rng.random(CAP) < 0.6) if op == "sample_where" else None
      state, _ = t["sample"](state, k, batch_size=int(rng.integers(1, 5)),
                          replace=bool(rng.integers(2)), where=where, **ver)
    elif op == "delete":
      occ = np.flatnonzero(np.asarray(state.occupied))
      pick = rng.permutation(occ)[:int(rng.integers(0, 4))]
      state = t["delete"](state, jnp.asarray(pick, jnp.int32),
                       jnp.asarray(np.asarray(state.key)[pick]))
    elif op == "evict_stale" and spec.max_staleness is not None:
      version += 1
      state = t["evict"](state, version)
    elif op == "update":
      occ = np.flatnonzero(np.asarray(state.occupied))[:2]
      state = t["update"](state, jnp.asarray(occ, jnp.int32),
                          jnp.asarray(np.asarray(state.key)[occ]), jnp.full((len(occ),), 2.0))
    _assert_valid(state, (kw, op))
    helpers.assert_trees_consistent(spec, state)


# --- the sample ---------------------------------------------------------------------------


def _history():
  """A table of capacity 8 whose index is not in slot order: 6 items, two deleted, three
  more inserted (one into a hole, the ring's next slot)."""
  spec = fr.TableSpec(CAP, EXAMPLE, position_index=True)
  t = fr.make_table(spec, native=False)
  state = t.insert(t.init(), _items(6))
  state = t.delete(state, jnp.asarray([1, 4]), state.key[jnp.asarray([1, 4])])
  state = t.insert(state, _items(3, 6))
  return spec, t, state


def test_index_after_deletes_is_a_swap_removal():
  _, _, state = _history()
  _assert_valid(state)
  # Slots 0..5 at positions 0..5. Deleting slots 1 and 4 (N' = 4): the hole at position 1
  # takes the filler at position 5 (slot 5); position 4 was freed. Then the ring writes
  # slots 6, 7 (free: positions 4, 5) and 0 (occupied: overwritten, keeps position 0).
  order = np.asarray(state.position_index)[0]
  assert order[:6].tolist() == [0, 5, 2, 3, 6, 7] and order[CAP] == 6


@pytest.mark.parametrize("replace", [False, True])
def test_sample_takes_the_slots_at_its_positions(replace):
  spec, t, state = _history()
  order = np.asarray(state.position_index)[0]
  for i in range(5):
    k = jax.random.PRNGKey(i)
    _, smp = t.sample(state, k, batch_size=4, replace=replace)
    x, valid = uniform_lean.positions(k, state.size, 4, replace, CAP)
    assert np.asarray(smp.valid).tolist() == np.asarray(valid).tolist()
    assert np.asarray(smp.info.slot).tolist() == order[np.asarray(x)].tolist()


def test_sample_with_holes_is_exactly_uniform():
  spec, _, state = _history()
  occupied = np.flatnonzero(np.asarray(state.occupied)).tolist()
  assert len(occupied) == 6
  keys = jax.random.split(jax.random.PRNGKey(3), 24_000)
  slots = np.asarray(jax.jit(jax.vmap(lambda k: uniform_lean.sample(
      spec, state, k, batch_size=2)[1].info.slot))(keys))
  pairs = list(itertools.permutations(occupied, 2))  # 30 equally likely outcomes
  at = {p: i for i, p in enumerate(pairs)}
  counts = np.bincount([at[tuple(r)] for r in slots], minlength=len(pairs))
  assert stats.chisquare(counts).pvalue > 1e-3


# --- checkpoints, the host Table ----------------------------------------------------------


def test_checkpoint_keeps_the_index_and_the_batch(tmp_path):
  spec, t, state = _history()
  checkpoint.save(str(tmp_path / "c"), state, spec)
  restored = checkpoint.restore(str(tmp_path / "c"), spec)
  for name in ("position_index", "occupied", "item_info", "occ_tree", "ledger"):
    np.testing.assert_array_equal(getattr(restored.state, name), getattr(state, name), name)
  k = jax.random.PRNGKey(7)
  want, got = t.sample(state, k, batch_size=5)[1], t.sample(restored.state, k, batch_size=5)[1]
  helpers.assert_bit_identical(want, got, "same key, same batch")
  assert checkpoint.restore(str(tmp_path / "c")).spec.position_index  # from the manifest


def test_checkpoint_into_another_setting_rebuilds_or_drops_the_index(tmp_path):
  spec, _, state = _history()
  checkpoint.save(str(tmp_path / "with"), state, spec)
  plain = spec.replace(position_index=False)
  dropped = checkpoint.restore(str(tmp_path / "with"), plain).state
  assert dropped.position_index.shape == (2, 0)
  np.testing.assert_array_equal(dropped.occupied, state.occupied)
  checkpoint.save(str(tmp_path / "without"), dropped, plain)
  rebuilt = checkpoint.restore(str(tmp_path / "without"), spec).state
  _assert_valid(rebuilt)
  assert np.asarray(rebuilt.position_index)[0, :6].tolist() == [0, 2, 3, 5, 6, 7]  # slot order
  grown = checkpoint.restore(str(tmp_path / "with"), spec.replace(capacity=16),
                             allow_capacity_growth=True).state
  _assert_valid(grown)


def test_a_damaged_index_is_refused(tmp_path):
  spec, _, state = _history()
  bad = state.replace(position_index=state.position_index.at[1, 0].set(-1))
  checkpoint.save(str(tmp_path / "bad"), bad, spec)
  with pytest.raises(checkpoint.CheckpointError, match="position index"):
    checkpoint.restore(str(tmp_path / "bad"), spec)


def test_restores_into_a_spec_without_holes(tmp_path):
  """The index is a layout: a checkpoint that kept one restores into a table without holes
  (when its items are a ring window), the index dropped (found by a review)."""
  spec = fr.TableSpec(CAP, EXAMPLE, position_index=True)
  t = fr.make_table(spec, native=False)
  state = t.insert(t.init(), _items(5))
  checkpoint.save(str(tmp_path / "c"), state, spec)
  ring = fr.TableSpec(CAP, EXAMPLE, holes=False)
  got = checkpoint.restore(str(tmp_path / "c"), ring)
  assert got.spec.holes is False and got.state.position_index.shape == (2, 0)
  assert int(got.state.size) == 5


def test_from_state_checks_the_index():
  spec, _, state = _history()
  fr.Table.from_state(spec, state, check=True)
  bad = state.replace(position_index=state.position_index.at[0, 1].set(1))  # a free slot
  with pytest.raises(ValueError, match="position_index"):
    fr.Table.from_state(spec, bad, check=True)


def test_host_table_native_and_portable_agree():
  """The kernels keep the index by the same rule (csrc/position_index.h): same batches,
  same state (the native suites compare more sequences, tests/native)."""
  helpers.require_native_kernels()
  spec = fr.TableSpec(CAP, EXAMPLE, position_index=True, max_times_sampled=2)
  a, b = fr.Table(spec, seed=3, native=True), fr.Table(spec, seed=3, native=False)
  for tab in (a, b):
    tab.insert(_items(6))
    info = tab.sample(2).info
    tab.delete(info.slot, info.key)
    tab.insert(_items(4, 6))
  got, want = a.sample(4), b.sample(4)
  helpers.assert_bit_identical(got, want, "native vs portable")
  helpers.assert_bit_identical(a.snapshot(), b.snapshot(), "native vs portable state")
  _assert_valid(a.snapshot())


# --- lean programs ------------------------------------------------------------------------


@pytest.mark.parametrize("replace", [False, True])
def test_sample_program_is_one_gather_without_conditionals(replace):
  c = 1 << 14
  with_index = fr.make_table(fr.TableSpec(c, EXAMPLE, position_index=True), native=False)
  descent = fr.make_table(fr.TableSpec(c, EXAMPLE), native=False)
  counts = [hlo.counts(lambda s, k, t=t: t.sample(s, k, batch_size=64, replace=replace),
                       t.init(), jax.random.PRNGKey(0), donate_argnums=0, big=c)
            for t in (with_index, descent)]
  assert counts[0]["conditional"] == 0 and counts[0]["while"] == 0, counts
  assert counts[0]["big_copies"] == 0, counts
  assert counts[0]["fusion"] < counts[1]["fusion"], counts  # no descent


@pytest.mark.parametrize("b", [1, 16])
def test_insert_program_stays_lean(b):
  c = 1 << 14
  t = fr.make_table(fr.TableSpec(c, EXAMPLE, position_index=True), native=False)
  counts = hlo.counts(t.insert, t.init(), _items(b), donate_argnums=0, big=c)
  assert counts["conditional"] == 0 and counts["while"] == 0 and counts["sort"] == 0, counts
  assert counts["big_copies"] == 0, counts
