"""Tables without holes (``TableSpec(holes=False)``, BUILD.md finding 23).

The promise: items leave only when the ``Fifo`` ring overwrites them (or, in Reverb's
queue, an unmasked Fifo sample uses them up: tests/core/test_queue_ring.py), so the stored
items are always the ``size`` slots written last and the uniform sample maps position
``x`` to slot ``(write_pos - size + x) mod C`` (``uniform_lean.ring_slot``) instead of
descending the occupancy tree. Checked here: the spec refuses what would break the
promise; every operation that would leave a hole is refused (pure and host, table
intact); the ring invariant holds after any sequence of (masked) inserts and samples;
the sample is uniform (chi-square) and its program has no descent, conditional or loop;
checkpoints keep the promise (a state with holes does not restore into such a spec).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import funcreplay as fr
from funcreplay import checkpoint
from funcreplay.core import hlo, ops
from funcreplay.core.sampling import uniform_lean
from funcreplay.host import consistency
from tests.core.common import SMALL_ITEM, small_items

EXAMPLE = SMALL_ITEM
CAP = 8
_items = small_items


def _spec(**kw):
  return fr.TableSpec(CAP, EXAMPLE, holes=False, **kw)


@pytest.mark.parametrize("kw, match", [
    (dict(remover=fr.Fifo(fill_holes=True)), "ring remover"),
    (dict(remover=fr.Lifo()), "ring remover"),
    (dict(remover=fr.Uniform()), "ring remover"),
    (dict(remover=fr.MinHeap()), "ring remover"),
    (dict(max_times_sampled=1), "max_times_sampled"),
])
def test_spec_refuses_what_leaves_holes(kw, match):
  with pytest.raises(ValueError, match=match):
    _spec(**kw)


def test_spec_field():
  assert fr.TableSpec(CAP, EXAMPLE).holes is True
  spec = _spec(max_staleness=2, sampler=fr.Prioritized(0.6))  # masks and priorities: fine
  assert spec.holes is False and spec.replace(capacity=16).holes is False
  assert spec.replace(holes=True).holes is True
  with pytest.raises(TypeError, match="holes must be a bool"):
    fr.TableSpec(CAP, EXAMPLE, holes=0)


def test_pure_operations_that_leave_holes_are_refused():
  t = fr.make_table(_spec(max_staleness=1), native=False)
  st_ = t.insert(t.init(), _items(4))
  with pytest.raises(ValueError, match=r"delete: .*holes=False"):
    t.delete(st_, jnp.array([0]), st_.key[:1])
  with pytest.raises(ValueError, match=r"evict_stale: .*holes=False"):
    t.evict_stale(st_, 5)
  with pytest.raises(ValueError, match="holes=False"):  # the cause-level guard
    ops.remove(t.spec, st_, jnp.array([0]), jnp.array([True]), "deletes")


def test_host_operations_that_leave_holes_are_refused_and_the_table_is_intact():
  table = fr.Table(_spec(max_staleness=1, metadata=("task",)), seed=0)
  table.insert(_items(5), metadata={"task": np.array([0, 0, 1, 1, 1], np.int32)})
  before = table.stats().to_dict()
  with pytest.raises(ValueError, match=r"Table.delete: .*holes=False"):
    table.delete([0], [0])
  with pytest.raises(ValueError, match=r"Table.evict_stale: .*holes=False"):
    table.evict_stale(3)
  with pytest.raises(ValueError, match=r"Table.take_batch: .*holes=False"):
    table.take_batch({0: 1})
  assert table.stats().to_dict() == before
  assert np.asarray(table.sample(4, timeout=0).valid).sum() == 4  # still works
  table.close()


_PROGRAMS = {}


def _ring_programs(replace):
  """``(spec, insert, sample)`` jitted once (hypothesis examples reuse the compilations)."""
  if replace not in _PROGRAMS:
    spec = _spec()
    t = fr.make_table(spec, native=False)
    _PROGRAMS[replace] = (spec, jax.jit(lambda s, x, m: t.insert(s, x, mask=m)),
                          jax.jit(lambda s, k: t.sample(s, k, batch_size=5, replace=replace)))
  return _PROGRAMS[replace]


INSERTS = st.lists(st.tuples(st.integers(1, CAP), st.integers(0, 2**31 - 1)), min_size=1,
                   max_size=12)


@settings(max_examples=30, deadline=None)
@given(inserts=INSERTS, replace=st.booleans())
def test_masked_inserts_keep_the_ring_and_samples_take_its_slots(inserts, replace):
  """After any sequence of (masked) inserts and samples the items are the ring window
  before ``write_pos`` (``consistency.holes_error``), and a sample returns exactly the slots
  of the positions it drew, with their items."""
  spec, insert, sample = _ring_programs(replace)
  state, payload, n, written = fr.make_table(spec, native=False).init(), {}, 0, 0
  for b, r in inserts:
    mask = np.random.default_rng(r).random(b) < 0.7
    state = insert(state, _items(b, n), jnp.asarray(mask))
    for i in np.flatnonzero(mask):  # the ring: each real row at the next slot
      payload[written % CAP] = n + int(i)
      written += 1
    n += b
    host = jax.tree_util.tree_map(np.asarray, state)
    assert consistency.holes_error(spec, host) == ""
    state, got = sample(state, jax.random.PRNGKey(r))
    slot, valid = np.asarray(got.info.slot), np.asarray(got.valid)
    size = int(state.size)
    assert valid.sum() == (min(5, size) if not replace else (5 if size else 0))
    assert size == min(written, CAP) and int(state.write_pos) == written % CAP
    x, _ = uniform_lean.positions(jax.random.PRNGKey(r), jnp.int32(size), 5, replace, CAP)
    want = (written - size + np.asarray(x)) % CAP
    assert slot[valid].tolist() == want[valid].tolist()
    assert np.asarray(got.data["a"])[valid].tolist() == [payload[s] for s in slot[valid]]


@pytest.mark.parametrize("replace", [False, True])
def test_sample_is_uniform_over_a_wrapped_ring(replace):
  cap, draws = 12, 400
  spec = fr.TableSpec(cap, EXAMPLE, holes=False)
  t = fr.make_table(spec, native=False)
  state = t.insert(t.insert(t.init(), _items(cap)), _items(5, cap))  # wrapped at slot 5
  sample = jax.jit(lambda s, k: t.sample(s, k, batch_size=3, replace=replace)[1].info.slot)
  keys = jax.random.split(jax.random.PRNGKey(1), draws)
  slots = np.asarray(jax.vmap(lambda k: sample(state, k))(keys)).ravel()
  counts = np.bincount(slots, minlength=cap)
  assert counts.sum() == 3 * draws
  assert stats.chisquare(counts).pvalue > 1e-3
  if not replace:
    rows = np.asarray(jax.vmap(lambda k: sample(state, k))(keys))
    assert all(len(set(r)) == 3 for r in rows)


def test_sample_program_has_no_descent_conditional_or_loop():
  """The ring map replaces the descent: fewer fusions than the same table with holes,
  none of its reads of the occupancy tree, no conditional, no while."""
  example = {"obs": np.zeros(64, np.float32), "r": np.float32(0)}
  cap = 1 << 14
  got = {}
  for holes in (True, False):
    t = fr.make_table(fr.TableSpec(cap, example, holes=holes), native=False)
    got[holes] = hlo.counts(lambda s, k, t=t: t.sample(s, k, batch_size=256), t.init(),
                            jax.random.PRNGKey(0), donate_argnums=0)
  for holes in (True, False):
    assert got[holes].get("conditional", 0) == 0 and got[holes].get("while", 0) == 0
  assert got[False]["fusion"] < got[True]["fusion"] - 4, got
  assert got[False].get("gather", 0) < got[True].get("gather", 0), got


def test_checkpoint_keeps_the_promise(tmp_path):
  spec = fr.TableSpec(CAP, EXAMPLE, holes=False)
  t = fr.make_table(spec, native=False)
  state = t.insert(t.insert(t.init(), _items(CAP)), _items(3, CAP))
  checkpoint.save(str(tmp_path / "ring"), state, spec)
  restored, got_spec = checkpoint.restore(str(tmp_path / "ring"))
  assert got_spec.holes is False
  a = t.sample(state, jax.random.PRNGKey(4), batch_size=5)[1]
  b = t.sample(restored, jax.random.PRNGKey(4), batch_size=5)[1]
  np.testing.assert_array_equal(np.asarray(a.info.slot), np.asarray(b.info.slot))
  # A state with holes (a table that allows them, after a delete) does not restore into
  # a spec without; one without holes does.
  loose = spec.replace(holes=True)
  lt = fr.make_table(loose, native=False)
  checkpoint.save(str(tmp_path / "clean"), state, loose)
  assert checkpoint.restore(str(tmp_path / "clean"), spec).spec.holes is False
  holed = lt.delete(state, jnp.array([5]), state.key[5:6])
  checkpoint.save(str(tmp_path / "holed"), holed, loose)
  with pytest.raises(checkpoint.CheckpointError, match="not the last 7 slots written"):
    checkpoint.restore(str(tmp_path / "holed"), spec)
  # A host Table adopting such a state checks it too (Table.from_state(check=True)).
  with pytest.raises(ValueError, match="inconsistent state: occupied: .*not the last 7"):
    fr.Table.from_state(spec, holed)
  fr.Table.from_state(spec, state).close()


@pytest.mark.parametrize("n", [5, CAP + 3])
def test_growing_capacity_keeps_a_ring_window(tmp_path, n):
  spec = fr.TableSpec(CAP, EXAMPLE, holes=False)
  t = fr.make_table(spec, native=False)
  state = t.insert(t.init(), _items(n)) if n <= CAP else t.insert(
      t.insert(t.init(), _items(CAP)), _items(n - CAP, CAP))
  checkpoint.save(str(tmp_path / "c"), state, spec)
  big = spec.replace(capacity=2 * CAP)
  grown, _ = checkpoint.restore(str(tmp_path / "c"), big, allow_capacity_growth=True)
  _, got = fr.make_table(big, native=False).sample(grown, jax.random.PRNGKey(0),
                                                   batch_size=CAP, replace=False)
  size = min(n, CAP)
  assert sorted(np.asarray(got.data["a"])[:size].tolist()) == list(range(n - size, n))
