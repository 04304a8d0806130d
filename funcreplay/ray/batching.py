"""A ``RemoteWriter``'s local batch: the extras of one ``put`` and the stacked batch it ships."""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import numpy as np

from funcreplay.core import signature as sig_lib
from funcreplay.host import validation
from funcreplay.host.itemcheck import stack_leaf
from funcreplay.ray.server import NO_VERSION

F32_MAX = float(np.finfo(np.float32).max)


def check_extras(version, priority, metadata: Optional[Mapping[str, int]],
                 columns: Sequence[str], what: str):
  """``(version, priority, metadata)`` of one item checked as ``Ingestor.put`` checks them
  (int32 version, finite float32 priority >= 0, int32 values of known columns)."""
  if version is not None:
    version = validation.check_int(version, f"{what} version")
  if priority is not None:
    try:
      p = float(priority)
    except (TypeError, ValueError):
      raise TypeError(f"{what}: priority must be a float, got "
                      f"{type(priority).__name__} {priority!r}.") from None
    if not 0.0 <= p <= F32_MAX:  # also rejects NaN
      raise ValueError(f"{what}: priority must be finite and >= 0 (as float32), got "
                       f"{priority!r}.")
    priority = p
  if metadata is not None:
    metadata = {k: validation.check_int(v, f"{what} metadata[{k!r}]")
                for k, v in validation.check_metadata_columns(metadata, columns, what).items()}
  return version, priority, metadata


def stack_entries(entries: list, sig: sig_lib.Signature, columns: Sequence[str]):
  """The arguments of the actor's ``insert_batch`` for ``entries`` (each an item's leaves,
  optionally followed by ``(version, priority, metadata)``): the stacked leaves ``[n, ...]``;
  versions int64[n] (``NO_VERSION``: the table's), priorities float32[n] (NaN: the default),
  metadata column -> int32[n]; each None when no entry has one."""
  n, nl = len(entries), len(sig.leaves)
  cols = list(zip(*entries, strict=False))  # stops at the shortest entry: the leaves
  leaves = [stack_leaf(cols[i], n, s) for i, s in enumerate(sig.leaves)]
  if len(cols) == nl and max(map(len, entries)) == nl:
    return leaves, None, None, None
  extras = [e[nl:] if len(e) > nl else (None, None, None) for e in entries]
  vers, prios, metas = zip(*extras, strict=True)
  version = None if vers.count(None) == n else np.array(
      [NO_VERSION if v is None else v for v in vers], np.int64)
  prio = None if prios.count(None) == n else np.array(
      [math.nan if p is None else p for p in prios], np.float32)
  meta = None if metas.count(None) == n else {
      c: np.array([m.get(c, 0) if m else 0 for m in metas], np.int32) for c in columns}
  return leaves, version, prio, meta
