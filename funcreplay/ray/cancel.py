"""Cancellable sample calls of the replay actor: what a closed ``Prefetcher`` leaves queued.

A ``Prefetcher`` keeps ``prefetch`` sample calls in flight; ``close()`` cannot take back a
Ray actor call that waits for items (queued behind the actor's other calls, or blocked on
the rate limiter). Left alone, such a call took the next items inserted, for nobody: with
``max_times_sampled=1`` they were used up and lost, and the call held one of the actor's
sample threads until its timeout (found by a review). So its calls carry a ``tag``;
``close()`` cancels the tag, and a call of a cancelled tag samples nothing and returns
None (no error: nobody reads it, and Ray reports errors nobody read).

Exactness: a tagged call tries the table without waiting (``timeout=0``) under this
object's lock, which ``cancel`` takes too, so no attempt starts after ``cancel`` returned.
Between attempts it waits on a condition that ``cancel`` and the actor's own inserts
notify, and polls every ``POLL_S`` (priority updates, version changes and colocated code
may make a sample possible without a notification here).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Optional

from funcreplay.host import validation

# Seconds between two attempts of a waiting tagged call that nothing notified.
POLL_S = 0.05
# Cancelled tags remembered (one per closed Prefetcher; oldest forgotten first).
MAX_TAGS = 4096


class Cancellations:
  """The cancelled tags of one replay actor, and the wait of its tagged sample calls."""

  def __init__(self):
    self._cond = threading.Condition()
    self._tags: collections.OrderedDict = collections.OrderedDict()

  def cancel(self, tag: str) -> None:
    """Calls of ``tag`` sample nothing from now on; those waiting end."""
    with self._cond:
      self._tags[tag] = None
      while len(self._tags) > MAX_TAGS:
        self._tags.popitem(last=False)
      self._cond.notify_all()

  def wake(self) -> None:
    """Something may allow a sample now (an insert): waiting calls try again."""
    with self._cond:
      self._cond.notify_all()

  def run(self, tag: str, attempt: Callable[[float], object], timeout: Optional[float]):
    """``attempt(0.0)`` (a table sample that does not wait) until it returns, the tag is
    cancelled (None: nothing sampled) or ``timeout`` seconds pass (the table's
    ``TimeoutError``, naming ``timeout``)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while True:
        if tag in self._tags:
          return None
        try:
          return attempt(0.0)
        except TimeoutError as e:
          left = None if deadline is None else deadline - time.monotonic()
          if left is not None and left <= 0:
            raise validation.retimed(e, timeout) from None
        self._cond.wait(POLL_S if left is None else min(POLL_S, left))
