"""funcreplay.ray: call semantics a review found wrong, each checked here: short timeouts,
oversized batches, a closed Prefetcher's queued calls, a writer's flush / close while a
put blocks, a failed writer's accounting, connect's option checks and its errors.

The cluster and the rules of test_ray.py apply (tests/ray/conftest.py).
"""

from __future__ import annotations

import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="funcreplay.ray needs Ray (pip install 'funcreplay[ray]')")

import funcreplay as fr  # noqa: E402
import funcreplay.ray as frr  # noqa: E402
from tests.ray.common import WAIT_S, batch, fresh, item, spec  # noqa: E402

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(180)]


def _queue(capacity=64):
  return spec(capacity, rate_limiter=fr.Queue(4), sampler=fr.Fifo(), remover=fr.Fifo())


def test_short_timeouts_try_once_and_oversized_batches_are_refused():
  """``timeout=0`` tries once, as locally (the deadline had passed when the call reached
  the actor, which refused it); a huge batch gets the table's ValueError (the actor
  allocated its reply buffer first: a MemoryError)."""
  rt = fresh(spec(64))
  rt.insert(batch(4), timeout=0)
  rt.insert(batch(2, 4), timeout=0.0005)
  assert rt.sample(3, timeout=0).valid.all() and rt.size == 6
  with pytest.raises(TimeoutError, match="only 6 eligible items"):
    rt.sample(8, timeout=0)
  with pytest.raises(ValueError, match="exceeds the capacity 64"):
    rt.sample(2**31 - 1)
  with pytest.raises(ValueError, match="too large"):
    rt.sample(2**40, replace=True)
  rt.close()


def test_a_closed_prefetcher_takes_nothing_more():
  """``Prefetcher.close()`` cancels its calls that have not sampled: they waited in the
  actor and took the next items inserted, for nobody (with a reuse limit of 1, lost).
  Here all four wait on an empty table when another thread closes the iterator; the
  ``next`` blocked on the first ends with ``StopIteration``."""
  rt = fresh(spec(64, sampler=fr.Fifo(), max_times_sampled=1))
  p = rt.prefetch(4, prefetch=4, timeout=30.0)
  got = []
  th = threading.Thread(target=lambda: got.append(list(p)), daemon=True)
  th.start()
  time.sleep(1.0)                                    # the four calls wait in the actor
  p.close()
  th.join(WAIT_S)
  assert not th.is_alive() and got == [[]]
  rt.insert(batch(12, 100))
  assert rt.sample(4, timeout=5.0).data["step"].tolist() == [100, 101, 102, 103]
  assert rt.stats()["samples"] == 4 and rt.size == 8
  rt.close()


def test_flush_and_close_keep_their_timeouts_while_a_put_blocks():
  """A producer's put blocked by back-pressure holds the writer: ``flush(timeout=)`` and
  ``close(timeout=)`` from other threads waited for it without a bound."""
  rt = fresh(_queue())
  w = rt.writer(batch_size=2, max_wait_s=0.0, max_in_flight=1)
  ended = []

  def produce():
    try:
      for i in range(100):
        w.put(item(i))
    except Exception as e:  # noqa: BLE001 (the close below refuses later puts)
      ended.append(e)

  th = threading.Thread(target=produce, daemon=True)
  th.start()
  deadline = time.monotonic() + WAIT_S
  while rt.size < 4:
    assert time.monotonic() < deadline
    time.sleep(0.05)
  time.sleep(0.3)                                    # the producer is blocked in put now
  for call in (lambda: w.flush(timeout=0.5), lambda: w.close(timeout=0.5)):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"another thread's put holds the writer.*Queue\(4\)"):
      call()
    assert time.monotonic() - t0 < 5.0
  while th.is_alive():                               # drain: the put returns, then is refused
    rt.sample(2, timeout=1.0)
    th.join(0.1)
  assert ended and isinstance(ended[0], frr.WriterClosedError)
  rt.close()


def test_a_failed_writers_unsent_items_are_counted_when_it_closes():
  """A writer whose batch failed (the actor is gone) drops its unsent items at ``close``,
  counted in ``discarded`` and named in the error (they stayed "buffered" for good)."""
  rt = fresh(_queue())
  rt.insert(batch(4))                                # full: the next insert waits
  w = rt.writer(batch_size=2, max_wait_s=0.0, max_in_flight=1, on_full="raise")
  w.put(item(0))                                     # shipped, held by the limiter
  w.put(item(1))
  w.put(item(2))                                     # the local batch
  ray.kill(rt.actor, no_restart=True)
  with pytest.raises(frr.WriterError, match="1 shipped items were not inserted, and 2 "
                                            "accepted items never shipped were dropped"):
    w.close(timeout=WAIT_S)
  st = w.stats()
  assert (st.accepted, st.inserted, st.failed, st.discarded, st.buffered) == (3, 0, 1, 2, 0)


@ray.remote(num_cpus=0)
class NotAReplayActor:
  def ping(self):
    return 1


def test_connect_checks_its_options_and_names_what_it_cannot_apply(tmp_path):
  """Checkpoint options that would do nothing are refused; a get-or-create of an existing
  actor names a seed or actor options it cannot apply; a constructor's error (a checkpoint
  that does not fit) and a foreign actor of that name are named; ``close(final_save=True)``
  without a directory is refused and leaves the table open."""
  for kw, match in ((dict(checkpoint_every_s=1.0), "need checkpoint_dir"),
                    (dict(checkpoint_dir=str(tmp_path), checkpoint_every_inserts=0), ">= 1"),
                    (dict(checkpoint_dir=str(tmp_path), checkpoint_every_s=-1), "> 0"),
                    (dict(checkpoint_dir=str(tmp_path), checkpoint_keep_last=0), ">= 1")):
    with pytest.raises(ValueError, match=match):
      frr.connect("options", spec(), **kw)
  rt = frr.connect("made-once", spec())
  with pytest.warns(RuntimeWarning, match=r"its seed 0 holds, not yours \(5\)"):
    frr.connect("made-once", spec(), seed=5)
  with pytest.warns(RuntimeWarning, match=r"your actor options \['max_restarts'\] are not"):
    frr.connect("made-once", spec(), max_restarts=2)
  with pytest.raises(ValueError, match="no checkpoint_dir.*nothing was closed"):
    rt.close(final_save=True)
  rt.insert(batch(2))
  assert rt.size == 2
  rt.close()
  small = frr.connect("small-ckpt", spec(32), checkpoint_dir=str(tmp_path))
  small.insert(batch(3))
  small.checkpoint_now()
  small.close()
  with pytest.raises(frr.TableUnavailableError,
                     match=r"failed to start: .*CheckpointError: .*capacity: checkpoint 32"):
    frr.connect("big-ckpt", spec(64), checkpoint_dir=str(tmp_path))
  other = NotAReplayActor.options(name="not-replay").remote()
  ray.get(other.ping.remote(), timeout=WAIT_S)
  for s in (spec(), None):
    with pytest.raises(ValueError, match="is not a funcreplay replay actor"):
      frr.connect("not-replay", s)
  ray.kill(other)
