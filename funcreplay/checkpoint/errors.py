"""The one error type of the checkpoint package."""

from __future__ import annotations


class CheckpointError(ValueError):
  """A checkpoint is missing, incomplete, corrupted, or does not fit the requested spec.

  Subclass of ``ValueError`` so callers that already catch bad-input errors
  keep working. The message names the file (or spec field) at fault and what
  to do. Restoring never returns a partially loaded state: every array is
  read and checksummed before any of it is handed out.
  """
