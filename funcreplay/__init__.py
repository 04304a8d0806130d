"""funcreplay: a functional replay table for JAX with Reverb-like semantics.

The buffer is a value (``TableState``, a pytree of preallocated arrays)
transformed by pure, jit-compatible functions built by ``make_table(spec)``.

The package is layered (README "Layout"): ``core`` (pure) <- ``native`` (the
optional CPU kernels) <- ``host`` (``Table``, ``Ingestor``, writers) <-
``distributed`` / ``checkpoint`` <- ``interop`` (``funcreplay.torch``).
``import funcreplay`` loads only the core; every name of a higher layer is
imported on first use (PEP 562 ``__getattr__``), so pure in-jit use pulls in
no threads, ctypes or compiler machinery.
"""

from __future__ import annotations

import importlib

from funcreplay.core import counters
from funcreplay.core.caches import clear_caches
from funcreplay.core.columns import Column, Ragged
from funcreplay.core.functional import FunctionalTable
from funcreplay.core.ops import Stats
from funcreplay.core.packing import PackedField, PackedLayout, PackedSample
from funcreplay.core.rate_limiters import MinSize, Queue, RateLimiter, SampleToInsertRatio, Stack
from funcreplay.core.sampling import importance_weights
from funcreplay.core.selectors import (
  Fifo,
  FreshestFirst,
  Lifo,
  MaxHeap,
  MinHeap,
  Prioritized,
  StalestFirst,
  Uniform,
)
from funcreplay.core.signature import Signature, check_items
from funcreplay.core.spec import TableSpec, queue, stack
from funcreplay.core.state import Sample, SampleInfo, TableState, state_counters
from funcreplay.core.storage import stored_items
from funcreplay.core.trajectory import (
  TrajectorySpec,
  TrajectoryState,
  TrajectoryTable,
  n_step_returns,
  n_step_target,
)
from funcreplay.core.version import VERSION as __version__  # noqa: F401 (public)

# Public name -> (module, attribute; None: the module itself), imported on first use.
_LAZY = {
    "make_table": ("funcreplay.native.functional", "make_table"),
    "make_trajectory_table": ("funcreplay.native.trajectory", "make_trajectory_table"),
    "native": ("funcreplay.native", None),
    "Table": ("funcreplay.host.table", "Table"),
    "TableClosedError": ("funcreplay.host.table", "TableClosedError"),
    "VersionAheadWarning": ("funcreplay.host.table", "VersionAheadWarning"),
    "Ingestor": ("funcreplay.host.ingest", "Ingestor"),
    "IngestorClosedError": ("funcreplay.host.ingest", "IngestorClosedError"),
    "IngestorError": ("funcreplay.host.ingest", "IngestorError"),
    "IngestorFullError": ("funcreplay.host.ingest", "IngestorFullError"),
    "IngestorStats": ("funcreplay.host.ingest", "IngestorStats"),
    "SequenceWriter": ("funcreplay.host.writers", "SequenceWriter"),
    "WriterStats": ("funcreplay.host.writers", "WriterStats"),
    "sequence_signature": ("funcreplay.host.writers", "sequence_signature"),
    "ShardedTable": ("funcreplay.distributed", "ShardedTable"),
    "make_sharded_table": ("funcreplay.distributed", "make_sharded_table"),
    "checkpoint": ("funcreplay.checkpoint", None),
    "CheckpointError": ("funcreplay.checkpoint", "CheckpointError"),
    "PeriodicCheckpointer": ("funcreplay.checkpoint", "PeriodicCheckpointer"),
    "save": ("funcreplay.checkpoint", "save"),
    "restore": ("funcreplay.checkpoint", "restore"),
    "HostSample": ("funcreplay.host.rollout.batch", "HostSample"),
    "RaggedBatch": ("funcreplay.host.rollout.batch", "RaggedBatch"),
    "Receipt": ("funcreplay.host.rollout.mixin", "Receipt"),
    "GroupWriter": ("funcreplay.host.rollout.group_writer", "GroupWriter"),
    "save_trajectory": ("funcreplay.checkpoint.trajectory", "save_trajectory"),
    "restore_trajectory": ("funcreplay.checkpoint.trajectory", "restore_trajectory"),
}


def __getattr__(name: str):
  if name not in _LAZY:
    raise AttributeError(f"module 'funcreplay' has no attribute {name!r}")
  module, attr = _LAZY[name]
  if module.startswith("funcreplay.host"):
    # Table.save / Table.restore live in the layer above the host
    # (funcreplay.checkpoint registers them on import): a Table from the
    # public name has them.
    importlib.import_module("funcreplay.checkpoint")
  value = importlib.import_module(module)
  if attr is not None:
    value = getattr(value, attr)
  globals()[name] = value  # later lookups skip __getattr__
  return value


def __dir__():
  return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "FunctionalTable", "make_table", "Stats", "MinSize", "Queue", "RateLimiter",
    "SampleToInsertRatio", "Stack", "importance_weights", "Fifo", "Lifo", "MaxHeap",
    "MinHeap", "Prioritized", "Uniform", "Signature", "check_items", "TableSpec", "queue",
    "stack", "Sample", "SampleInfo", "TableState", "counters", "state_counters",
    "ShardedTable", "make_sharded_table", "Table", "TableClosedError", "VersionAheadWarning",
    "checkpoint",
    "CheckpointError", "PeriodicCheckpointer", "save", "restore", "Ingestor",
    "IngestorClosedError", "IngestorError", "IngestorFullError", "IngestorStats",
    "SequenceWriter", "WriterStats", "sequence_signature", "native", "PackedSample",
    "PackedLayout", "PackedField", "clear_caches",
    "Column", "Ragged", "StalestFirst", "FreshestFirst", "HostSample", "RaggedBatch", "Receipt",
    "GroupWriter",
    "TrajectorySpec", "TrajectoryState", "TrajectoryTable", "make_trajectory_table",
    "n_step_returns", "n_step_target", "save_trajectory", "restore_trajectory",
    "stored_items",
]
