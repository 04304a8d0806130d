"""The errors of ``funcreplay.ray`` and a remote writer's ``WriterStats``."""

from __future__ import annotations

import dataclasses
from typing import Optional


class TableUnavailableError(RuntimeError):
  """The replay actor is gone (killed, crashed past ``max_restarts``, or closed), or could
  not be reached; raised instead of hanging. ``__cause__`` holds Ray's error."""


class WriterError(RuntimeError):
  """A batch a ``RemoteWriter`` shipped was refused or lost by the actor; ``__cause__``
  holds the actor's error (``TableClosedError``, ``TableUnavailableError``, ...)."""


class WriterClosedError(RuntimeError):
  """``put`` / ``put_batch`` / ``flush`` on a closed (or failed) ``RemoteWriter``."""


class WriterFullError(RuntimeError):
  """``put`` with ``max_in_flight`` batches unacknowledged and ``on_full="raise"``."""


@dataclasses.dataclass(frozen=True)
class WriterStats:
  """Counters of one ``RemoteWriter`` (exact once it is idle: after ``flush`` / ``close``).

  ``accepted == inserted + buffered + in_flight + failed + discarded`` at all times.
  """

  accepted: int          # items put and accepted (put returned)
  inserted: int          # items the actor acknowledged as inserted
  buffered: int          # accepted, still in the local batch (lost if this process dies)
  in_flight: int         # shipped to the actor, not yet acknowledged
  batches: int           # batches acknowledged
  failed: int            # shipped items the actor refused or lost (see ``error``)
  discarded: int         # local items dropped: close(discard_pending=True), or close of a
  #                        writer whose batch failed (they cannot be shipped any more)
  rejected: int          # puts refused after close / failure (put raised)
  blocked_puts: int      # puts that waited for an in-flight batch to be acknowledged
  error: Optional[str]   # repr of the first batch error, if any
