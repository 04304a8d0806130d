"""Host ``Table``: equivalence with the pure core, rate limiters, blocking, bad input, threads.

Specs are module constants so the jitted operations (cached per spec) compile
once for the whole file: compilation, not the tests, dominates the run time.
"""

from __future__ import annotations

import functools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import Table, TableClosedError
from tests.helpers import ITEM, counters_dict, host_sample, items_from_ids, jitted

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")

T = 0.05  # timeout of calls that must block

# Prioritized sampler + metadata + staleness + reuse limit: the "everything" spec. Most
# tests use it with insert batches of <= 4 (bucket 4) and sample(4) to share compilations.
SPEC = fr.TableSpec(16, ITEM, sampler=fr.Prioritized(0.6), metadata=("task",), max_staleness=2,
                    max_times_sampled=3)


def np_items(ids):
  ids = np.asarray(ids, np.int32)
  return {"x": ids, "y": np.stack([ids, -ids], -1).astype(np.float32)}


def host_copy(tree):
  return jax.tree_util.tree_map(np.array, tree)


def assert_same_tree(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def run_thread(fn):
  """Start ``fn`` in a thread; returns (thread, box) where box gets 'result' or 'error'."""
  box = {}

  def target():
    try:
      box["result"] = fn()
    except BaseException as e:  # noqa: BLE001 (reported to the test)
      box["error"] = e

  th = threading.Thread(target=target, daemon=True)
  th.start()
  return th, box


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


# --- rate limiters ---------------------------------------------------------------

def run_script(t, script):
  """Steps ('i', ids) insert / ('s', n) sample; each with True (proceeds) or False (blocks).

  Returns the x values of the samples that proceeded.
  """
  out = []
  for step, (op, arg, proceeds) in enumerate(script):
    try:
      if op == "i":
        t.insert(np_items(arg), timeout=T)
      else:
        out.append(np.asarray(t.sample(arg, timeout=T).data["x"]).tolist())
      went = True
    except TimeoutError as e:
      assert "rate limiter" in str(e), str(e)
      went = False
    assert went == proceeds, f"step {step} ({op} {arg}) should {'' if proceeds else 'not '}proceed"
  return out


def test_min_size_blocks_samples_until_min_size():
  t = Table(fr.TableSpec(16, ITEM, rate_limiter=fr.MinSize(3)))
  run_script(t, [("s", 1, False), ("i", [0], True), ("s", 1, False), ("i", [1], True),
                 ("s", 1, False), ("i", [2], True), ("s", 1, True), ("s", 1, True),
                 ("i", [3], True)])
  with pytest.raises(TimeoutError, match=r"MinSize\(3\)"):
    Table(t.spec).sample(1, timeout=0)


def test_sample_to_insert_ratio_window_edges():
  # spi=2, min_size=2, error_buffer=2: diff = 2*inserts - samples must stay in [2, 6]
  # once the table holds more than 2 items; both window edges are inclusive.
  lim = fr.SampleToInsertRatio(2.0, 2, 2.0)
  t = Table(fr.TableSpec(16, ITEM, rate_limiter=lim))
  run_script(t, [
      ("s", 1, False),            # size 0 < min_size
      ("i", [0], True),           # size 1 <= min_size: always allowed (diff 2)
      ("s", 1, False),            # size 1 < min_size
      ("i", [1], True),           # diff 4
      ("i", [2], True),           # diff 6 == max: allowed (upper edge)
      ("i", [3], False),          # diff would be 8 > 6
      ("s", 1, True),             # diff 5
      ("i", [3], False),          # 7 > 6
      ("s", 1, True),             # diff 4
      ("i", [3], True),           # diff 6
      ("s", 1, True), ("s", 1, True), ("s", 1, True),
      ("s", 1, True),             # diff 2 == min: allowed (lower edge)
      ("s", 1, False),            # diff would be 1 < 2
      ("i", [4], True),           # diff 4
      ("s", 1, True),
  ])
  d = t.stats().to_dict()
  assert (d["inserts"], d["samples"]) == (5, 7)
  with pytest.raises(ValueError, match="error_buffer|narrower"):
    fr.SampleToInsertRatio(2.0, 2, 0.5)  # window [3.5, 4.5] narrower than spi


def test_sample_to_insert_ratio_below_one():
  # spi=0.5, min_size=1, error_buffer=1: 0.5*inserts - samples in [-0.5, 1.5].
  t = Table(fr.TableSpec(16, ITEM, rate_limiter=fr.SampleToInsertRatio(0.5, 1, 1.0)))
  run_script(t, [("i", [0], True), ("i", [1], True), ("i", [2], True),   # 1.5
                 ("i", [3], False),                                       # 2.0 > 1.5
                 ("s", 1, True), ("s", 1, True),                          # -0.5
                 ("s", 1, False),                                         # -1.5 < -0.5
                 ("i", [3], True), ("s", 1, False), ("i", [4], True), ("s", 1, True)])


def test_queue_blocks_and_is_fifo():
  t = Table(fr.queue(4, ITEM))
  out = run_script(t, [("s", 1, False), ("i", [0], True), ("i", [1], True), ("i", [2], True),
                       ("i", [3], True), ("i", [4], False),
                       ("s", 1, True), ("i", [4], True), ("i", [5], False),
                       ("s", 1, True), ("s", 1, True), ("s", 1, True), ("s", 1, True),
                       ("s", 1, False)])
  assert out == [[0], [1], [2], [3], [4]]
  assert t.size == 0
  # A batch only partly admitted: the admitted prefix goes in, the error says how much.
  for i in (10, 11, 12):
    t.insert(np_items([i]))
  with pytest.raises(TimeoutError) as e:
    t.insert(np_items([13, 14]), timeout=T)
  assert e.value.inserted == 1 and "1 of 2" in str(e.value)
  assert [int(t.sample(1).data["x"][0]) for _ in range(4)] == [10, 11, 12, 13]


def test_stack_blocks_and_is_lifo():
  t = Table(fr.stack(4, ITEM))
  out = run_script(t, [("i", [0], True), ("i", [1], True), ("i", [2], True), ("i", [3], True),
                       ("i", [4], False), ("s", 1, True), ("i", [4], True),
                       ("s", 1, True), ("s", 1, True), ("s", 1, True), ("s", 1, True),
                       ("s", 1, False)])
  assert out == [[3], [4], [2], [1], [0]]
  with pytest.raises(TimeoutError, match=r"Stack\(4\)"):
    t.sample(1, timeout=0)


# --- blocking --------------------------------------------------------------------------

def test_blocked_sampler_is_released_by_insert():
  t = Table(SPEC)
  th, box = run_thread(lambda: t.sample(4, min_valid=2, timeout=30))
  time.sleep(0.2)
  assert th.is_alive() and not box  # blocked on the empty table
  t.insert(np_items([1]))
  time.sleep(0.1)
  assert th.is_alive()  # one item < min_valid 2
  t.insert(np_items([2]))
  th.join(timeout=30)
  assert not th.is_alive()
  smp = box["result"]
  assert np.asarray(smp.valid).tolist() == [True, True, False, False]
  assert sorted(np.asarray(smp.data["x"])[:2].tolist()) == [1, 2]


def test_sample_waits_for_fresh_items():
  t = Table(SPEC)
  t.insert(np_items([1, 2]), version=0)
  t.set_version(3)  # both items are now too stale (max_staleness 2)
  with pytest.raises(TimeoutError, match="only 0 eligible.*max_staleness=2"):
    t.sample(4, min_valid=2, timeout=T)
  th, box = run_thread(lambda: t.sample(4, min_valid=2, timeout=30))
  t.insert(np_items([3]), version=3)
  time.sleep(0.2)
  assert th.is_alive()  # only one fresh item
  t.insert(np_items([4]), version=2)
  th.join(timeout=30)
  smp = box["result"]
  v = np.asarray(smp.valid)
  assert sorted(np.asarray(smp.data["x"])[v].tolist()) == [3, 4]
  assert sorted(np.asarray(smp.info.version)[v].tolist()) == [2, 3]


def test_close_wakes_blocked_sampler_and_inserter():
  q = Table(fr.queue(4, ITEM))
  for i in range(4):
    q.insert(np_items([i]))
  t = Table(SPEC)
  ins, ins_box = run_thread(lambda: q.insert(np_items([4]), timeout=30))
  smp, smp_box = run_thread(lambda: t.sample(4, timeout=30))
  time.sleep(0.2)
  assert ins.is_alive() and smp.is_alive()
  q.close()
  t.close()
  ins.join(timeout=10)
  smp.join(timeout=10)
  assert not ins.is_alive() and not smp.is_alive()
  for box in (ins_box, smp_box):
    assert isinstance(box["error"], TableClosedError), box
    assert "closed" in str(box["error"])
  assert ins_box["error"].inserted == 0
  assert t.closed and q.closed
  t.close()  # idempotent


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


# --- threads ------------------------------------------------------------------------

def test_concurrent_inserters_and_samplers_conserve_items():
  t = Table(SPEC, seed=1)
  for b in (1, 4):  # compile every bucket before the clock starts
    t.insert(np_items(np.arange(b)))
  t.sample(4)
  t.delete([-1], [0])  # compile the bucket-1 delete and bucket-4 update (-1 rows: ignored)
  t.update_priorities(np.full(4, -1), np.zeros(4, np.uint32), 1.0)
  warm_inserted = 5
  stop = threading.Event()
  inserted = [0] * 4
  sampled = [0] * 2
  errors = []
  next_id = iter(range(1000, 10**9))
  id_lock = threading.Lock()

  def inserter(i):
    r = np.random.default_rng(i)
    while not stop.is_set():
      b = int(r.integers(3, 5))  # bucket 4
      with id_lock:
        ids = [next(next_id) for _ in range(b)]
      t.insert(np_items(ids), timeout=10)
      inserted[i] += b

  def sampler(i):
    rng = np.random.default_rng(100 + i)
    while not stop.is_set():
      smp = t.sample(4, timeout=10, min_valid=1)
      v = np.asarray(smp.valid)
      x, y = np.asarray(smp.data["x"]), np.asarray(smp.data["y"])
      # No torn rows: every valid row is one whole item.
      if not (np.all(y[v, 0] == x[v]) and np.all(y[v, 1] == -x[v])):
        errors.append("torn row")
      slots = np.asarray(smp.info.slot)
      if len(set(slots[v].tolist())) != int(v.sum()):
        errors.append("duplicate slot in a batch")
      sampled[i] += int(v.sum())
      # Delete some and reprioritize others (keys guard against evicted slots).
      t.delete(smp.info.slot[:1], smp.info.key[:1])
      t.update_priorities(smp.info.slot, smp.info.key, rng.random(4).astype(np.float32))

  def guarded(fn, i):
    def run():
      try:
        fn(i)
      except Exception as e:  # noqa: BLE001
        errors.append(repr(e))
        stop.set()
    return run

  threads = [threading.Thread(target=guarded(inserter, i), daemon=True) for i in range(4)]
  threads += [threading.Thread(target=guarded(sampler, i), daemon=True) for i in range(2)]
  for th in threads:
    th.start()
  time.sleep(1.0)
  stop.set()
  for th in threads:
    th.join(timeout=20)
  assert not any(th.is_alive() for th in threads), "deadlock"
  assert not errors, errors
  d = t.stats().to_dict()
  assert d["inserts"] == sum(inserted) + warm_inserted
  assert sum(inserted) > 0 and sum(sampled) > 0
  assert d["samples"] == sum(sampled) + 4
  removed = d["evicted_capacity"] + d["evicted_stale"] + d["evicted_reuse"] + d["deletes"]
  assert d["size"] + removed == d["inserts"]
  snap = t.snapshot()
  occ = np.asarray(snap.occupied)
  keys = np.asarray(snap.key)[occ]
  assert len(set(keys.tolist())) == len(keys) == d["size"]


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
