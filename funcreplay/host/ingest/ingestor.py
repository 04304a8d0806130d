"""``Ingestor``: many producer threads -> one background thread -> ``Table.insert``.

Environment workers put items one at a time; the table wants batches. The
``Ingestor`` decouples the two: ``put`` validates one item and appends it to
a bounded in-memory queue (a ``collections.deque``: appending is atomic under
the GIL, so the common path takes no lock), and one background thread pops up
to ``batch_size`` items, stacks every leaf into a fresh ``[n, ...]`` numpy
array and calls ``table.insert`` (which pads to a power-of-two bucket, so the
jitted insert compiles at most ``log2(batch_size) + 1`` times).

Guarantees:

* **Back-pressure:** the queue holds at most ``max_queue`` items (plus at most
  one item per producer thread racing past the check); a full queue blocks
  ``put`` (``on_full="block"``, with ``put_timeout``) or raises
  ``IngestorFullError`` (``on_full="raise"``). A table whose rate limiter
  blocks inserts therefore blocks the producers instead of growing memory.
* **Order:** items reach the table in the order they were accepted (one FIFO
  queue, one inserting thread), so each producer's order is preserved.
* **Nothing accepted is dropped silently:** ``flush()`` waits until every
  item accepted before it is in the table; an exception in the insert thread
  is re-raised (as ``IngestorError``, chained) by the next ``put`` /
  ``put_batch`` / ``flush`` and by ``close()``, and every accepted item that
  could not be inserted is counted in ``stats().failed``. Only
  ``close(discard_pending=True)`` discards items, and counts them: called
  explicitly, or by leaving a ``with`` block on an exception once the table
  has taken nothing for ``EXIT_STALL_S`` (the exception notes how many).
* **No silent hang:** ``close()`` raises ``TimeoutError`` naming the rate
  limiter once nothing has gone in for ``CLOSE_STALL_S`` (60 s), and logs a
  warning every ``CLOSE_WARN_EVERY_S`` (10 s) while it waits.
* **Latency:** a partial batch is inserted once its first item has waited
  about ``max_wait_s`` (0: insert whatever is queued as soon as the thread is
  free; larger values give fewer, fuller inserts).

Items are *not* copied by ``put`` (``copy=False``): the queue keeps references
until the insert thread stacks them, so a producer must not modify an array
in place after putting it (pass ``copy=True`` if it reuses buffers).

Cost (``experiments/bench_host.py``; a 524-byte transition, 2-core CPU): a
``put`` is ~0.5 us of CPU in isolation, and the whole pipeline (puts,
stacking, ``Table.insert``) ~2 us of process CPU per item with 1-8 producer
threads, against ~19 us for cpprb's ``ReplayBuffer.add``. All producers and
the insert thread share the GIL, so throughput is bounded by the sum of their
Python work; only the table's XLA insert runs in parallel with it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Optional, Union

from funcreplay.host import validation
from funcreplay.host.ingest.batcher import Batcher
from funcreplay.host.ingest.errors import IngestorStats
from funcreplay.host.ingest.queue import NEVER as _NEVER
from funcreplay.host.ingest.queue import ProducerQueue
from funcreplay.host.ingest.worker import InsertWorker
from funcreplay.host.itemcheck import ItemChecker

LOG = logging.getLogger("funcreplay.ingest")
# close()'s default bound: give up once no pending item has gone in for this
# long. Long enough for any healthy drain (a table inserts thousands of items
# per second), short enough that a blocked rate limiter is reported, not hung on.
CLOSE_STALL_S = 60.0
# Leaving a with block on an exception: stop waiting for pending items (and
# discard them) once none has gone in for this long. Short: the program is
# unwinding, and a healthy table takes a batch in milliseconds.
EXIT_STALL_S = 1.0
# How often a waiting close() logs that it is still waiting, and on what.
CLOSE_WARN_EVERY_S = 10.0


class Ingestor(ProducerQueue, InsertWorker, Batcher):
  """A background thread inserting items put by any number of producer threads.

  Args:
    table: the ``funcreplay.Table`` to insert into (anything with ``spec``,
      ``version`` and ``insert(items, *, version, priority, metadata, timeout)``).
    batch_size: most items per ``table.insert`` call (the insert thread takes
      whatever is queued up to this many; capped at the table's capacity).
      Each insert call has a fixed host cost (~0.5 ms on a CPU), so large
      batches pay off at high rates; partial batches (``max_wait_s``,
      ``flush``) are padded by the table to a power-of-two bucket.
    max_queue: most items waiting in the queue (default ``8 * batch_size``;
      at least ``batch_size``).
    on_full: ``"block"`` (wait for room, up to ``put_timeout`` seconds, then
      ``TimeoutError``) or ``"raise"`` (``IngestorFullError`` at once).
    put_timeout: seconds a blocked ``put`` waits (None: forever).
    max_wait_s: about how long a partial batch waits for more items before
      it is inserted (0: never wait).
    copy: copy every leaf in ``put`` (for producers that reuse their arrays).
    insert_poll_s: how often an insert blocked by the table's rate limiter
      re-checks for ``close(discard_pending=True)``.
    sync_every: wait for the device every this many batches, so that
      asynchronously dispatched inserts cannot pile up without bound.

  Use as a context manager (``with table.ingestor() as ing:``); leaving the
  block closes it: normally ``close()``, which waits for the pending items
  but raises ``TimeoutError`` (naming the rate limiter) once none has gone in
  for ``CLOSE_STALL_S`` = 60 s, e.g. when a ``SampleToInsertRatio`` limiter
  blocks inserts because the learner stopped sampling; on an exception, the
  pending items go in while the table takes them, the rest is discarded once
  none has gone in for ``EXIT_STALL_S`` = 1 s, and the exception notes how
  many were discarded. An ingestor never closed keeps its daemon thread, and the
  table, alive. Thread-safe: ``put`` / ``put_batch`` /
  ``flush`` / ``stats`` from any thread. Relies on the GIL (CPython's
  default build): the lock-free ``put`` path is not safe on free-threaded
  builds.

  Example::

    table = fr.Table(fr.TableSpec(1_000_000, example_transition))
    with table.ingestor(max_wait_s=0.01) as ing:
      def actor(env):                       # run in many threads
        obs = env.reset()
        while True:
          action = policy(obs)
          next_obs, reward, done = env.step(action)
          ing.put(dict(obs=obs, action=action, reward=reward, next_obs=next_obs),
                  version=policy_version)
          obs = env.reset() if done else next_obs
      ...                                   # the learner samples from ``table``
  """

  def __init__(self, table, *, batch_size: int = 4096, max_queue: Optional[int] = None,
               on_full: str = "block", put_timeout: Optional[float] = None,
               max_wait_s: float = 0.005, copy: bool = False, insert_poll_s: float = 0.1,
               sync_every: int = 16, name: str = "funcreplay-ingestor"):
    if not all(hasattr(table, a) for a in ("spec", "insert", "version")):
      raise TypeError(f"Ingestor expects a funcreplay Table, got {type(table).__name__}.")
    batch_size = validation.check_int(batch_size, "Ingestor batch_size", 1, 2**30)
    batch_size = min(batch_size, table.spec.capacity)  # Table.insert takes <= capacity rows
    if max_queue is None:
      max_queue = 8 * batch_size
    max_queue = validation.check_int(max_queue, "Ingestor max_queue", 1, 2**40)
    if max_queue < batch_size:
      raise ValueError(f"Ingestor: max_queue ({max_queue}) must be >= batch_size "
                       f"({batch_size}).")
    if on_full not in ("block", "raise"):
      raise ValueError(f"Ingestor: on_full must be 'block' or 'raise', got {on_full!r}.")
    self._put_timeout = validation.check_timeout(put_timeout)
    for what, v in (("max_wait_s", max_wait_s), ("insert_poll_s", insert_poll_s)):
      if validation.check_timeout(v) is None:
        raise ValueError(f"Ingestor: {what} must be a finite number of seconds >= 0, got {v!r}.")
    self._table = table
    self._spec = table.spec
    if table.spec.ragged:
      raise TypeError("Ingestor: the table has Ragged leaves, which the Ingestor's fixed-shape "
                      "queue cannot carry; insert with Table.insert or fr.GroupWriter.")
    self._sig = table.spec.signature
    self._n_leaves = len(self._sig.leaves)
    self._checker = ItemChecker(self._sig, "Ingestor.put")
    self._fast = self._checker.fast
    self._batch_size = batch_size
    self._max_queue = max_queue
    self._raise_when_full = on_full == "raise"
    self._max_wait = float(max_wait_s)
    self._copy = bool(copy)
    self._poll = float(insert_poll_s)
    self._sync_every = validation.check_int(sync_every, "Ingestor sync_every", 0, 2**30)
    self._columns = self._spec.columns  # fr.Column each: entries carry stored words

    self._q: collections.deque = collections.deque()
    self._lock = threading.Lock()
    self._wake_cv = threading.Condition(self._lock)   # the insert thread sleeps here
    self._room_cv = threading.Condition(self._lock)   # blocked producers sleep here
    # The producers' lock-free path compares the queue length with two
    # thresholds, written only under the lock:
    #   _limit: before appending; max_queue, or 0 once stopped (-> _room_or_raise).
    #   _attention: after appending; min(_wake_at, high-water + 1), or 0 once
    #   stopped (-> _after_append: wake the thread, track the high-water mark).
    self._wake_at = _NEVER    # queue length at which a producer must wake the thread
    self._limit = max_queue
    self._attention = 1
    self._markers = 0         # flush markers in the queue (under the lock)
    self._blocked = 0         # producers waiting for room (under the lock)
    self._stop = False        # closing or failed: put refuses new items
    self._closing = False
    self._discard = False
    self._done = False        # the insert thread has exited (under the lock)
    self._joined = False
    self._error: Optional[BaseException] = None
    self._error_reported_by_close = False
    # Counters written by one thread each (the insert thread, or under the lock).
    self._inserted = self._batches = self._failed = self._discarded = self._rejected = 0
    self._inflight = 0        # items popped from the queue, not yet inserted
    self._cur: Optional[list] = None  # the batch being inserted (its markers, on failure)
    self._hw = 0
    self._blocked_puts = 0
    self._limiter_blocked = False  # the last insert attempt timed out on the rate limiter
    self._thread = threading.Thread(target=self._run, name=name, daemon=True)
    self._thread.start()

  # -- lifecycle ------------------------------------------------------------------------
  def close(self, timeout: Union[None, float, str] = "stall", *,
            discard_pending: bool = False) -> None:
    """Insert everything pending, stop the thread; idempotent.

    Args:
      timeout: how long to wait for the pending items. The default,
        ``"stall"``, waits as long as items keep going in and raises
        ``TimeoutError`` once none has for ``CLOSE_STALL_S`` (60) seconds: a
        rate limiter that blocks inserts (a ``SampleToInsertRatio`` after the
        learner stopped sampling) never hangs ``close`` silently. A number:
        seconds in all; None: forever. While it waits, ``close`` logs a
        warning (logger ``funcreplay.ingest``) every ``CLOSE_WARN_EVERY_S``
        (10) seconds naming the limiter and the pending count. On
        ``TimeoutError`` the ingestor keeps closing: call ``close`` again to
        keep waiting, or with ``discard_pending=True``.
      discard_pending: drop the items not yet inserted (counted in
        ``stats().discarded``) instead of waiting for them.

    Raises ``IngestorError`` (once) if the insert thread failed.
    """
    if timeout != "stall":
      timeout = validation.check_timeout(timeout)
    with self._lock:
      self._set_stopped()
      self._closing = True
      if discard_pending:
        self._discard = True
      self._wake_cv.notify_all()
      self._room_cv.notify_all()
    if not self._joined:
      self._wait_for_thread(timeout, CLOSE_STALL_S)
      self._joined = True
    if self._error is not None and not self._error_reported_by_close:
      self._error_reported_by_close = True
      raise self._wrapped_error("close")

  def _wait_for_thread(self, timeout: Union[None, float, str], stall_s: float) -> None:
    """Join the insert thread: warn every ``CLOSE_WARN_EVERY_S``; raise ``TimeoutError``
    after ``timeout`` seconds, or (``"stall"``) after ``stall_s`` without progress."""
    stall = timeout == "stall"
    t0 = last_progress = time.monotonic()
    done = self._inserted + self._discarded + self._failed
    next_warn = t0 + CLOSE_WARN_EVERY_S

    def deadline():
      if stall:
        return last_progress + stall_s
      return None if timeout is None else t0 + timeout

    while True:
      end = next_warn if deadline() is None else min(next_warn, deadline())
      self._thread.join(max(0.0, end - time.monotonic()))
      if not self._thread.is_alive():
        return
      now = time.monotonic()
      d = self._inserted + self._discarded + self._failed
      if d != done:  # items went in (or were dropped): not stalled
        done, last_progress = d, now
      if deadline() is not None and now >= deadline():
        how = (f"no item went in for {stall_s} s" if stall
               else f"timed out after {timeout} s")
        raise TimeoutError(
            f"Ingestor.close: {how} with {self.pending} items not yet inserted: the table's "
            f"rate limiter {self._limiter()} {self._blocking()} inserts (they go in as the "
            "table is sampled). Sample from the table and call close() again to keep "
            "waiting, close(timeout=None) to wait forever, or close(discard_pending=True) to "
            "drop them.")
      if now >= next_warn:
        LOG.warning("Ingestor.close: still waiting after %.0f s for %d pending items; the "
                    "table's rate limiter %s %s inserts. Sample from the table, or "
                    "close(discard_pending=True) to drop them.", now - t0, self.pending,
                    self._limiter(), self._blocking())
        next_warn = now + CLOSE_WARN_EVERY_S

  def _limiter(self) -> str:
    return validation.describe_limiter(self._spec)

  def _blocking(self) -> str:
    return "is blocking" if self._limiter_blocked else "may be blocking"

  def __enter__(self) -> "Ingestor":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()  # bounded: see close()
      return
    # The body failed: insert what was accepted while the table takes it, but
    # never hang the unwinding on a blocked table and never mask the body's
    # exception: once nothing has gone in for EXIT_STALL_S, the rest is
    # discarded and the propagating exception says how many items were dropped.
    try:
      try:
        with self._lock:
          self._set_stopped()
          self._closing = True
          self._wake_cv.notify_all()
        self._wait_for_thread("stall", EXIT_STALL_S)
      except TimeoutError:
        pass
      self.close(discard_pending=True)
    except Exception as e:  # noqa: BLE001 (attached to the propagating exception)
      if exc is not None and hasattr(exc, "add_note"):
        exc.add_note(f"(while closing the Ingestor: {type(e).__name__}: {e})")
    if self._discarded:
      msg = (f"the Ingestor discarded {self._discarded} accepted items on exit (the with "
             f"block raised {exc_type.__name__})")
      LOG.warning(msg)
      if exc is not None and hasattr(exc, "add_note"):
        exc.add_note(f"({msg})")

  @property
  def table(self):
    """The table this ingestor inserts into."""
    return self._table

  @property
  def closed(self) -> bool:
    return self._closing

  @property
  def pending(self) -> int:
    """Items accepted but not yet inserted (approximate while producers run)."""
    return max(0, len(self._q) - self._markers) + self._inflight

  def stats(self) -> IngestorStats:
    with self._lock:
      pending = self.pending
      return IngestorStats(
          accepted=self._inserted + pending + self._failed + self._discarded,
          inserted=self._inserted, pending=pending, batches=self._batches, failed=self._failed,
          discarded=self._discarded, rejected=self._rejected, queue_high_water=self._hw,
          blocked_puts=self._blocked_puts,
          error=None if self._error is None else repr(self._error))

  def __repr__(self) -> str:
    s = self.stats()
    state = "failed" if s.error else ("closed" if self._closing else "open")
    return (f"Ingestor({state}, batch_size={self._batch_size}, max_queue={self._max_queue}, "
            f"inserted={s.inserted}, pending={s.pending})")
