"""funcreplay.ray under faults: timeouts that name their cause, a stuck or killed actor,
crashes with batches in flight, killed producers and learners, calls after close; then the
clients on top (sequence writer, torch prefetch, the async rollouts experiment).

The cluster and the rules of test_ray.py apply (tests/ray/conftest.py).
"""

from __future__ import annotations

import os
import sys
import time

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
  with pytest.raises(frr.WriterError, match="failed .*4 shipped items were not inserted") as e:
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
  # A beta schedule's value is checked as TorchSampler checks it (a NaN gave NaN weights).
  bad = frt.RemoteTorchSampler(rt, 16, prefetch=1, beta=lambda i: float("nan"), num_batches=1)
  with pytest.raises(ValueError, match=r"RemoteTorchSampler: beta\(0\) returned nan"):
    next(bad)
  bad.close()

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
  assert os.path.getsize(tmp_path / "learning_curve.png") > 1000


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
