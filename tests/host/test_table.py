"""Host ``Table``: equivalence with the pure core, bad input, determinism.

Specs are module constants so the jitted operations (cached per spec) compile
once for the whole file: compilation, not the tests, dominates the run time. Rate
limiters, blocking and threads: test_table_limits.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import Table, TableClosedError
from tests.helpers import ITEM, counters_dict, host_sample, items_from_ids, jitted
from tests.host.table_common import SPEC, T, assert_same_tree, host_copy, np_items

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")


# --- equivalence with the pure functions ---------------------------------------

def test_host_table_matches_pure_functions():
  j = jitted(SPEC)
  t = Table(SPEC, seed=7)
  state = j["table"].init()
  rng = jax.random.PRNGKey(7)

  # B = 3 is padded to the bucket 4 with a mask: no fake row may appear.
  t.insert(np_items([1, 2, 3]), version=0, metadata={"task": [0, 1, 1]})
  state = j["insert"](state, items_from_ids([1, 2, 3]), version=0,
                      metadata={"task": jnp.asarray([0, 1, 1])})
  t.insert(np_items(range(10, 14)), version=1, priority=np.arange(1, 5, dtype=np.float32))
  state = j["insert"](state, items_from_ids(range(10, 14)), version=1,
                      priority=jnp.arange(1, 5, dtype=jnp.float32))
  assert t.size == 7 and t.stats().to_dict()["inserts"] == 7
  assert_same_tree(t.snapshot(), state)

  t.set_version(1)
  smp = t.sample(4)
  # The Table keeps a key sequence: each sample uses the key and moves to the next.
  sample_split = jax.jit(functools.partial(host_sample(SPEC), batch_size=4, split_key=True))
  state, ref, rng = sample_split(state, rng, version=jnp.int32(1))
  assert_same_tree(smp, ref)
  assert bool(np.all(smp.valid))

  t.update_priorities(smp.info.slot, smp.info.key, np.asarray([0.5, 2.0, 3.0, 4.0]))
  state = j["update"](state, ref.info.slot, ref.info.key, jnp.asarray([0.5, 2.0, 3.0, 4.0]))
  t.delete(smp.info.slot[:2], smp.info.key[:2])
  state = j["delete"](state, ref.info.slot[:2], ref.info.key[:2])
  t.set_metadata(smp.info.slot[2:], smp.info.key[2:], "task", 5)
  state = fr.make_table(SPEC).set_metadata(state, ref.info.slot[2:], ref.info.key[2:], "task",
                                           jnp.int32(5))
  assert_same_tree(t.snapshot(), state)

  # Staleness: at version 4 the version-0 and version-1 items are too old (max_staleness 2).
  t.set_version(4)
  assert t.count() == 0 and t.count(version=1) == t.size
  n_stale = int(jnp.sum(fr.make_table(SPEC).eligible(state) & (state.version < 2)))
  assert n_stale == 5 and t.evict_stale() == n_stale
  state = j["evict"](state, 4)
  assert_same_tree(t.snapshot(), state)
  assert t.stats().to_dict() == fr.make_table(SPEC).stats(state).to_dict()
  assert counters_dict(t.snapshot())["evicted_stale"] == 5 and t.size == 0


def test_where_dict_and_mask_and_count():
  t = Table(SPEC)
  t.insert(np_items(range(4)), metadata={"task": [0, 1, 2, 3]})
  t.insert(np_items(range(4, 8)), metadata={"task": [0, 1, 2, 3]})
  assert t.count() == 8
  assert t.count(where={"task": 1}) == 2
  assert t.count(where={"task": [1, 3]}) == 4
  assert t.count(where={"task": np.asarray([2])}) == 2
  mask = np.zeros(16, bool)
  mask[:3] = True
  assert t.count(where=mask) == 3
  smp = t.sample(4, where={"task": [1, 3]})
  assert sorted(np.asarray(smp.data["x"]).tolist()) == [1, 3, 5, 7]
  # Not enough matching items: min_valid waits, min_valid=0 returns invalid rows.
  with pytest.raises(TimeoutError, match="eligible"):
    t.sample(4, where={"task": 2}, timeout=T)
  smp = t.sample(4, where={"task": 2}, min_valid=1)
  assert int(np.sum(smp.valid)) == 2
  assert set(np.asarray(smp.data["x"])[np.asarray(smp.valid)].tolist()) == {2, 6}
  assert np.all(np.asarray(smp.info.slot)[~np.asarray(smp.valid)] == -1)


def test_sample_and_snapshot_are_fresh_arrays():
  t = Table(SPEC)
  t.insert(np_items(range(4)))
  smp = t.sample(4)
  snap = t.snapshot()
  st = t.stats()
  before = host_copy(snap)
  for _ in range(3):  # donated mutations after the copies were taken
    t.insert(np_items(range(4, 8)))
    t.update_priorities(smp.info.slot, smp.info.key, np.full(4, 9.0, np.float32))
  assert sorted(np.asarray(smp.data["x"]).tolist()) == [0, 1, 2, 3]
  assert_same_tree(snap, before)
  assert st.to_dict()["inserts"] == 4


# --- bad input ----------------------------------------------------------------------

def bad_calls(t):
  """(callable, exception type, message regex) for invalid calls on a SPEC table."""
  slot, key = np.asarray([0, 1]), np.asarray([0, 1], np.uint32)
  good = np_items([1, 2])
  return [
      # insert
      (lambda: t.insert({"x": good["x"].astype(np.int64), "y": good["y"]}), TypeError,
       r"leaf \['x'\].*int32"),
      (lambda: t.insert({"x": good["x"], "y": good["y"][:, :1]}), ValueError, r"leaf \['y'\]"),
      (lambda: t.insert({"x": good["x"]}), ValueError, "structure"),
      (lambda: t.insert({"x": good["x"], "y": good["y"][:1]}), ValueError, "batch size"),
      (lambda: t.insert(np_items([])), ValueError, "empty"),
      (lambda: t.insert(np_items(range(17))), ValueError, "capacity"),
      (lambda: t.insert(good, priority=[1.0, np.nan]), ValueError, "priorit.*row 1"),
      (lambda: t.insert(good, priority=np.inf), ValueError, "priorit"),
      (lambda: t.insert(good, priority=[-1.0, 1.0]), ValueError, "priorit.*row 0"),
      (lambda: t.insert(good, priority=[1.0, 2.0, 3.0]), ValueError, r"shape \[2\]"),
      (lambda: t.insert(good, priority="high"), TypeError, "float"),
      (lambda: t.insert(good, metadata={"nope": 1}), ValueError, "unknown metadata.*nope"),
      (lambda: t.insert(good, metadata={"task": 1.5}), TypeError, "integers"),
      (lambda: t.insert(good, metadata=[1, 2]), TypeError, "dict"),
      (lambda: t.insert(good, version=1.5), TypeError, "integers"),
      (lambda: t.insert(good, version=2**40), ValueError, "version"),
      (lambda: t.insert(good, timeout=-1), ValueError, "timeout"),
      # sample
      (lambda: t.sample(0), ValueError, "batch_size"),
      (lambda: t.sample(2.0), ValueError, "batch_size"),
      (lambda: t.sample(17), ValueError, "capacity"),
      (lambda: t.sample(2, min_valid=3), ValueError, "min_valid"),
      (lambda: t.sample(2, where=np.ones(8, bool)), ValueError, r"shape \[16\]"),
      (lambda: t.sample(2, where=np.ones(16, np.int32)), TypeError, "bool"),
      (lambda: t.sample(2, where={"nope": 1}), ValueError, "unknown.*nope"),
      (lambda: t.sample(2, where={"task": []}), ValueError, "non-empty"),
      (lambda: t.sample(2, where={"task": 0.5}), TypeError, "int"),
      (lambda: t.sample(2, version="new"), TypeError, "version"),
      (lambda: t.sample(2, timeout=float("nan")), ValueError, "timeout"),
      # update_priorities
      (lambda: t.update_priorities(slot, key, [1.0, np.nan]), ValueError, "finite"),
      (lambda: t.update_priorities(slot, key, [1.0, -np.inf]), ValueError, "finite"),
      (lambda: t.update_priorities(slot, key, [-0.5, 1.0]), ValueError, ">= 0"),
      (lambda: t.update_priorities(slot, key, [1e39, 1.0]), ValueError, "float32"),
      (lambda: t.update_priorities([0, 16], key, 1.0), ValueError, "slot 16 out of range"),
      (lambda: t.update_priorities([-2, 0], key, 1.0), ValueError, "slot -2 out of range"),
      (lambda: t.update_priorities(slot.astype(np.float32), key, 1.0), TypeError, "slots"),
      (lambda: t.update_priorities(slot, [-1, 0], 1.0), ValueError, "keys"),
      (lambda: t.update_priorities(slot, key[:1], 1.0), ValueError, "length"),
      (lambda: t.update_priorities(slot[None], key[None], 1.0), ValueError, "1-D"),
      (lambda: t.update_priorities(slot, key, [1.0, 2.0, 3.0]), ValueError, "shape"),
      (lambda: t.update_priorities(slot, key, ["a", "b"]), TypeError, "float"),
      # delete / set_metadata / evict_stale / count
      (lambda: t.delete([0, 99], key), ValueError, "slot 99"),
      (lambda: t.delete(slot, key.astype(np.float64)), TypeError, "keys"),
      (lambda: t.set_metadata(slot, key, "nope", 1), ValueError, "unknown column"),
      (lambda: t.set_metadata(slot, key, "task", [1.0, 2.0]), TypeError, "integers"),
      (lambda: t.set_metadata(slot, key, "task", [1, 2, 3]), ValueError, "shape"),
      (lambda: t.evict_stale(version=1.0), TypeError, "version"),
      (lambda: t.count(where={"nope": [1]}), ValueError, "unknown"),
      (lambda: t.count(where=np.ones((4, 4), bool)), ValueError, "shape"),
      (lambda: t.set_version("v2"), TypeError, "version"),
  ]


def test_bad_input_raises_and_leaves_table_untouched():
  t = Table(SPEC, seed=3, version=1)
  t.insert(np_items(range(4)), metadata={"task": [0, 1, 0, 1]})
  before, rng_before = host_copy(t.snapshot()), np.asarray(t.rng_key())
  for i, (call, exc, match) in enumerate(bad_calls(t)):
    with pytest.raises(exc, match=match):
      call()
    assert_same_tree(t.snapshot(), before), i
  np.testing.assert_array_equal(np.asarray(t.rng_key()), rng_before)
  assert t.version == 1
  # A timed-out sample does not advance the PRNG key either.
  with pytest.raises(TimeoutError, match="only 0 eligible.*where"):
    t.sample(4, where={"task": 7}, timeout=0)
  np.testing.assert_array_equal(np.asarray(t.rng_key()), rng_before)
  assert_same_tree(t.snapshot(), before)


def test_misc_bad_input():
  with pytest.raises(TypeError, match="TableSpec"):
    Table({"capacity": 4})
  with pytest.raises(ValueError, match="seed"):
    Table(SPEC, seed=-1)
  t = Table(fr.TableSpec(16, ITEM))
  with pytest.raises(ValueError, match="max_staleness"):
    t.evict_stale()
  with pytest.raises(ValueError, match="structure"):
    Table.from_state(SPEC, t.snapshot())  # no "task" column, no weight tree
  with pytest.raises(ValueError, match="uint32"):
    Table.from_state(t.spec, t.snapshot(), rng=np.zeros(3, np.uint32))
  # An empty update / delete is a no-op, not an error.
  t.update_priorities(np.zeros(0, np.int32), np.zeros(0, np.uint32), np.zeros(0))
  t.delete([], [])


def test_every_method_raises_after_close():
  t = Table(SPEC)
  t.insert(np_items([1]))
  t.close()
  slot, key = np.asarray([0]), np.asarray([0], np.uint32)
  calls = [lambda: t.insert(np_items([1])), lambda: t.sample(1), lambda: t.size,
           lambda: t.update_priorities(slot, key, 1.0), lambda: t.delete(slot, key),
           lambda: t.set_metadata(slot, key, "task", 1), lambda: t.evict_stale(),
           lambda: t.count(), lambda: t.stats(), lambda: t.snapshot(),
           lambda: t.set_version(2), lambda: t.ingestor()]
  for call in calls:
    with pytest.raises(TableClosedError, match="closed"):
      call()


# --- determinism --------------------------------------------------------------------

def _script(t):
  out = []
  for i in range(3):
    t.insert(np_items(range(4 * i, 4 * i + 4)), priority=np.linspace(0.1, 2.0, 4) + i)
  for _ in range(3):
    smp = t.sample(4)
    out.append(host_copy(smp))
    t.update_priorities(smp.info.slot, smp.info.key, np.asarray([3.0, 0.2, 1.0, 0.5]))
  return out


def test_same_seed_same_samples_and_restore_continues_the_stream():
  a, b, c = Table(SPEC, seed=11), Table(SPEC, seed=11), Table(SPEC, seed=12)
  ra, rb, rc = _script(a), _script(b), _script(c)
  for x, y in zip(ra, rb, strict=True):
    assert_same_tree(x, y)
  assert any(not np.array_equal(x.info.slot, z.info.slot) for x, z in zip(ra, rc, strict=True))
  # from_state + host_state continue exactly where the original left off.
  hs = a.host_state()
  d = Table.from_state(SPEC, a.snapshot(), rng=hs["rng"], version=hs["version"])
  assert_same_tree(host_copy(a.sample(4)), host_copy(d.sample(4)))
  assert_same_tree(a.snapshot(), d.snapshot())


def test_clear_caches_drops_compiled_programs_and_tables_keep_working():
  from funcreplay.host import programs

  a, b = Table(SPEC, seed=3), Table(SPEC, seed=3)
  a.insert(np_items([1, 2, 3]))
  assert programs.cached_ops.cache_info().currsize >= 1
  fr.clear_caches()
  assert programs.cached_ops.cache_info().currsize == 0
  # The table made before keeps its programs' functions (they compile again);
  # a fresh table of the spec gets new ones; both give the same stream.
  b.insert(np_items([1, 2, 3]))
  c = Table(SPEC, seed=3)
  c.insert(np_items([1, 2, 3]))
  assert c._ops is not a._ops  # noqa: SLF001
  sa, sb, sc = (host_copy(t.sample(2)) for t in (a, b, c))
  assert_same_tree(sa, sb)
  assert_same_tree(sa, sc)
