"""``Prefetcher``: a learner's iterator keeping ``k`` remote samples in flight.

A remote sample costs a round trip (Ray call, the actor's sample, the reply through
the object store); a learner that asks for the next batch only when it needs it
waits that long every step. ``Prefetcher`` keeps ``prefetch`` sample calls
submitted ahead, so the next batch is usually already in this process (MineStudio's
loader pool, without its worker processes: the actor samples, Ray moves the bytes).

The batches are sampled when the actor runs the calls, i.e. up to ``prefetch``
steps before they are used: with ``version_fn`` each call carries the version
current when it was *submitted* (their staleness is judged then). Batches in
flight when the iterator is closed were sampled and are dropped (they count as
samples in the table's counters, like a learner killed mid-step).
"""

from __future__ import annotations

import collections
import uuid
from typing import Callable, Optional

from funcreplay.host import validation
from funcreplay.ray.calls import RPC_SLACK_S, as_sample, wait_reply
from funcreplay.ray.errors import TableUnavailableError


class Prefetcher:
  """Iterate remote samples of ``batch_size``, keeping ``prefetch`` calls in flight.

  Args:
    table: a ``funcreplay.ray.RemoteTable``.
    batch_size: rows per batch.
    prefetch: sample calls kept in flight (>= 1); the actor serves up to 8 at once.
    timeout: each sample's timeout (the table waits that long for items / the rate
      limiter; None: forever), plus ``RPC_SLACK_S`` for the reply.
    version_fn: ``() -> int`` giving each call's version (None: the table's).
    where: ``where`` of every sample.
    packed: yield the ``PackedSample`` as it arrived (one numpy buffer) instead of a
      ``Sample`` of numpy views of it.
    max_batches: stop after this many batches (None: never).

  Each item is a ``Sample`` of read-only numpy arrays. ``close()`` (or leaving a
  ``with`` block) stops it; a failed call raises in ``next`` and closes it.
  """

  def __init__(self, table, batch_size: int, *, prefetch: int = 2,
               timeout: Optional[float] = 60.0, version_fn: Optional[Callable[[], int]] = None,
               where=None, packed: bool = False, max_batches: Optional[int] = None):
    if not hasattr(table, "sample_async"):
      raise TypeError(f"Prefetcher expects a funcreplay.ray.RemoteTable, got "
                      f"{type(table).__name__}.")
    self._table = table
    self._batch_size = validation.check_int(batch_size, "Prefetcher batch_size", 1, 2**31 - 1)
    self._k = validation.check_int(prefetch, "Prefetcher prefetch", 1, 1024)
    self._timeout = validation.check_timeout(timeout)
    if version_fn is not None and not callable(version_fn):
      raise TypeError("Prefetcher: version_fn must be a callable returning the version.")
    self._version_fn = version_fn
    self._where = where
    self._packed = bool(packed)
    self._left = None if max_batches is None else validation.check_int(
        max_batches, "Prefetcher max_batches", 0, 2**62)
    self._inflight: collections.deque = collections.deque()
    self._closed = False
    # This iterator's calls, cancelled by close() (those not sampled yet take nothing).
    self._tag = uuid.uuid4().hex
    self.batches = 0

  def _submit(self) -> None:
    version = None if self._version_fn is None else self._version_fn()
    # No caller deadline: a prefetched call may wait in the actor's queue behind the
    # others; its own timeout starts when it runs.
    self._inflight.append(self._table.sample_async(
        self._batch_size, version=version, where=self._where, timeout=self._timeout,
        deadline=False, tag=self._tag))

  def __iter__(self) -> "Prefetcher":
    return self

  def __next__(self):
    if self._closed or self._left == 0:
      self.close()
      raise StopIteration
    want = self._k if self._left is None else min(self._k, self._left)
    while len(self._inflight) < want:
      self._submit()
    ref = self._inflight.popleft()
    wait = None if self._timeout is None else self._timeout * (self._k + 1) + RPC_SLACK_S
    try:
      result = wait_reply(ref, wait, "Prefetcher", self._table.name)
    except BaseException:
      self.close()
      raise
    if result is None:  # cancelled: another thread closed this iterator meanwhile
      raise StopIteration
    self.batches += 1
    if self._left is not None:
      self._left -= 1
    return result if self._packed else as_sample(result)

  def close(self) -> None:
    """Stop prefetching: calls in flight that have not sampled yet are cancelled (they
    take nothing; they took the next items inserted, for nobody), those that have are
    dropped with their batches. Idempotent."""
    if self._closed:
      return
    self._closed = True
    if self._inflight:
      try:
        self._table.cancel(self._tag)
      except (TableUnavailableError, TimeoutError):
        pass  # the actor is gone (its calls with it) or stuck: nothing more to do here
    self._inflight.clear()

  def __enter__(self) -> "Prefetcher":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
