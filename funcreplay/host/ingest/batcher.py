"""Turning queued entries into ``table.insert`` calls: stacking, splitting, warmup.

``Batcher`` is a mixin of ``Ingestor`` (``ingestor.py``): ``_insert_entries``
stacks a run of queued items into one batch per leaf and inserts it (split
where versions, priorities or metadata change), ``warmup`` compiles every
batch bucket up front.
"""

from __future__ import annotations

import jax
import numpy as np

from funcreplay.host.ingest.queue import Discarding as _Discarding
from funcreplay.host.itemcheck import stack_leaf
from funcreplay.host.rollout import columns as col_lib


class Batcher:
  """Batches from queued entries (mixin of ``Ingestor``)."""

  def warmup(self) -> int:
    """Compile the table's insert for every batch size this ingestor can use.

    Partial batches (``max_wait_s``, ``flush``) are padded by the table to a
    power-of-two bucket; each new bucket compiles once, which on a CPU can
    stall the insert thread for a second or more the first time it occurs.
    ``warmup`` compiles them all up front by inserting zeros into a scratch
    ``Table`` of the same spec (the compiled functions are shared per spec);
    this table is not touched. Costs one extra table allocation while it runs.

    Returns the number of buckets compiled.
    """
    # A Table of the same class, spec and executor (the compiled programs are shared
    # per spec and executor: another executor's would leave the table's uncompiled).
    scratch = type(self._table)(self._spec, native=getattr(self._table, "native", None))
    try:
      sizes, k = [], 1
      while k < self._batch_size:
        sizes.append(k)
        k *= 2
      sizes.append(self._batch_size)
      for k in sizes:
        zeros = jax.tree_util.tree_unflatten(
            self._sig.treedef, [np.zeros((k, *s.shape), s.dtype) for s in self._sig.leaves])
        try:
          scratch.insert(zeros, timeout=0)
        except TimeoutError:
          pass  # a blocking rate limiter: compiled all the same
      len(scratch)  # wait for the compilations and runs to finish
    finally:
      scratch.close()
    return len(sizes)

  def _insert_entries(self, entries: list) -> None:
    """Stack ``entries`` and insert them, in order.

    An entry is the tuple of an item's leaves, optionally followed by
    ``(version, priority, metadata)`` (metadata as stored words: ``columns.item_words``).
    """
    n, n_leaves = len(entries), self._n_leaves
    cols = list(zip(*entries, strict=False))  # stops at the shortest entry: the leaves
    stacked = [stack_leaf(cols[i], n, s) for i, s in enumerate(self._sig.leaves)]
    if len(cols) == n_leaves and max(map(len, entries)) == n_leaves:
      self._insert(stacked, None, None, None, 0, n)  # the common case: no extras
      return
    none3 = (None, None, None)
    vers, prios, metas = zip(*[e[n_leaves:] if len(e) > n_leaves else none3 for e in entries],
                             strict=True)
    version = None
    if vers.count(None) != n:
      default = self._table.version
      version = np.array([default if v is None else v for v in vers], np.int32)
    meta = None
    if metas.count(None) != n:
      meta = col_lib.insert_values(self._columns, metas)
    n_none = prios.count(None)
    if n_none in (0, n):
      self._insert(stacked, version, None if n_none else np.array(prios, np.float32), meta, 0, n)
      return
    # Items with and without explicit priorities: the table's default priority
    # applies per call, so insert each run separately (order preserved).
    start = 0
    for i in range(1, n + 1):
      if i == n or (prios[i] is None) != (prios[start] is None):
        prio = None if prios[start] is None else np.array(prios[start:i], np.float32)
        self._insert(stacked, version, prio, meta, start, i)
        start = i

  def _insert(self, stacked, version, prio, meta, a: int, b: int) -> None:
    """Insert rows ``[a, b)`` of the stacked leaves (``prio`` already covers exactly them)."""
    if (a, b) != (0, stacked[0].shape[0]):
      stacked = [x[a:b] for x in stacked]
      version = None if version is None else version[a:b]
      meta = None if meta is None else {k: v[a:b] for k, v in meta.items()}
    items = jax.tree_util.tree_unflatten(self._sig.treedef, stacked)
    rem = b - a
    while True:
      try:
        self._table.insert(items, version=version, priority=prio, metadata=meta,
                           timeout=self._poll)
        break
      except Exception as e:  # noqa: BLE001 (re-raised unless it is the limiter's timeout)
        k = getattr(e, "inserted", 0)  # Table errors say how many leading rows went in
        if k:
          items = jax.tree_util.tree_map(lambda x, k=k: x[k:], items)
          version = None if version is None else version[k:]
          prio = None if prio is None else prio[k:]
          meta = None if meta is None else {c: v[k:] for c, v in meta.items()}
          rem -= k
          self._inserted += k
          self._inflight -= k
        if not isinstance(e, TimeoutError):
          raise
        self._limiter_blocked = not k  # for close()'s messages
        if self._discard:  # the rate limiter blocks and close() asked to give up
          raise _Discarding() from None
    self._limiter_blocked = False
    self._inserted += rem
    self._inflight -= rem
    self._batches += 1
