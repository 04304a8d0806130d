"""A ``RemoteWriter``'s local batch: the extras of one ``put`` and the stacked batch it ships."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from funcreplay.core import signature as sig_lib
from funcreplay.core.columns import Column
from funcreplay.host.itemcheck import stack_leaf
from funcreplay.host.rollout import columns as col_lib
from funcreplay.ray.server import NO_VERSION


def stack_entries(entries: list, sig: sig_lib.Signature, columns: Sequence[Column]):
  """The arguments of the actor's ``insert_batch`` for ``entries`` (each an item's leaves,
  optionally followed by ``(version, priority, metadata)``): the stacked leaves ``[n, ...]``;
  versions int64[n] (``NO_VERSION``: the table's), priorities float32[n] (NaN: the default),
  metadata column -> ``Table.insert`` values [n] of the entries' stored words
  (``columns.insert_values``); each None when no entry has one."""
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
  meta = None if metas.count(None) == n else col_lib.insert_values(columns, metas)
  return leaves, version, prio, meta
