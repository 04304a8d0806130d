"""funcreplay.ray on a local Ray cluster: a replay actor, producer and learner processes.

One cluster per module (``ray.init(num_cpus=2)``); every test of this module runs
on one pytest-xdist worker (``xdist_group("ray")`` with ``--dist loadgroup``, the
Makefile's), so two workers never start clusters at once. Producers and learners
are Ray actors, i.e. other processes. Every wait is bounded (timeouts), no
assertion is timed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
import warnings

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="funcreplay.ray needs Ray (pip install 'funcreplay[ray]')")

import funcreplay as fr  # noqa: E402
import funcreplay.ray as frr  # noqa: E402

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(180)]

ITEM = {"obs": np.zeros((4,), np.float32), "step": np.zeros((), np.int32)}
WAIT_S = 60.0  # bound on every wait for another process in these tests
# The tests move kilobytes; a small object store keeps /dev/shm free on CI machines.
OBJECT_STORE_BYTES = 128 * 1024**2


def item(i: int, pid: int = 0):
  return {"obs": np.full((4,), pid * 10_000 + i, np.float32), "step": np.int32(i)}


def batch(n: int, start: int = 0):
  return {"obs": np.arange(start, start + n, dtype=np.float32)[:, None].repeat(4, 1),
          "step": np.arange(start, start + n, dtype=np.int32)}


def spec(capacity=256, **kw):
  kw.setdefault("metadata", ("producer",))
  return fr.TableSpec(capacity, ITEM, **kw)


@pytest.fixture(scope="module", autouse=True)
def cluster():
  # Workers inherit this environment (the worktree on PYTHONPATH, CPU-only JAX).
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  old = os.environ.get("PYTHONPATH")
  os.environ["PYTHONPATH"] = os.pathsep.join(
      [root] + [p for p in (old or "").split(os.pathsep) if p])
  # Producer / learner classes below travel by value (workers need not import tests/).
  ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
  with warnings.catch_warnings():  # JAX's fork warning: Ray forks only to exec its daemons
    warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
    ray.init(num_cpus=2, include_dashboard=False, namespace="funcreplay-tests",
             log_to_driver=False, object_store_memory=OBJECT_STORE_BYTES)
  yield
  ray.shutdown()
  if old is None:
    os.environ.pop("PYTHONPATH", None)
  else:
    os.environ["PYTHONPATH"] = old


_names = iter(range(10**6))


def fresh(s=None, **kw):
  """A new replay actor with a unique name."""
  return frr.connect(f"t{next(_names)}", s or spec(), **kw)


@ray.remote(num_cpus=0)
class Producer:
  """A producer process: puts single items through a RemoteWriter."""

  def __init__(self, table):
    self.table = table
    self.writer = None

  def produce(self, pid: int, n: int, batch_size: int = 32, start: int = 0):
    """Put items ``start .. start + n - 1`` of producer ``pid`` (step = the item's number)."""
    with self.table.writer(batch_size=batch_size, max_wait_s=0.005, max_in_flight=2) as w:
      for i in range(start, start + n):
        w.put(item(i, pid), metadata={"producer": pid})
    return dataclasses.asdict(w.stats())

  def put_then_hang(self, flushed: int, unsent: int):
    """Ship ``flushed`` items, then keep ``unsent`` in the local batch (not shipped)."""
    self.writer = self.table.writer(batch_size=10_000, max_wait_s=3600.0)
    for i in range(flushed):
      self.writer.put(item(i))
    self.writer.flush(timeout=WAIT_S)
    for i in range(unsent):
      self.writer.put(item(flushed + i))
    return dataclasses.asdict(self.writer.stats())


@ray.remote(num_cpus=0)
class Learner:
  """A learner process: samples and writes priorities back."""

  def __init__(self, table):
    self.table = table
    self.sampled = 0

  def learn(self, batches: int, batch_size: int):
    for _ in range(batches):
      s = self.table.sample(batch_size, timeout=WAIT_S)
      self.table.update_priorities(s.info.slot, s.info.key,
                                   np.abs(s.data["obs"][:, 0]) % 7 + 0.5)
      self.sampled += int(s.valid.sum())
    return self.sampled

  def count_sampled(self):
    return self.sampled


def removed(st):
  return st["deletes"] + st["evicted_capacity"] + st["evicted_stale"] + st["evicted_reuse"]


# -- connect --------------------------------------------------------------------------------
def test_connect_creates_attaches_and_refuses():
  with pytest.raises(LookupError, match="no replay actor named 'absent'"):
    frr.connect("absent")
  rt = frr.connect("shared", spec())
  same = frr.connect("shared")                       # attach by name
  again = frr.connect("shared", spec())              # get-or-create: the same actor
  assert same.info["pid"] == rt.info["pid"] == again.info["pid"]
  with pytest.raises(ValueError, match="already exists .* with another spec"):
    frr.connect("shared", spec(capacity=512))
  with pytest.raises(ValueError, match="only applies when creating"):
    frr.connect("shared", checkpoint_dir="/tmp/x")
  with pytest.raises(TypeError, match="spec must be a TableSpec"):
    frr.connect("other", {"obs": 1})
  ragged = fr.TableSpec(8, {"tokens": fr.Ragged(16, np.int32), "step": ITEM["step"]})
  with pytest.raises(ValueError, match=r"connect: the spec has ragged leaves \(\['tokens'\]\), "
                     r"which the replay actor does not serve .*take_batch"):
    frr.connect("ragged", ragged)
  with pytest.raises(LookupError):                   # refused before an actor was made
    frr.connect("ragged")
  rt.insert(batch(3))
  assert same.size == 3
  rt.close()


# -- the reference: a local Table of the same spec and seed ---------------------------------
def test_remote_calls_match_a_local_table():
  s = spec(64, sampler=fr.Prioritized(0.6), max_times_sampled=3)
  rt, local = fresh(s, seed=7), fr.Table(s, seed=7)
  rng = np.random.default_rng(0)
  for step in range(12):
    b = batch(int(rng.integers(1, 9)), start=step * 10)
    meta = {"producer": rng.integers(0, 3, len(b["step"])).astype(np.int32)}
    for t in (rt, local):
      t.set_version(step)
      t.insert(b, metadata=meta, version=step)
    if step >= 2:
      where = {"producer": [0, 2]} if step % 3 == 0 else None
      got = rt.sample(4, where=where, timeout=5.0)
      want = local.sample(4, where=where, timeout=5.0)
      assert isinstance(got.data["obs"], np.ndarray)
      np.testing.assert_array_equal(got.info.slot, np.asarray(want.info.slot))
      np.testing.assert_array_equal(got.info.key, np.asarray(want.info.key))
      np.testing.assert_array_equal(got.data["obs"], np.asarray(want.data["obs"]))
      np.testing.assert_allclose(got.info.probability, np.asarray(want.info.probability))
      p = (np.arange(4) + step).astype(np.float32)
      rt.update_priorities(got.info.slot, got.info.key, p)
      local.update_priorities(want.info.slot, want.info.key, p)
    assert rt.count() == local.count()
    assert rt.count(where={"producer": 1}) == local.count(where={"producer": 1})
  want_stats = local.stats().to_dict()
  assert rt.stats() == want_stats
  rt.close()


def snapshot(table):
  """The table's whole state as numpy leaves (run in the actor, or locally)."""
  import jax
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(table.snapshot())]


def test_writer_batches_reach_the_state_an_ingestor_reaches():
  """Reference: the same puts (mixed explicit / default versions, priorities, metadata),
  batched differently, through a RemoteWriter into the actor and through an Ingestor into
  a local Table of the same spec: the two states are identical, leaf by leaf."""
  s = spec(128, sampler=fr.Prioritized(0.6))
  rt, local = fresh(s), fr.Table(s)
  rng = np.random.default_rng(3)
  puts = []
  for i in range(300):
    kw = {}
    if rng.random() < 0.5:
      kw["version"] = int(rng.integers(0, 3))
    if rng.random() < 0.4:
      kw["priority"] = float(rng.random() * 5)
    if rng.random() < 0.5:
      kw["metadata"] = {"producer": int(rng.integers(0, 4))}
    puts.append((item(i), kw))
  for t in (rt, local):
    t.set_version(2)
  with rt.writer(batch_size=int(rng.integers(1, 40)), max_wait_s=0.0) as w, \
      local.ingestor(batch_size=50) as ing:
    for it, kw in puts:
      w.put(it, **kw)
      ing.put(it, **kw)
  assert w.stats().inserted == 300 and w.stats().batches > 1
  got, want = rt.run(snapshot, timeout=WAIT_S), snapshot(local)
  assert len(got) == len(want)
  for g, x in zip(got, want, strict=True):
    np.testing.assert_array_equal(g, x)
  rt.close()


# -- bad input crossing the process boundary ------------------------------------------------
BAD = [
    ("insert", lambda t: t.insert({"obs": np.zeros((2, 5), np.float32),
                                   "step": np.zeros(2, np.int32)})),
    ("insert", lambda t: t.insert({"obs": np.zeros((2, 4), np.float64),
                                   "step": np.zeros(2, np.int32)})),
    ("insert", lambda t: t.insert(batch(2), metadata={"nope": 1})),
    ("insert", lambda t: t.insert(batch(2), priority=-1.0)),
    ("sample", lambda t: t.sample(0)),
    ("sample", lambda t: t.sample(2, where={"nope": 1}, timeout=1.0)),
    ("sample", lambda t: t.sample(4, timeout=0.2)),
    ("update_priorities", lambda t: t.update_priorities([999], [0], [1.0])),
    ("update_priorities", lambda t: t.update_priorities([0], [0], [float("nan")])),
    ("count", lambda t: t.count(where=np.ones(3, bool))),
    ("set_version", lambda t: t.set_version(1.5)),
]


def test_bad_input_gives_the_local_errors_and_leaves_the_table_intact():
  rt, local = fresh(spec(16)), fr.Table(spec(16))
  for t in (rt, local):
    t.insert(batch(3))
  before = rt.stats()
  for what, call in BAD:
    with pytest.raises(Exception) as want:
      call(local)
    with pytest.raises(type(want.value)) as got:
      call(rt)
    assert type(got.value) is type(want.value), what
    assert str(got.value) == str(want.value), what
  assert rt.stats() == before
  # The producer client checks items in the producer, with the Ingestor's messages.
  with local.ingestor() as ing, rt.writer() as w:
    for bad in ({"obs": np.zeros(5, np.float32), "step": np.int32(0)},
                {"obs": np.zeros(4, np.float32), "step": 1.5}):
      with pytest.raises(Exception) as want:
        ing.put(bad)
      with pytest.raises(type(want.value)) as got:
        w.put(bad)
      assert str(got.value) == str(want.value).replace("Ingestor.put", "RemoteWriter.put")
    with pytest.raises(ValueError, match="RemoteWriter.put: unknown metadata columns"):
      w.put(item(0), metadata={"nope": 1})
    with pytest.raises(ValueError, match="priority must be finite"):
      w.put(item(0), priority=float("inf"))
  assert w.stats().accepted == 0 and rt.stats() == before
  rt.close()


# -- producers and a learner in other processes ---------------------------------------------
def present_items(table):
  """In the actor: (key, producer, step, obs[0]) of every item present, in key order."""
  from funcreplay.core import storage
  st = table.snapshot()
  occ = np.asarray(st.occupied)
  items = storage.stored_items(table.spec, st)
  key = np.asarray(st.key)[occ].astype(np.int64)
  order = np.argsort(key)
  return (key[order], np.asarray(st.metadata["producer"])[occ][order],
          np.asarray(items["step"])[occ][order], np.asarray(items["obs"])[occ, 0][order])


def check_producer_order(rt, n_prod):
  """Per producer, the items present went in in the producer's order (keys, the insertion
  index, increase with its step counter) and each row carries its own producer's tag."""
  key, prod, step, obs = rt.run(present_items, timeout=WAIT_S)
  assert len(np.unique(key)) == len(key) == rt.size
  steps = {}
  for p in range(n_prod):
    mine = prod == p
    assert (np.diff(step[mine]) > 0).all(), f"producer {p}'s items went in out of order"
    np.testing.assert_array_equal(obs[mine], p * 10_000 + step[mine])
    steps[p] = step[mine]
  assert sum(map(len, steps.values())) == len(key)      # every item is some producer's
  return steps


def test_producers_and_learner_processes_conserve_items():
  s = spec(128, sampler=fr.Prioritized(0.6), max_times_sampled=3)
  rt = fresh(s)
  n_prod, per = 3, 400
  producers = [Producer.remote(rt) for _ in range(n_prod)]
  learner = Learner.remote(rt)
  done = [p.produce.remote(i, per) for i, p in enumerate(producers)]
  # 20 x 16 rows: satisfiable even if the learner starts after the producers finished
  # (128 items x max_times_sampled 3 = 384 rows, and 16 still eligible after 320).
  learned = learner.learn.remote(20, 16)
  stats = ray.get(done, timeout=WAIT_S)
  sampled = ray.get(learned, timeout=WAIT_S)
  for st in stats:
    assert st["accepted"] == st["inserted"] == per and st["failed"] == st["buffered"] == 0
  st = rt.stats()
  assert st["inserts"] == n_prod * per
  assert st["size"] + removed(st) == st["inserts"]      # nothing lost uncounted
  assert st["evicted_capacity"] > 0                     # the ring was overwritten
  assert st["samples"] == sampled == 20 * 16
  check_producer_order(rt, n_prod)
  # Whether a producer's newest item survived the learner (reuse evictions) and the other
  # producers (the ring) depends on timing; with the learner stopped, a second round that
  # fits the table (3 x 40 <= 128, the Fifo remover evicts the oldest keys) must be present
  # whole: every producer's newest 40 items, its newest item included, in its order.
  more = 40
  stats = ray.get([p.produce.remote(i, more, 8, per) for i, p in enumerate(producers)],
                  timeout=WAIT_S)
  assert all(x["inserted"] == more for x in stats)
  steps = check_producer_order(rt, n_prod)
  for p in range(n_prod):
    np.testing.assert_array_equal(steps[p][-more:], np.arange(per, per + more))
  st = rt.stats()
  assert st["inserts"] == n_prod * (per + more) == st["size"] + removed(st)
  rt.close()


def test_back_pressure_blocks_or_raises_and_loses_nothing():
  rt = fresh(spec(64, rate_limiter=fr.Queue(8), sampler=fr.Fifo(), remover=fr.Fifo()))
  with rt.writer(batch_size=4, max_in_flight=1, max_wait_s=0.0, on_full="raise") as w:
    # Retry on WriterFullError until it persists: once the Queue(8) holds 8 items its
    # limiter holds the in-flight batch in the actor for good, and the local batch fills.
    # Before that the writer may be full only because the actor is slow (its first insert
    # compiles: seconds on a loaded 2-core CI machine), so those fulls do not count.
    deadline = time.monotonic() + WAIT_S
    accepted = fulls = 0
    while fulls < 10:
      try:
        w.put(item(accepted))
        accepted, fulls = accepted + 1, 0
      except frr.WriterFullError as e:
        assert "batches are in flight" in str(e)
        fulls = fulls + 1 if rt.size >= 8 else 0
        time.sleep(0.05)
      assert accepted < 100 and time.monotonic() < deadline
    assert w.stats().accepted == accepted
    assert 8 < accepted <= 8 + 4 + 4      # the queue, the blocked batch, the local batch
    w2 = rt.writer(batch_size=4, max_in_flight=1, max_wait_s=0.0, put_timeout=0.3)
    with pytest.raises(TimeoutError, match=r"Queue\(8\) may be blocking inserts"):
      for i in range(100):
        w2.put(item(1000 + i))
    got = 0
    while got < accepted + w2.stats().accepted:      # the learner drains: everything arrives
      got += int(rt.sample(1, timeout=WAIT_S).valid.sum())
      if got == accepted + w2.stats().accepted:
        break
    w2.close(discard_pending=True)
  s1, s2 = w.stats(), w2.stats()
  assert s1.inserted == s1.accepted and s1.failed == 0
  assert s2.inserted + s2.discarded == s2.accepted
  assert rt.stats()["inserts"] == s1.inserted + s2.inserted
  rt.close()


def test_blocked_sample_does_not_block_inserts_or_queries():
  rt = fresh(spec(64, rate_limiter=fr.MinSize(8)))
  ref = rt.sample_async(8, timeout=WAIT_S)          # blocks in the actor: table empty
  assert rt.count() == 0                            # control calls still answer
  ready, _ = ray.wait([ref], timeout=0.2)
  assert not ready
  rt.insert(batch(8))                               # inserts still go in, and wake it
  smp = ray.get(ref, timeout=WAIT_S)
  assert np.asarray(smp.numpy().valid).all()
  rt.close()


def test_timeouts_name_their_cause():
  rt = fresh(spec(16, rate_limiter=fr.Queue(4), sampler=fr.Fifo(), remover=fr.Fifo()))
  rt.insert(batch(4))
  rt.sample(1, timeout=5.0)                          # room for one more insert
  with pytest.raises(TimeoutError, match=r"Table.insert timed out after 0.2 s with 1 of 3 "
                     r"items inserted: the rate limiter Queue\(4\)") as e:
    rt.insert(batch(3), timeout=0.2)
  assert e.value.inserted == 1 and rt.size == 5
  with pytest.raises(TimeoutError, match=r"Table.sample\(8\) timed out after 0.2 s"):
    rt.sample(8, timeout=0.2)
  rt.close()


def hold_table(table, started: str, release: str):
  """In the actor: hold the table's lock (as a stuck call would) until ``release`` exists."""
  with table._cond:  # noqa: SLF001 (the test plays a stuck actor)
    open(started, "w").close()
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(release) and time.monotonic() < deadline:
      time.sleep(0.01)


def wait_for_file(path: str) -> None:
  deadline = time.monotonic() + WAIT_S
  while not os.path.exists(path):
    assert time.monotonic() < deadline, f"{path} never appeared"
    time.sleep(0.01)


def test_saves_and_runs_on_a_stuck_actor_time_out(tmp_path):
  """An actor that is alive but stuck (its table's lock held by a colocated call) makes
  save, checkpoint_now and run raise TimeoutError naming the call, while the actor is still
  stuck: no call waits for it without a bound."""
  rt = fresh(checkpoint_dir=str(tmp_path / "ckpt"))
  rt.insert(batch(4))
  started, release = str(tmp_path / "started"), str(tmp_path / "release")
  stuck = rt.run_async(hold_table, started, release)
  wait_for_file(started)
  calls = [("Table.save", lambda: rt.save(str(tmp_path / "s"), timeout=0.3)),
           ("RemoteTable.checkpoint_now", lambda: rt.checkpoint_now(timeout=0.3)),
           ("RemoteTable.run", lambda: rt.run(hold_table, started, release, timeout=0.3))]
  # run's default bound is the handle's rpc_timeout (here 0.3 s).
  quick = frr.RemoteTable(rt.actor, rt.name, rt.namespace, rt.info, rpc_timeout=0.3)
  calls.append(("RemoteTable.run", lambda: quick.run(hold_table, started, release)))
  for what, call in calls:
    with pytest.raises(TimeoutError, match=rf"{what}: no reply from the replay actor "
                       rf"'{rt.name}' within 0.3 s"):
      call()
    assert not ray.wait([stuck], timeout=0)[0], "the actor was released before the timeout"
  open(release, "w").close()
  ray.get(stuck, timeout=WAIT_S)
  with pytest.raises(ValueError, match="timeout must be None"):
    rt.save(str(tmp_path / "t"), timeout=-1.0)
  assert os.path.basename(rt.checkpoint_now()).startswith("ckpt-")  # the default bound: fine
  rt.close()


# -- faults ---------------------------------------------------------------------------------
def wait_restarted(rt, pid):
  """The restarted actor's info, once a process other than ``pid`` answers."""
  deadline = time.monotonic() + WAIT_S
  while True:
    try:
      info = rt.ping(timeout=5.0)
      if info["pid"] != pid:
        return info
    except (frr.TableUnavailableError, TimeoutError):
      pass
    assert time.monotonic() < deadline, "the actor did not restart"
    time.sleep(0.2)


def test_actor_kill_restarts_and_restores_the_newest_checkpoint(tmp_path):
  rt = fresh(spec(64), checkpoint_dir=str(tmp_path), checkpoint_every_s=3600.0, max_restarts=1)
  rt.insert(batch(20))
  rt.set_version(5)
  path = rt.checkpoint_now()
  assert os.path.basename(path).startswith("ckpt-")
  rt.insert(batch(7, start=20))                     # after the checkpoint: lost on a crash
  pid = rt.info["pid"]
  ray.kill(rt.actor, no_restart=False)
  info = wait_restarted(rt, pid)
  assert info["restarted"] and os.path.samefile(info["restored_from"], path)
  assert rt.size == 20 and rt.version == 5
  assert rt.stats()["inserts"] == 20
  smp = rt.sample(4, timeout=5.0)
  assert smp.valid.all() and (smp.data["step"] < 20).all()
  rt.close()
  with pytest.raises(frr.TableUnavailableError, match="is gone"):
    rt.count()


def test_a_crash_fails_the_writers_whose_batches_were_in_flight():
  """README "Faults": an actor crash (restarted by Ray) fails a writer whose batch it held:
  WriterError chained to TableUnavailableError in flush / put / close, the batch counted
  in stats().failed; nothing hangs, and a new writer feeds the restarted actor."""
  rt = fresh(spec(64, rate_limiter=fr.Queue(8), sampler=fr.Fifo(), remover=fr.Fifo()),
             max_restarts=1)
  rt.insert(batch(6))
  w = rt.writer(batch_size=4, max_wait_s=3600.0, max_in_flight=2)
  for i in range(4):
    w.put(item(100 + i))                             # the 4th put ships the batch
  deadline = time.monotonic() + WAIT_S
  while rt.size < 8:                                 # 2 rows went in; the Queue(8) holds the
    assert time.monotonic() < deadline               # other 2 in the actor: in flight for good
    time.sleep(0.05)
  assert w.stats().in_flight == 4 and w.stats().inserted == 0
  pid = rt.info["pid"]
  ray.kill(rt.actor, no_restart=False)               # a crash: Ray restarts it
  with pytest.raises(frr.WriterError, match="failed .*4 items were not inserted") as e:
    w.flush(timeout=WAIT_S)
  assert isinstance(e.value.__cause__, frr.TableUnavailableError)
  st = w.stats()
  assert (st.accepted, st.inserted, st.failed, st.in_flight) == (4, 0, 4, 0)
  with pytest.raises(frr.WriterError):
    w.put(item(104))
  with pytest.raises(frr.WriterError):
    w.close()
  assert w.stats().rejected == 1
  assert wait_restarted(rt, pid)["restarted"]
  assert rt.size == 0                                # no checkpoint_dir: it starts empty
  with rt.writer(batch_size=4) as w2:                # a new writer feeds the new actor
    for i in range(3):
      w2.put(item(i))
  assert w2.stats().inserted == 3 and rt.size == 3
  rt.close()


def test_a_killed_producer_loses_only_its_unsent_batch():
  rt = fresh()
  p = Producer.remote(rt)
  st = ray.get(p.put_then_hang.remote(40, 25), timeout=WAIT_S)
  assert st["inserted"] == 40 and st["buffered"] == 25
  ray.kill(p)
  assert rt.size == 40
  assert rt.stats()["inserts"] == 40
  rt.close()


def test_a_killed_learner_leaves_the_table_intact():
  rt = fresh(spec(64, max_times_sampled=0))
  rt.insert(batch(64))
  learner = Learner.options(max_concurrency=2).remote(rt)  # count_sampled answers meanwhile
  learner.learn.remote(10_000, 8)
  deadline = time.monotonic() + WAIT_S
  while ray.get(learner.count_sampled.remote(), timeout=WAIT_S) < 40:
    assert time.monotonic() < deadline
    time.sleep(0.05)
  ray.kill(learner)
  st = rt.stats()
  assert st["size"] == 64 and st["inserts"] == 64 and removed(st) == 0
  assert rt.sample(8, timeout=5.0).valid.all()
  rt.close()


def test_calls_after_close_raise_and_writers_fail_loudly():
  rt = fresh()
  w = rt.writer(batch_size=4, max_wait_s=3600.0)
  w.put(item(0))
  blocked = rt.sample_async(1, timeout=WAIT_S)       # waits in the actor: the table is empty
  rt.close()
  with pytest.raises((fr.TableClosedError, frr.TableUnavailableError)):  # woken, not hung
    frr.calls.wait_reply(blocked, WAIT_S, "Table.sample", rt.name)
  for call in (rt.count, rt.stats, lambda: rt.sample(1, timeout=1.0), lambda: rt.insert(batch(1))):
    with pytest.raises(frr.TableUnavailableError, match="is gone"):
      call()
  for i in range(1, 3):
    w.put(item(i))
  with pytest.raises(frr.WriterError, match="failed") as e:
    w.put(item(3))                                   # the 4th put ships the batch: refused
  assert isinstance(e.value.__cause__, frr.TableUnavailableError)
  assert w.stats().failed == 4                       # counted, not lost silently
  with pytest.raises(frr.WriterError, match="failed"):
    w.flush(timeout=WAIT_S)
  with pytest.raises(frr.WriterError):
    w.put(item(5))
  with pytest.raises(frr.WriterError):
    w.close()
  w.close()                                          # reported once


# -- clients on top -------------------------------------------------------------------------
def test_sequence_writer_on_a_remote_writer():
  steps = 4
  s = fr.TableSpec(32, fr.sequence_signature(ITEM, steps))
  rt = fresh(s)
  with rt.writer(batch_size=3) as w:
    sw = fr.SequenceWriter(w, steps)
    for t in range(10):
      sw.append(item(t), step_id=t)
    sw.close()
  assert rt.size == 2
  smp = rt.sample(2, timeout=5.0)
  got = sorted(smp.data["step"].tolist())
  assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]
  rt.close()


def test_prefetch_torch_batches_and_the_colocated_learner():
  torch = pytest.importorskip("torch")
  import funcreplay.torch as frt

  rt = fresh(spec(64, sampler=fr.Prioritized(0.6)))
  rt.insert(batch(64), metadata={"producer": np.arange(64, dtype=np.int32) % 2})
  n = 0
  for smp in rt.prefetch(8, prefetch=3, max_batches=5, where={"producer": 1}):
    assert (smp.data["step"] % 2 == 1).all()
    n += 1
  assert n == 5
  sampler = frt.RemoteTorchSampler(rt, 16, prefetch=2, beta=0.4, num_batches=3)
  for b in sampler:
    assert isinstance(b.data["obs"], torch.Tensor) and b.weights.shape == (16,)
    frt.update_priorities(rt, b.info, b.data["obs"][:, 0] + 1.0)
  with pytest.raises(StopIteration):
    next(sampler)

  def colocated(table, batches):
    # In the actor's process: TorchSampler on the Table itself, sampling in place.
    import funcreplay.torch as frt_
    ptrs = []
    with frt_.TorchSampler(table, 8, num_batches=batches) as it:
      for tb in it:
        storage = tb.valid.untyped_storage().data_ptr()
        ptrs.append(tb.data["obs"].untyped_storage().data_ptr() == storage)
    return os.getpid(), table.samples_in_place, ptrs

  pid, in_place, ptrs = rt.run(colocated, 3, timeout=WAIT_S)
  assert pid == rt.info["pid"] and in_place and ptrs == [True] * 3
  rt.close()


@pytest.mark.slow  # ~13 s: three more worker processes
def test_async_rollouts_experiment_smoke(tmp_path):
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  sys.path.insert(0, root)
  from configs import async_rollouts_ray as cfg
  from experiments import async_rollouts_ray

  c = cfg.get_config("tiny")
  s = async_rollouts_ray.run(c, str(tmp_path), verbose=False)
  assert s["learner_steps"] == c.learner_steps
  st = s["table_stats"]
  assert st["inserts"] == sum(s["inserted_per_producer"]) > 0
  assert st["size"] + removed(st) == st["inserts"]
  assert 0 <= s["mean_staleness_trained"] <= c.max_staleness
  assert os.path.exists(tmp_path / "summary.json")


def test_without_ray_the_package_imports_and_connect_says_what_to_install():
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  code = ("import sys; sys.modules['ray'] = None\n"   # as if Ray were not installed
          "import funcreplay.ray as frr, funcreplay.torch\n"
          "try:\n  frr.connect('x')\nexcept ImportError as e:\n  print('ERR', e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert "ERR funcreplay.ray needs Ray: pip install 'funcreplay[ray]'" in out.stdout
