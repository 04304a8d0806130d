"""Host ``Table``: rate limiters (edges of every limiter), blocking calls and their release,
close, and concurrent inserters and samplers conserving items.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import funcreplay as fr
from funcreplay import Table, TableClosedError
from tests.helpers import ITEM
from tests.host.table_common import SPEC, T, np_items, run_thread

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")


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


def test_a_batch_wider_than_the_window_says_so():
  """A batch is one limiter decision for all its rows: 32 rows never fit a window that
  holds 20 samples between inserts. The timeout says which, not only "insert more"."""
  t = Table(fr.TableSpec(256, ITEM, rate_limiter=fr.SampleToInsertRatio(0.25, 100, 10.0)))
  with pytest.raises(TimeoutError):
    while True:
      t.insert(np_items([0]), timeout=0)
  assert t.size == 140  # inserts stopped at max_diff
  with pytest.raises(TimeoutError, match="a batch of 32 valid rows .* at most 20 between"):
    t.sample(32, min_valid=1, timeout=0)
  assert t.sample(20, timeout=0).valid.all()


def test_a_limiter_waiting_for_more_items_than_the_capacity_is_refused():
  """``min_size_to_sample > capacity`` could never allow a sample (Reverb accepts it, and
  its samples wait forever); the host table refuses it up front and says what to change."""
  for lim in (fr.MinSize(10), fr.SampleToInsertRatio(1.0, 10, 5.0)):
    with pytest.raises(ValueError, match=r"min_size_to_sample=10 items, but the table holds "
                                         r"at most capacity=4.*Lower min_size_to_sample"):
      Table(fr.TableSpec(4, ITEM, rate_limiter=lim))
  assert Table(fr.TableSpec(4, ITEM, rate_limiter=fr.MinSize(4))).size == 0  # reachable


def test_timeouts_name_the_limiter_as_it_was_made():
  """``Queue(n)`` / ``Stack(n)`` only for the limiters they make; a ratio limiter of the
  same shape with another bound is named as the ratio limiter it is."""
  lim = fr.SampleToInsertRatio(1.0, 1, (0.0, 2.5))
  t = Table(fr.TableSpec(8, ITEM, rate_limiter=lim))
  t.insert(np_items([0, 1]), timeout=0)
  with pytest.raises(TimeoutError, match=r"SampleToInsertRatio\(samples_per_insert=1.0, "
                                         r"min_size_to_sample=1, window=\[0.0, 2.5\]\)"):
    t.insert(np_items([2]), timeout=0)
  q = Table(fr.TableSpec(8, ITEM, sampler=fr.Lifo(), rate_limiter=fr.Stack(2)))
  q.insert(np_items([0, 1]), timeout=0)
  with pytest.raises(TimeoutError, match=r"Stack\(2\)"):
    q.insert(np_items([2]), timeout=0)


def test_a_sample_waiting_on_zero_priorities_says_so():
  """Items of priority 0 weigh 0 and are never drawn: the timeout names them."""
  t = Table(fr.TableSpec(4, ITEM, sampler=fr.Prioritized(0.6)))
  t.insert(np_items([1, 2]), priority=0.0)
  with pytest.raises(TimeoutError, match=r"only 0 eligible items .*2 stored items of "
                                         r"priority 0 .*update their priorities"):
    t.sample(1, timeout=0.05)
  t.insert(np_items([3]), priority=1.0)
  with pytest.raises(TimeoutError, match=r"only 1 eligible items .*2 stored items of "
                                         r"priority 0"):
    t.sample(2, timeout=0.05)
  assert t.sample(1, timeout=0).data["x"].tolist() == [3]


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


def test_close_wakes_a_blocked_insert_of_payloads_with_its_count():
  """A table keeping payloads: close() drops its sidecars while the insert waits; the
  insert still raises TableClosedError with what went in (an AttributeError before)."""
  t = Table(fr.queue(3, ITEM), payloads=True)
  t.insert(np_items([0, 1]), payload=["p0", "p1"])
  ins, box = run_thread(lambda: t.insert(np_items([2, 3]), payload=["a", "b"], timeout=30))
  time.sleep(0.2)
  assert ins.is_alive()
  t.close()
  ins.join(timeout=10)
  assert isinstance(box["error"], TableClosedError), box
  assert box["error"].inserted == 1


@pytest.mark.parametrize("forever", [float("inf"), 1e300])
def test_an_infinite_timeout_waits_like_none(forever):
  """``timeout=inf`` waits forever (Condition.wait raised OverflowError past
  threading.TIMEOUT_MAX, after part of the batch had gone in, without saying so)."""
  t = Table(fr.queue(2, ITEM))
  t.insert(np_items([0]))
  ins, box = run_thread(lambda: t.insert(np_items([1, 2]), timeout=forever))
  time.sleep(0.2)
  assert ins.is_alive()  # item 1 in, item 2 waits for room
  assert int(t.sample(1, timeout=forever).data["x"][0]) == 0
  ins.join(timeout=10)
  assert not ins.is_alive() and "error" not in box, box
  assert [int(t.sample(1, timeout=np.float32(5)).data["x"][0]) for _ in range(2)] == [1, 2]


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


