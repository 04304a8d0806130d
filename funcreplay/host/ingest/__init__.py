"""``Ingestor``: many producer threads feeding one ``Table`` in large batches.

``ingestor.py`` assembles the ``Ingestor`` from three mixins: ``queue.py``
(the producers' side: ``put``, ``put_batch``, ``flush``), ``worker.py`` (the
insert thread) and ``batcher.py`` (queued entries -> ``table.insert`` calls,
``warmup``); ``errors.py`` holds its errors and ``IngestorStats``.
"""

from funcreplay.host.ingest.errors import (
    IngestorClosedError,
    IngestorError,
    IngestorFullError,
    IngestorStats,
)
from funcreplay.host.ingest.ingestor import Ingestor

__all__ = ["Ingestor", "IngestorClosedError", "IngestorError", "IngestorFullError",
           "IngestorStats"]
