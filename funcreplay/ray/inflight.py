"""The shipped side of a ``RemoteWriter``: in-flight batches, acknowledgements, errors.

``InFlightBatches`` is a mixin of ``RemoteWriter`` (``writer.py``), which creates
the state it uses; every method runs with the writer's lock held.
"""

from __future__ import annotations

import collections
import time
from typing import Optional

from funcreplay.host import validation
from funcreplay.ray import batching
from funcreplay.ray.calls import wait_reply
from funcreplay.ray.errors import TableUnavailableError, WriterError, WriterFullError


class InFlightBatches:
  """Shipping the local batch, bounding and collecting the unacknowledged ones."""

  def _ship(self, block: bool, what: str, deadline: Optional[float], strict: bool = False) -> bool:
    """Send the local batch if an in-flight slot is free (waiting for one if ``block``).
    ``strict``: no slot and not blocking raises ``WriterFullError``. True if shipped."""
    if not self._buf:
      return True
    self._reap(0.0)
    if len(self._inflight) >= self._max_in_flight:
      if not block:
        if strict:
          raise WriterFullError(
              f"RemoteWriter.{what}: {self._max_in_flight} batches are in flight and the local "
              f"batch is full ({len(self._buf)} items): the replay actor {self._table.name!r} "
              f"is not keeping up or its rate limiter "
              f"{validation.describe_limiter(self._spec)} blocks inserts.")
        return False
      self._blocked_puts += 1
      while len(self._inflight) >= self._max_in_flight:
        self._wait_some(deadline, what)
    self._raise_if_failed(what)
    entries, self._buf = self._buf, []
    batch = batching.stack_entries(entries, self._sig, self._columns)
    try:
      ref = self._table.submit("insert_batch", *batch)
    except TableUnavailableError as e:  # a closed handle or a dead actor: counted, not lost
      self._failed += len(entries)
      self._error = self._error or e
      raise self._wrapped(what) from e
    self._inflight.append((ref, len(entries)))
    return True

  def _reap(self, timeout: float) -> int:
    """Collect acknowledged batches (waiting up to ``timeout`` for one); returns how many."""
    if not self._inflight:
      return 0
    refs = [r for r, _ in self._inflight]
    ready, _ = self._ray.wait(refs, num_returns=1 if timeout else len(refs), timeout=timeout)
    if timeout and ready:  # more may be done: take them all
      ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
    done = set(ready)
    keep = collections.deque()
    for ref, n in self._inflight:
      if ref not in done:
        keep.append((ref, n))
        continue
      try:
        wait_reply(ref, None, "RemoteWriter", self._table.name)
        self._inserted += n
        self._batches += 1
      except BaseException as e:  # noqa: BLE001 (the writer fails; put / flush / close raise)
        k = min(n, int(getattr(e, "inserted", 0) or 0))
        self._inserted += k
        self._failed += n - k
        if self._error is None:
          self._error = e
    self._inflight = keep
    return len(done)

  def _wait_some(self, deadline: Optional[float], what: str) -> None:
    """Wait for an in-flight batch to be acknowledged, or raise ``TimeoutError``."""
    left = None if deadline is None else deadline - time.monotonic()
    if left is not None and left <= 0:
      n = sum(k for _, k in self._inflight)
      raise TimeoutError(
          f"RemoteWriter.{what}: {len(self._inflight)} batches ({n} items) were not acknowledged "
          f"in time by the replay actor {self._table.name!r}: its rate limiter "
          f"{validation.describe_limiter(self._spec)} may be blocking inserts (they go in as the "
          "table is sampled), or the actor is overloaded. The items stay in flight.")
    self._reap(1.0 if left is None else min(left, 1.0))
    self._raise_if_failed(what)

  def _drain(self, timeout, stall_s: float, what: str) -> None:
    """Ship everything and wait for the acknowledgements (``close``'s bound, see there)."""
    stall = timeout == "stall"
    t0 = last = time.monotonic()
    acked = self._inserted + self._failed
    while self._buf or self._inflight:
      end = (last + stall_s) if stall else (None if timeout is None else t0 + timeout)
      if self._buf:
        self._ship(True, what, end)
      if self._inflight:
        self._wait_some(end, what)
      if self._inserted + self._failed != acked:
        acked, last = self._inserted + self._failed, time.monotonic()
      if self._error is not None:
        return

  def _raise_if_failed(self, what: str) -> None:
    if self._error is not None:
      raise self._wrapped(what)

  def _wrapped(self, what: str, unsent: int = 0) -> WriterError:
    """The ``WriterError`` of ``self._error``; ``unsent``: accepted items that ``close``
    dropped without shipping them (the writer had failed; ``stats().discarded``)."""
    e = self._error
    gone = isinstance(e, TableUnavailableError)
    dropped = f", and {unsent} accepted items never shipped were dropped" if unsent else ""
    err = WriterError(f"RemoteWriter.{what}: a batch shipped to the replay actor "
                      f"{self._table.name!r} failed ({type(e).__name__}: {e}); "
                      f"{self._failed} shipped items were not inserted{dropped}. "
                      + ("The actor is gone: connect again and make a new writer."
                         if gone else "Make a new writer once the cause is fixed."))
    err.__cause__ = e
    return err

