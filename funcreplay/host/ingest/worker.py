"""The insert thread of an ``Ingestor``: sleeps until a batch is due, inserts, handles failure.

``InsertWorker`` is a mixin of ``Ingestor`` (``ingestor.py``): ``_run`` is the
thread's target; it takes up to ``batch_size`` queued entries at a time and
hands them to the batcher (``batcher.py``), releases flush markers, and on a
failure drains the queue and records the error for the producers.
"""

from __future__ import annotations

import time
from typing import Optional

from funcreplay.host.ingest.errors import IngestorError
from funcreplay.host.ingest.queue import NEVER as _NEVER
from funcreplay.host.ingest.queue import Discarding as _Discarding
from funcreplay.host.ingest.queue import Marker as _Marker


class InsertWorker:
  """The insert thread's loop (mixin of ``Ingestor``)."""

  def _wrapped_error(self, what: str) -> IngestorError:
    e = self._error
    err = IngestorError(
        f"Ingestor.{what}: the insert thread failed ({type(e).__name__}: {e}); "
        f"{self._inserted} items were inserted, {self._failed} accepted items were not. "
        "Create a new Ingestor after fixing the cause.")
    err.__cause__ = e
    return err

  # -- the insert thread ----------------------------------------------------------------
  def _run(self) -> None:
    try:
      self._loop()
    except BaseException as e:  # noqa: BLE001 (reported to producers and close())
      with self._lock:
        self._error = e
        self._set_stopped()
        self._failed += self._inflight
        self._inflight = 0
        self._room_cv.notify_all()
      self._release_markers(self._cur)
      self._drain_after_failure()

  def _sleep(self, wake_at: int, timeout: Optional[float]) -> None:
    with self._lock:
      if self._closing or self._markers:
        return
      self._set_wake_at(wake_at)
      if len(self._q) < wake_at:
        self._wake_cv.wait(timeout)
      self._set_wake_at(_NEVER)

  def _loop(self) -> None:
    q, pop, bsz = self._q, self._q.popleft, self._batch_size
    t_first = None
    since_sync = 0
    while True:
      if self._discard:
        self._drop_queued(failed=False)
      n = len(q)
      if n == 0:
        with self._lock:
          if self._closing and not self._q:
            self._done = True
            return
        t_first = None
        self._sleep(1, None)
        continue
      if n < bsz and self._max_wait > 0 and not self._markers and not self._closing:
        now = time.monotonic()
        if t_first is None:
          t_first = now
        if now - t_first < self._max_wait:
          self._sleep(bsz, t_first + self._max_wait - now)
          continue
      t_first = None
      batch = [pop() for _ in range(min(n, bsz))]
      try:
        self._process(batch)
      except _Discarding:
        with self._lock:
          self._discarded += self._inflight
          self._inflight = 0
        self._release_markers(self._cur, dropped=True)
      self._cur = None
      since_sync += 1
      if self._sync_every and since_sync >= self._sync_every:
        # Inserts are dispatched asynchronously; waiting for the device now and
        # then bounds the memory held by queued device work.
        since_sync = 0
        len(self._table)

  def _process(self, batch: list) -> None:
    """Insert the items of ``batch`` in order; release its flush markers as they come."""
    self._cur = batch
    markers = []
    if self._markers:
      markers = [i for i, e in enumerate(batch) if e.__class__ is _Marker]
    self._inflight = len(batch) - len(markers)
    if self._blocked:
      with self._lock:
        self._room_cv.notify_all()
    start = 0
    for i in markers + [len(batch)]:
      if i > start:
        self._insert_entries(batch[start:i])
      if i < len(batch):
        self._release_markers((batch[i],))
      start = i + 1

  def _release_markers(self, entries, dropped: bool = False) -> None:
    """Wake the flushes waiting on the markers among ``entries``; ``dropped``: their items
    were discarded, not inserted (the flush raises)."""
    with self._lock:
      for e in entries or ():
        if e.__class__ is _Marker and not e.event.is_set():
          self._markers -= 1
          e.dropped = dropped
          e.event.set()

  def _drop_queued(self, failed: bool) -> None:
    """Pop everything queued; count the items as failed (or discarded); release markers."""
    entries = []
    while True:
      try:
        entries.append(self._q.popleft())
      except IndexError:
        break
    n = sum(1 for e in entries if e.__class__ is not _Marker)
    with self._lock:
      if failed:
        self._failed += n
      else:
        self._discarded += n
      self._room_cv.notify_all()
    self._release_markers(entries, dropped=not failed)

  def _drain_after_failure(self) -> None:
    """After a failure: count whatever racing producers still append, until close()."""
    while True:
      self._drop_queued(failed=True)
      with self._lock:
        if self._closing and not self._q:
          self._done = True
          return
        if not self._q:
          self._set_wake_at(1)
          self._wake_cv.wait()
          self._set_wake_at(_NEVER)
