"""The errors an ``Ingestor`` raises and its ``IngestorStats``."""

from __future__ import annotations

import dataclasses
from typing import Optional


class IngestorError(RuntimeError):
  """The insert thread failed; ``__cause__`` holds the original exception."""


class IngestorClosedError(RuntimeError):
  """``put`` / ``put_batch`` / ``flush`` on a closed (or closing) ``Ingestor``."""


class IngestorFullError(RuntimeError):
  """``put`` on a full queue with ``on_full="raise"``."""


@dataclasses.dataclass(frozen=True)
class IngestorStats:
  """Counters of an ``Ingestor`` (exact once it is idle: after ``flush`` or ``close``).

  ``accepted == inserted + pending + failed + discarded`` at all times
  (up to the item being moved between counters while the stats are read).
  """

  accepted: int          # items put and accepted (put returned)
  inserted: int          # items inserted into the table
  pending: int           # accepted, not yet inserted (queued or being inserted)
  batches: int           # table.insert calls that succeeded
  failed: int            # accepted items not inserted because the insert thread failed
  discarded: int         # accepted items dropped by close(discard_pending=True)
  rejected: int          # items put after close/failure that were refused (put raised)
  queue_high_water: int  # largest queue length seen
  blocked_puts: int      # puts that had to wait for room in the queue
  error: Optional[str]   # repr of the insert thread's exception, if any
