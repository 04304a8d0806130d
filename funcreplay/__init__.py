"""funcreplay: a functional replay table for JAX with Reverb-like semantics.

The buffer is a value (``TableState``, a pytree of preallocated arrays)
transformed by pure, jit-compatible functions built by ``make_table(spec)``.
"""

from funcreplay import checkpoint, counters, native
from funcreplay.caches import clear_caches
from funcreplay.checkpoint import CheckpointError, PeriodicCheckpointer, restore, save
from funcreplay.functional import FunctionalTable, make_table
from funcreplay.ingest import (
    Ingestor,
    IngestorClosedError,
    IngestorError,
    IngestorFullError,
    IngestorStats,
)
from funcreplay.ops import Stats
from funcreplay.packing import PackedField, PackedLayout, PackedSample
from funcreplay.rate_limiters import MinSize, Queue, RateLimiter, SampleToInsertRatio, Stack
from funcreplay.sampling import importance_weights
from funcreplay.selectors import Fifo, Lifo, MaxHeap, MinHeap, Prioritized, Uniform
from funcreplay.sharding import ShardedTable, make_sharded_table
from funcreplay.signature import Signature, check_items
from funcreplay.spec import TableSpec, queue, stack
from funcreplay.state import Sample, SampleInfo, TableState, state_counters
from funcreplay.table import Table, TableClosedError
from funcreplay.writers import SequenceWriter, WriterStats, sequence_signature

__version__ = "0.1.0"

__all__ = [
    "FunctionalTable", "make_table", "Stats", "MinSize", "Queue", "RateLimiter",
    "SampleToInsertRatio", "Stack", "importance_weights", "Fifo", "Lifo", "MaxHeap",
    "MinHeap", "Prioritized", "Uniform", "Signature", "check_items", "TableSpec", "queue",
    "stack", "Sample", "SampleInfo", "TableState", "counters", "state_counters",
    "ShardedTable", "make_sharded_table", "Table", "TableClosedError", "checkpoint",
    "CheckpointError", "PeriodicCheckpointer", "save", "restore", "Ingestor",
    "IngestorClosedError", "IngestorError", "IngestorFullError", "IngestorStats",
    "SequenceWriter", "WriterStats", "sequence_signature", "native", "PackedSample",
    "PackedLayout", "PackedField", "clear_caches",
]
