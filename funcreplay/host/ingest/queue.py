"""The producer side of an ``Ingestor``: the queue that ``put`` / ``put_batch`` / ``flush`` feed.

Producers append to a deque without the lock on the fast path and compare
its length with two thresholds written under the lock (``_limit``,
``_attention``); the slow paths (a full queue, waking the insert thread, a
stopped ingestor) take the lock. ``ProducerQueue`` is a mixin of
``Ingestor`` (``ingestor.py``), which creates the state it uses.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Mapping, Optional

import numpy as np

from funcreplay.host import validation
from funcreplay.host.ingest.errors import IngestorClosedError, IngestorFullError
from funcreplay.host.rollout import columns as col_lib

NEVER = 1 << 62  # "no producer needs to wake the insert thread"


class Marker:
  """A flush request travelling through the queue (FIFO: everything before it is done)."""

  __slots__ = ("event", "dropped")

  def __init__(self):
    self.event = threading.Event()
    self.dropped = False  # released by close(discard_pending=True), not by the inserts


class Discarding(Exception):
  """close(discard_pending=True) while an insert waits on the rate limiter."""


# The bodies below predate the split (names kept as they were).
_NEVER, _Marker, _Discarding = NEVER, Marker, Discarding


class ProducerQueue:
  """``put``, ``put_batch``, ``flush`` and the queue thresholds (mixin of ``Ingestor``)."""

  # -- producers ----------------------------------------------------------------------
  def put(self, item: Any, *, version: Optional[int] = None, priority: Optional[float] = None,
          metadata: Optional[Mapping[str, Any]] = None) -> None:
    """Queue one item (no batch axis) for insertion.

    Args:
      item: a pytree matching the table's signature, each leaf exactly the
        signature's shape and dtype (numpy / JAX arrays, numpy scalars;
        Python scalars are converted only when lossless: ``1.5`` or ``True``
        for an int32 leaf is a ``TypeError``, as in ``Table.insert``).
      version: policy version (int32; default: the table's version when the
        item is inserted).
      priority: finite float >= 0 (default: the table's default priority).
      metadata: dict column -> value over the spec's metadata columns (an int, a
        string of a vocabulary column, a float of a float32 column: encoded here, with
        ``Table.insert``'s checks and errors).

    Raises:
      ValueError / TypeError for a bad item (nothing queued);
      IngestorFullError / TimeoutError when the queue is full;
      IngestorError if the insert thread failed; IngestorClosedError after close.
    """
    # The common path is ~0.5 us of CPU: a generated structure/shape/dtype
    # check, one deque append (atomic under the GIL), two integer comparisons.
    leaves = self._fast(item)
    if leaves is None:
      leaves = self._checker.slow(item)
    if self._copy:
      leaves = tuple(map(np.array, leaves))
    if version is not None or priority is not None or metadata is not None:
      # A queue entry is the tuple of leaves, followed by the extras only when
      # there are any (one small tuple less per put in the common case).
      leaves += self._check_extras(version, priority, metadata)
    q = self._q
    if len(q) >= self._limit:
      self._room_or_raise(1, "put")
    q.append(leaves)
    if len(q) >= self._attention:
      self._after_append("put")

  def put_batch(self, items: Any, *, version=None, priority=None,
                metadata: Optional[Mapping[str, Any]] = None) -> None:
    """Queue ``B`` items given with a leading ``[B]`` axis (in row order).

    ``version`` / ``priority``: scalar or ``[B]``; ``metadata``: column ->
    a value or ``[B]`` values (as in ``Table.insert``). A batch larger than
    ``max_queue`` is queued in chunks (blocking between them); on ``TimeoutError``
    the error's ``accepted`` attribute says how many leading rows were queued.
    """
    if self._stop:
      self._raise_stopped("put_batch")
    leaves, b = self._checker.batch(items, "Ingestor.put_batch")
    if b == 0:
      raise ValueError("Ingestor.put_batch: empty batch (B = 0); pass at least one item.")
    vers = [None] * b if version is None else \
        validation.int_rows(version, b, "Ingestor.put_batch version").tolist()
    prios = [None] * b if priority is None else validation.priority_rows(
        priority, b, "Ingestor.put_batch priority").tolist()
    metas = [None] * b
    extras = version is not None or priority is not None or metadata is not None
    if metadata is not None:
      rows = col_lib.batch_words(self._columns, metadata, b, "Ingestor.put_batch")
      metas = [{k: rows[k][i] for k in rows} for i in range(b)]
    if self._copy:
      leaves = tuple(np.array(x) for x in leaves)
    entries = list(zip(*leaves, strict=True))
    if extras:
      entries = [e + x for e, x in zip(entries, zip(vers, prios, metas, strict=True),
                                       strict=True)]
    q = self._q
    done = 0
    while done < b:
      room = self._limit - len(q)
      if room <= 0:
        try:
          self._room_or_raise(min(b - done, self._max_queue), "put_batch")
        except (TimeoutError, IngestorFullError) as e:
          e.accepted = done
          raise
        continue
      chunk = entries[done:done + room]
      q.extend(chunk)
      done += len(chunk)
      if len(q) >= self._attention:
        self._after_append("put_batch")

  def flush(self, timeout: Optional[float] = None) -> None:
    """Wait until every item accepted before this call is in the table.

    Raises ``TimeoutError`` after ``timeout`` seconds (the items stay queued),
    ``IngestorError`` if the insert thread failed, ``IngestorClosedError`` if
    ``close(discard_pending=True)`` discarded items instead of inserting them.
    """
    timeout = validation.check_timeout(timeout)
    if self._error is not None:
      raise self._wrapped_error("flush")
    marker = _Marker()
    with self._lock:
      if self._done:
        if self._error is not None:
          raise self._wrapped_error("flush")
        if self._discarded:
          raise self._discarded_error()
        return  # closed: everything accepted has been inserted already
      self._markers += 1
      self._q.append(marker)
      self._wake_cv.notify()
    if not marker.event.wait(timeout):
      raise TimeoutError(f"Ingestor.flush timed out after {timeout} s with {self.pending} items "
                         "still pending (is the table's rate limiter blocking inserts?).")
    if self._error is not None:
      raise self._wrapped_error("flush")
    if marker.dropped:
      raise self._discarded_error()

  def _discarded_error(self) -> IngestorClosedError:
    return IngestorClosedError(
        f"Ingestor.flush: the ingestor was closed with discard_pending=True; "
        f"{self._discarded} accepted items were discarded, not inserted.")

  # -- producer helpers -------------------------------------------------------------------
  def _check_extras(self, version, priority, metadata):
    return col_lib.check_item_extras(version, priority, metadata, self._columns,
                                     "Ingestor.put")

  def _set_stopped(self) -> None:
    """Send every producer to the slow paths (lock held)."""
    self._stop = True
    self._limit = 0
    self._attention = 0

  def _set_wake_at(self, wake_at: int) -> None:
    """Lock held. Written *before* the thread re-checks the queue length, so a
    producer appending concurrently either is seen by that check or sees the
    new threshold (every step is atomic under the GIL)."""
    self._wake_at = wake_at
    if not self._stop:
      self._attention = min(wake_at, self._hw + 1)

  def _after_append(self, what: str) -> None:
    """The queue reached ``_attention``: wake the thread, raise the high-water mark."""
    with self._lock:
      n = len(self._q)
      if n > self._hw:
        self._hw = n
      if n >= self._wake_at:
        self._wake_cv.notify()
      if not self._stop:
        self._attention = min(self._wake_at, self._hw + 1)
        return
    self._after_stop_append(what)  # raced with close / failure

  def _room_or_raise(self, k: int, what: str) -> None:
    """Stopped -> raise; else block until ``k`` items fit (or raise if on_full='raise')."""
    if self._stop:
      self._raise_stopped(what)
    if len(self._q) + k <= self._max_queue:
      return
    if self._raise_when_full:
      raise IngestorFullError(
          f"Ingestor.{what}: the queue is full ({len(self._q)} >= max_queue={self._max_queue}); "
          "the table is not keeping up (or its rate limiter blocks inserts). Retry later, or "
          "use on_full='block'.")
    deadline = None if self._put_timeout is None else time.monotonic() + self._put_timeout
    with self._lock:
      self._blocked += 1
      self._blocked_puts += 1
      try:
        while len(self._q) + k > self._max_queue:
          if self._stop:
            break
          remaining = None if deadline is None else deadline - time.monotonic()
          if remaining is not None and remaining <= 0:
            raise TimeoutError(
                f"Ingestor.{what} timed out after {self._put_timeout} s waiting for room in the "
                f"queue (max_queue={self._max_queue}); the table is not keeping up or its rate "
                "limiter blocks inserts.")
          self._room_cv.wait(remaining)
      finally:
        self._blocked -= 1
    if self._stop:
      self._raise_stopped(what)

  def _raise_stopped(self, what: str):
    if self._error is not None:
      raise self._wrapped_error(what)
    raise IngestorClosedError(f"Ingestor.{what}: the ingestor is closed; create a new one "
                              "(table.ingestor()).")

  def _after_stop_append(self, what: str) -> None:
    """An item was appended while the ingestor stopped: refuse it if nobody will drain it."""
    with self._lock:
      if not self._done:
        return  # the insert thread is still running and will process (or count) it
      stranded = 0
      while self._q:
        stranded += self._q.popleft().__class__ is not _Marker
      self._rejected += stranded
    self._raise_stopped(what)
