"""Many producers (through an ``Ingestor`` and direct inserts), samplers and a priority
updater on one ``Table``; afterwards every item is accounted for.

Every item's payload is a unique id (``x = id``, ``y = [id, -id]``), so the
checks are by counters *and* by ids: no torn rows, no duplicates, no phantom
or padding rows, every id sampled ``max_times_sampled`` times is gone, and
``inserted == present + evicted`` both by the table counters and by the sets
of ids. CI runs ~3 s; the soak (``-m slow``) runs 30 s.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest

import funcreplay as fr
from funcreplay import Table
from tests.helpers import ITEM

MAX_TIMES = 2
SPEC = fr.TableSpec(128, ITEM, sampler=fr.Prioritized(0.6), max_times_sampled=MAX_TIMES)


def rows(ids):
  ids = np.asarray(ids, np.int32)
  return {"x": ids, "y": np.stack([ids, -ids], -1).astype(np.float32)}


def one(i):
  return {"x": np.int32(i), "y": np.array([i, -i], np.float32)}


def run_mixed_load(seconds: float, seed: int = 0):
  t = Table(SPEC, seed=seed)
  # Compile every variant before the clock starts (buckets 1, 2, 4; sample 8; update 8).
  warm_ids = set()
  for b in (1, 2, 4):
    ids = (-np.arange(1, b + 1) - 10 * b).tolist()
    t.insert(rows(ids))
    warm_ids.update(ids)
  warm = t.sample(8, min_valid=1)
  t.update_priorities(np.full(8, -1), np.zeros(8, np.uint32), 1.0)
  t.delete([-1], [0])

  stop = threading.Event()
  errors: list = []
  inserted_ids = [[] for _ in range(8)]   # per producer, in put / insert order
  sampled = collections.Counter()         # id -> times seen in valid sample rows
  sampled_lock = threading.Lock()
  warm_valid = np.asarray(warm.valid)
  sampled.update(np.asarray(warm.data["x"])[warm_valid].tolist())
  recent = collections.deque(maxlen=64)   # (slot, key, id) of sampled rows
  deleted_attempts: set = set()
  n_valid_rows = [0]
  ing = t.ingestor(batch_size=4, max_queue=16, max_wait_s=0.001)

  def guarded(fn):
    def run(*args):
      try:
        fn(*args)
      except Exception as e:  # noqa: BLE001 (reported by the test)
        errors.append(f"{fn.__name__}{args}: {e!r}")
        stop.set()
    return run

  @guarded
  def put_producer(p):
    i = 0
    while not stop.is_set():
      ident = 1_000_000 * (p + 1) + i
      ing.put(one(ident))
      inserted_ids[p].append(ident)
      i += 1

  @guarded
  def batch_producer(p, direct):
    rng = np.random.default_rng(p)
    i = 0
    while not stop.is_set():
      b = int(rng.integers(3, 5))  # bucket 4
      ids = [1_000_000 * (p + 1) + i + k for k in range(b)]
      if direct:
        t.insert(rows(ids), timeout=10)
      else:
        ing.put_batch(rows(ids))
      inserted_ids[p].extend(ids)
      i += b
      time.sleep(0.001)

  @guarded
  def sampler(s):
    while not stop.is_set():
      smp = t.sample(8, min_valid=1, timeout=10)
      v = np.asarray(smp.valid)
      x, y = np.asarray(smp.data["x"])[v], np.asarray(smp.data["y"])[v]
      if not (np.all(y[:, 0] == x) and np.all(y[:, 1] == -x)):
        errors.append("torn row")
      slots, keys = np.asarray(smp.info.slot)[v], np.asarray(smp.info.key)[v]
      if len(set(slots.tolist())) != len(slots):
        errors.append("duplicate slot in one batch")
      with sampled_lock:
        sampled.update(x.tolist())
        n_valid_rows[0] += int(v.sum())
      recent.extend(zip(slots.tolist(), keys.tolist(), x.tolist(), strict=True))
      time.sleep(0.002)  # let the table fill up, so the remover evicts, too

  @guarded
  def updater():
    rng = np.random.default_rng(99)
    while not stop.is_set():
      picks = list(recent)[-8:]
      if len(picks) < 8:
        time.sleep(0.001)
        continue
      slots = np.array([p[0] for p in picks], np.int32)
      keys = np.array([p[1] for p in picks], np.uint32)
      t.update_priorities(slots, keys, rng.random(8).astype(np.float32) + 0.01)
      if rng.random() < 0.2:
        deleted_attempts.add(picks[0][2])
        t.delete(slots[:1], keys[:1])
      time.sleep(0.0005)

  threads = [threading.Thread(target=put_producer, args=(p,), daemon=True) for p in range(4)]
  threads += [threading.Thread(target=batch_producer, args=(p, p >= 6), daemon=True)
              for p in range(4, 8)]
  threads += [threading.Thread(target=sampler, args=(s,), daemon=True) for s in range(2)]
  threads += [threading.Thread(target=updater, daemon=True)]
  for th in threads:
    th.start()
  time.sleep(seconds)
  stop.set()
  for th in threads:
    th.join(timeout=30)
  assert not any(th.is_alive() for th in threads), "deadlock: a thread did not finish"
  ing.close(timeout=30)
  assert not errors, errors[:5]

  # --- counters ---
  st = ing.stats()
  n_ing = sum(len(inserted_ids[p]) for p in range(6))
  assert (st.accepted, st.inserted, st.failed, st.pending) == (n_ing, n_ing, 0, 0)
  assert st.queue_high_water <= 16 + 6  # max_queue + racing producers
  d = t.stats().to_dict()
  all_ids = [i for ids in inserted_ids for i in ids]
  assert d["inserts"] == len(all_ids) + len(warm_ids)
  removed = d["evicted_capacity"] + d["evicted_reuse"] + d["deletes"] + d["evicted_stale"]
  assert d["size"] + removed == d["inserts"]
  assert d["samples"] == n_valid_rows[0] + int(warm_valid.sum())  # + the warm-up sample
  assert min(len(x) for x in inserted_ids) > 0 and n_valid_rows[0] > 0

  # --- ids ---
  inserted = set(all_ids) | warm_ids
  assert len(inserted) == d["inserts"], "an id was inserted twice"
  snap = t.snapshot()
  occ = np.asarray(snap.occupied)
  present = np.asarray(fr.stored_items(t.spec, snap)["x"])[occ].tolist()
  assert len(present) == len(set(present)) == d["size"], "duplicate item in the table"
  keys = np.asarray(snap.key)[occ].tolist()
  assert len(set(keys)) == len(keys)
  assert set(present) <= inserted, "a present item was never inserted (padding / phantom row)"
  assert set(sampled) <= inserted, "a sampled row was never inserted"
  assert max(sampled.values()) <= MAX_TIMES
  reused = {i for i, c in sampled.items() if c == MAX_TIMES}
  assert not reused & set(present), "an item sampled max_times_sampled times is still present"
  assert len(reused) == d["evicted_reuse"]
  gone = inserted - set(present)
  assert len(gone) == removed
  # What left without reaching the reuse limit left by capacity or by a delete.
  assert len(gone - reused) == d["evicted_capacity"] + d["deletes"]
  assert d["deletes"] <= len(deleted_attempts)
  # Per producer, ingestor items keep their order (keys are given in insertion order).
  order = np.argsort(np.asarray(snap.key)[occ])
  in_key_order = np.asarray(present)[order].tolist()
  for p in range(6):
    mine = [i for i in in_key_order if i // 1_000_000 == p + 1]
    assert mine == sorted(mine)
  return d


@pytest.mark.timeout(120)
def test_mixed_producers_samplers_updater_conserve_items():
  d = run_mixed_load(3.0)
  # The load was real: more inserts than slots, and the reuse limit removed items (how
  # many the remover evicted depends on the relative speed of the threads).
  assert d["inserts"] > SPEC.capacity and d["evicted_reuse"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mixed_load_soak():
  run_mixed_load(30.0, seed=3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["queue", "stack"])
def test_queue_and_stack_order_under_threads(kind):
  """4 producer threads; one consumer. Queue: each producer's items come out in its
  order; Stack: every item comes out exactly once and the table never exceeds its limit."""
  spec = (fr.queue if kind == "queue" else fr.stack)(8, ITEM)
  t = Table(spec)
  n = 40
  errors = []

  def producer(p):
    try:
      for i in range(n):
        t.insert(rows([100 * (p + 1) + i]), timeout=20)
    except Exception as e:  # noqa: BLE001
      errors.append(repr(e))

  ths = [threading.Thread(target=producer, args=(p,), daemon=True) for p in range(4)]
  for th in ths:
    th.start()
  got = []
  for _ in range(4 * n):
    got.append(int(t.sample(1, timeout=20).data["x"][0]))
    assert t.size <= 8
  for th in ths:
    th.join(20)
  assert not errors and not any(th.is_alive() for th in ths)
  assert sorted(got) == sorted(100 * (p + 1) + i for p in range(4) for i in range(n))
  if kind == "queue":
    for p in range(4):
      assert [g for g in got if g // 100 == p + 1] == [100 * (p + 1) + i for i in range(n)]
  with pytest.raises(TimeoutError):
    t.sample(1, timeout=0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("call", ["sample", "sample_packed", "take_batch"])
def test_a_waiting_sample_sees_the_tables_version_move(call):
  """A sample blocked for eligible items judges staleness at the table's version when it
  wakes, not at the version it started with: after ``set_version(10)``, items inserted
  at version 0 are stale (max_staleness 2) and the call keeps waiting (it returned them;
  found by a review); fresh ones end the wait."""
  spec = fr.TableSpec(16, ITEM, max_staleness=2, metadata=("task",))
  t = Table(spec)
  got = {}

  def learner():
    if call == "take_batch":
      got["v"] = t.take_batch({0: 2}, column="task", timeout=30)[0].info.version
    elif call == "sample_packed":
      got["v"] = t.sample_packed(2, timeout=30).numpy().info.version
    else:
      got["v"] = t.sample(2, timeout=30).info.version

  th = threading.Thread(target=learner, daemon=True)
  th.start()
  time.sleep(0.3)
  t.set_version(10)
  t.insert(rows([0, 1]), version=0, metadata={"task": [0, 0]})
  th.join(0.5)
  assert th.is_alive(), f"{call} returned stale items: versions {got.get('v')}"
  t.insert(rows([2, 3]), version=9, metadata={"task": [0, 0]})
  th.join(20)
  assert not th.is_alive()
  assert np.asarray(got["v"]).tolist() == [9, 9]
  t.close()
