"""``Ingestor``: many producer threads feeding one ``Table`` in large batches."""

from funcreplay.host.ingest.ingestor import (
    Ingestor,
    IngestorClosedError,
    IngestorError,
    IngestorFullError,
    IngestorStats,
)

__all__ = ["Ingestor", "IngestorClosedError", "IngestorError", "IngestorFullError",
           "IngestorStats"]
