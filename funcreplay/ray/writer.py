"""``RemoteWriter``: a producer process's client of the replay actor.

A producer puts one item at a time; the actor wants large batches. The writer
validates each item locally (the ``Ingestor``'s checks and messages), keeps it in
a local batch, and ships the batch -- every leaf stacked into one ``[n, ...]``
numpy array, which Ray passes through its object store without pickling the
bytes -- when it holds ``batch_size`` items or its first item has waited
``max_wait_s`` (a background timer thread ships partial batches).

Guarantees:

* **Back-pressure:** at most ``max_in_flight`` shipped batches are unacknowledged;
  the next ship blocks ``put`` (``on_full="block"``, up to ``put_timeout``) or
  raises ``WriterFullError`` (``on_full="raise"``; the item is not accepted). The
  actor inserts with the table's rate limiter, so a limiter that forbids inserts
  stops the producers, as an ``Ingestor`` would.
* **Order:** a writer's batches go in in the order they were shipped (the actor
  has one insert thread).
* **Errors reach the producer:** a batch the actor refuses (its table closed, the
  actor died) fails the writer: the next ``put`` / ``flush`` and ``close`` raise
  ``WriterError`` chained to the cause; ``stats().failed`` counts the items.
* **What a dying producer loses:** only its unsent local batch (at most
  ``batch_size`` items, or ``max_wait_s`` worth); batches already shipped are in
  the actor's hands and go in without it.
* **No silent hang:** ``flush(timeout)``; ``close()`` raises ``TimeoutError``
  once no batch has been acknowledged for ``CLOSE_STALL_S`` seconds.

Items are not copied by ``put`` (``copy=False``) until they are stacked: a
producer that reuses its arrays must pass ``copy=True``.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Mapping, Optional, Union

import numpy as np

from funcreplay.host import validation
from funcreplay.host.itemcheck import ItemChecker
from funcreplay.host.rollout import columns as col_lib
from funcreplay.ray.calls import require_ray
from funcreplay.ray.errors import (
  WriterClosedError,
  WriterError,
  WriterFullError,
  WriterStats,
)
from funcreplay.ray.inflight import InFlightBatches

# close()'s default bound: give up once no shipped batch was acknowledged for this long
# (a healthy actor takes a batch in milliseconds; a blocked rate limiter is reported).
CLOSE_STALL_S = 60.0
# Leaving a with block on an exception: stop waiting once nothing moved for this long.
EXIT_STALL_S = 1.0


class RemoteWriter(InFlightBatches):
  """Batches items put by this process and ships them to the replay actor (module doc).

  Args:
    table: the ``funcreplay.ray.RemoteTable``.
    batch_size: items per shipped batch (capped at the capacity). Each ship is one
      actor call (~0.3 ms of Ray overhead), so larger batches pay off at high rates.
    max_wait_s: about how long a partial batch waits for more items (0: ship at once
      while an in-flight slot is free).
    max_in_flight: most unacknowledged batches (>= 1): the back-pressure bound.
    on_full: ``"block"`` or ``"raise"`` when ``max_in_flight`` batches are out.
    put_timeout: seconds a blocked ``put`` waits (None: forever) before ``TimeoutError``.
    copy: copy every leaf in ``put`` (for producers that reuse their arrays).

  Thread-safe (one lock). A context manager: leaving the block closes it. Feeds a
  ``funcreplay.SequenceWriter`` like an ``Ingestor`` does (``SequenceWriter(writer, L)``).
  """

  def __init__(self, table, *, batch_size: int = 1024, max_wait_s: float = 0.01,
               max_in_flight: int = 4, on_full: str = "block",
               put_timeout: Optional[float] = None, copy: bool = False):
    self._ray = require_ray()
    if not all(hasattr(table, a) for a in ("spec", "submit", "name")):
      raise TypeError(f"RemoteWriter expects a funcreplay.ray.RemoteTable, got "
                      f"{type(table).__name__}.")
    spec = table.spec
    self._batch_size = min(validation.check_int(batch_size, "RemoteWriter batch_size", 1, 2**30),
                           spec.capacity)
    self._max_in_flight = validation.check_int(max_in_flight, "RemoteWriter max_in_flight", 1,
                                               2**20)
    if on_full not in ("block", "raise"):
      raise ValueError(f"RemoteWriter: on_full must be 'block' or 'raise', got {on_full!r}.")
    self._raise_when_full = on_full == "raise"
    self._put_timeout = validation.check_timeout(put_timeout)
    if validation.check_timeout(max_wait_s) is None:
      raise ValueError(f"RemoteWriter: max_wait_s must be a finite number of seconds >= 0, "
                       f"got {max_wait_s!r}.")
    self._max_wait = float(max_wait_s)
    self._copy = bool(copy)
    self._table = table
    self._spec = spec
    self._sig = spec.signature
    self._n_leaves = len(self._sig.leaves)
    self._columns = spec.columns  # fr.Column each: entries carry stored words
    self._checker = ItemChecker(self._sig, "RemoteWriter.put")
    self._fast = self._checker.fast
    self._lock = threading.Lock()
    self._buf: list = []
    self._first_t = 0.0
    self._inflight: collections.deque = collections.deque()  # (ObjectRef, n items)
    self._stop = False
    self._closed = False
    self._error: Optional[BaseException] = None
    self._error_reported = False
    self._accepted = self._inserted = self._batches = self._failed = 0
    self._discarded = self._rejected = self._blocked_puts = 0
    self._wake = threading.Event()
    self._timer = threading.Thread(target=self._run_timer, name="funcreplay-remote-writer",
                                   daemon=True)
    self._timer.start()

  # -- producer API -----------------------------------------------------------------------
  @property
  def table(self):
    """The ``RemoteTable`` this writer ships to (``SequenceWriter`` reads its spec)."""
    return self._table

  def put(self, item: Any, *, version: Optional[int] = None, priority: Optional[float] = None,
          metadata: Optional[Mapping[str, int]] = None) -> None:
    """Accept one item (no batch axis); the ``Ingestor.put`` checks, in this process.

    Raises ``ValueError`` / ``TypeError`` for a bad item (nothing accepted),
    ``WriterFullError`` / ``TimeoutError`` when ``max_in_flight`` batches are out,
    ``WriterError`` if a shipped batch failed, ``WriterClosedError`` after ``close``.
    """
    leaves = self._fast(item)
    if leaves is None:
      leaves = self._checker.slow(item)
    if self._copy:
      leaves = tuple(map(np.array, leaves))
    if version is not None or priority is not None or metadata is not None:
      leaves += col_lib.check_item_extras(version, priority, metadata, self._columns,
                                          "RemoteWriter.put")
    with self._lock:
      self._append([leaves], "put")

  def put_batch(self, items: Any, *, version=None, priority=None,
                metadata: Optional[Mapping[str, Any]] = None) -> None:
    """Accept ``B`` items given with a leading ``[B]`` axis (``Ingestor.put_batch``'s form).
    On ``TimeoutError`` / ``WriterFullError`` the error's ``accepted`` attribute says how many
    leading rows were accepted."""
    leaves, b = self._checker.batch(items, "RemoteWriter.put_batch")
    if b == 0:
      raise ValueError("RemoteWriter.put_batch: empty batch (B = 0); pass at least one item.")
    rows = list(zip(*((np.array(x) for x in leaves) if self._copy else leaves), strict=True))
    if version is not None or priority is not None or metadata is not None:
      vers = [None] * b if version is None else \
          validation.int_rows(version, b, "RemoteWriter.put_batch version").tolist()
      prios = [None] * b if priority is None else validation.priority_rows(
          priority, b, "RemoteWriter.put_batch priority").tolist()
      metas = [None] * b
      if metadata is not None:
        vals = col_lib.batch_words(self._columns, metadata, b, "RemoteWriter.put_batch")
        metas = [{k: vals[k][i] for k in vals} for i in range(b)]
      rows = [r + x for r, x in zip(rows, zip(vers, prios, metas, strict=True), strict=True)]
    with self._lock:
      done = 0
      try:
        while done < b:
          chunk = rows[done:done + self._batch_size]
          self._append(chunk, "put_batch")
          done += len(chunk)
      except (TimeoutError, WriterFullError) as e:
        e.accepted = done
        raise

  def flush(self, timeout: Optional[float] = None) -> None:
    """Ship the local batch and wait until every item accepted so far is acknowledged.

    Raises ``TimeoutError`` after ``timeout`` seconds (the items stay in flight),
    ``WriterError`` if a batch failed.
    """
    timeout = validation.check_timeout(timeout)
    deadline = None if timeout is None else time.monotonic() + timeout
    self._hold(deadline, "flush")
    try:
      self._raise_if_failed("flush")
      self._ship(True, "flush", deadline)
      while self._inflight:
        self._wait_some(deadline, "flush")
      self._raise_if_failed("flush")
    finally:
      self._lock.release()

  def close(self, timeout: Union[None, float, str] = "stall", *,
            discard_pending: bool = False) -> None:
    """Ship what is buffered, wait for every in-flight batch, stop the timer; idempotent.

    ``timeout``: ``"stall"`` (default) raises ``TimeoutError`` once no batch was
    acknowledged for ``CLOSE_STALL_S`` seconds (the rate limiter blocks inserts: sample
    from the table, then call ``close`` again); a number: seconds in all; None: forever.
    ``discard_pending``: drop the local batch (counted in ``stats().discarded``) instead of
    shipping it. Raises ``WriterError`` (once) if a batch failed.
    """
    if timeout != "stall":
      timeout = validation.check_timeout(timeout)
    limit = CLOSE_STALL_S if timeout == "stall" else timeout
    self._stop_timer()
    self._hold(None if limit is None else time.monotonic() + limit, "close")
    try:
      if discard_pending:
        self._discarded += len(self._buf)
        self._buf = []
      if self._error is None:
        try:
          self._drain(timeout, CLOSE_STALL_S, "close")
        except WriterError:
          pass  # self._error is set: reported (once) below
      self._closed = True
      unsent = 0
      if self._error is not None and self._buf:  # never shipped (the writer failed): dropped
        unsent = len(self._buf)
        self._discarded += unsent
        self._buf = []
      if self._error is not None and not self._error_reported:
        self._error_reported = True
        raise self._wrapped("close", unsent)
    finally:
      self._lock.release()

  def _stop_timer(self) -> None:
    """Stop the timer thread (which never waits on the lock for more than a tick)."""
    self._stop = True
    self._wake.set()
    self._timer.join()

  def _hold(self, deadline: Optional[float], what: str) -> None:
    """Take the writer's lock by ``deadline`` (monotonic; None: whenever): another
    thread's ``put`` holds it while the table's back-pressure blocks it (``flush`` and
    ``close`` waited for that without a bound, whatever their timeout)."""
    if deadline is None:
      self._lock.acquire()
      return
    if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
      raise TimeoutError(
          f"RemoteWriter.{what}: another thread's put holds the writer, waiting for room: the "
          f"replay actor {self._table.name!r} is not keeping up or its rate limiter "
          f"{validation.describe_limiter(self._spec)} blocks inserts. Sample from the table "
          "(or give the producers put_timeout=), then call again.")

  def __enter__(self) -> "RemoteWriter":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
      return
    # The body failed: ship what the actor takes, never hang the unwinding on a blocked
    # table and never mask the body's exception.
    try:
      try:
        self._stop_timer()
        self._hold(time.monotonic() + EXIT_STALL_S, "close")
        try:
          if self._error is None:
            self._drain("stall", EXIT_STALL_S, "close")
        finally:
          self._lock.release()
      except TimeoutError:
        pass
      self.close(discard_pending=True, timeout=EXIT_STALL_S)
    except Exception as e:  # noqa: BLE001 (attached to the propagating exception)
      if exc is not None and hasattr(exc, "add_note"):
        exc.add_note(f"(while closing the RemoteWriter: {type(e).__name__}: {e})")
    if self._discarded and exc is not None and hasattr(exc, "add_note"):
      exc.add_note(f"(the RemoteWriter discarded {self._discarded} unsent items on exit)")

  def stats(self) -> WriterStats:
    """The counters, read without the lock (a ``put`` blocked on back-pressure holds it), so
    exact only while the writer is idle."""
    in_flight = sum(n for _, n in list(self._inflight))  # list(): one atomic copy
    return WriterStats(accepted=self._accepted, inserted=self._inserted,
                       buffered=len(self._buf), in_flight=in_flight, batches=self._batches,
                       failed=self._failed, discarded=self._discarded,
                       rejected=self._rejected, blocked_puts=self._blocked_puts,
                       error=None if self._error is None else repr(self._error))

  @property
  def pending(self) -> int:
    """Items accepted and not yet acknowledged (buffered + in flight)."""
    s = self.stats()
    return s.buffered + s.in_flight

  def __repr__(self) -> str:
    s = self.stats()
    state = "failed" if s.error else ("closed" if self._stop else "open")
    return (f"RemoteWriter({state}, {self._table.name!r}, batch_size={self._batch_size}, "
            f"inserted={s.inserted}, buffered={s.buffered}, in_flight={s.in_flight})")

  # -- internals (lock held) --------------------------------------------------------------
  def _append(self, rows: list, what: str) -> None:
    if self._stop or self._error is not None:
      self._rejected += len(rows)
      if self._error is not None:
        raise self._wrapped(what)
      raise WriterClosedError(f"RemoteWriter.{what}: the writer is closed.")
    if len(self._buf) + len(rows) > self._batch_size:
      self._ship(not self._raise_when_full, what, self._deadline(), strict=True)
    if not self._buf:
      self._first_t = time.monotonic()
    self._buf.extend(rows)
    self._accepted += len(rows)
    if len(self._buf) >= self._batch_size or self._max_wait == 0.0:
      self._ship(False, what, None)

  def _deadline(self) -> Optional[float]:
    return None if self._put_timeout is None else time.monotonic() + self._put_timeout

  def _run_timer(self) -> None:
    """Ships partial batches older than ``max_wait_s`` and collects acknowledgements."""
    tick = max(self._max_wait, 0.001)
    while not self._stop:
      # Never blocked on the lock for long: a put may hold it while back-pressure blocks it,
      # and close() waits for this thread.
      if not self._lock.acquire(timeout=tick):
        continue
      try:
        if self._stop:
          return
        try:
          if self._buf and time.monotonic() - self._first_t >= self._max_wait:
            self._ship(False, "put", None)
          elif self._inflight:
            self._reap(0.0)
        except Exception:  # noqa: BLE001 (recorded in self._error; the producer sees it)
          pass
        age = time.monotonic() - self._first_t if self._buf else 0.0
      finally:
        self._lock.release()
      self._wake.wait(max(0.001, min(tick, tick - age)) if self._buf else tick)
