"""funcreplay.ray on a local Ray cluster: a replay actor, producer and learner processes.

One cluster for the package (``tests/ray/conftest.py``); every test runs on one
pytest-xdist worker (``xdist_group("ray")`` with ``--dist loadgroup``, the Makefile's), so
two workers never start clusters at once. Producers and learners are Ray actors, i.e.
other processes. Every wait is bounded (timeouts), no assertion is timed. Timeouts, faults
and the clients on top: test_ray_faults.py.
"""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="funcreplay.ray needs Ray (pip install 'funcreplay[ray]')")

import funcreplay as fr  # noqa: E402
import funcreplay.ray as frr  # noqa: E402
from tests.ray.common import (  # noqa: E402
  ITEM,
  WAIT_S,
  Learner,
  Producer,
  batch,
  fresh,
  item,
  removed,
  spec,
)

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(180)]


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
  # Get-or-create of an existing actor: checkpoint options that would go unused are named.
  with pytest.warns(RuntimeWarning, match=r"exists already; its checkpoint options .* yours "
                                          r"\{'checkpoint_dir': '/tmp/x'\} are not applied"):
    frr.connect("shared", spec(), checkpoint_dir="/tmp/x")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    frr.connect("shared", spec())                    # nothing given: nothing ignored
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


