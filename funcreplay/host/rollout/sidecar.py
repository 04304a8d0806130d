"""Host-side per-item data of a ``Table``: ragged leaves (arenas) and payloads.

The pure state decides which slot holds which item (inserts, every remover, reuse
limits, staleness eviction, deletes, takes). ``Sidecars`` follows it: after every
call that may change occupancy, ``sync`` compares the state's ``(occupied, key)``
per slot with its own copy (O(C) numpy, only on tables that have sidecars):

* a slot whose item left (any cause) frees its arena values and drops its payload
  (so a Ray ``ObjectRef`` held as a payload is released at once);
* a slot that received an item of the insert in progress (its key is the insert's
  first key + row) attaches that row's staged values and payload.

Both happen under the table's lock, before the call returns.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np

from funcreplay.core.spec import TableSpec
from funcreplay.host.rollout.arena import RaggedArena
from funcreplay.host.rollout.batch import RaggedBatch

KEY_SPACE = 2**32


class PendingInsert:
  """The sidecars of one ``Table.insert`` call: staged arena rows and payloads per row."""

  __slots__ = ("first_key", "staged", "payloads", "rows")

  def __init__(self, staged, payloads: Optional[Sequence], rows: int):
    self.first_key = None  # the state's next_key before the insert's first jitted call
    self.staged = staged
    self.payloads = payloads
    self.rows = rows


class Sidecars:
  """Arenas (one per ``Ragged`` leaf) and payloads (if enabled), slot-indexed."""

  def __init__(self, spec: TableSpec, payloads: bool):
    c = spec.capacity
    self.spec = spec
    self.key = np.full((c,), -1, np.int64)  # the key this object holds sidecars for, -1: none
    self.payload = np.full((c,), None, object) if payloads else None
    self.arenas: List[RaggedArena] = [RaggedArena(r.dtype, c) for _, r in spec.ragged]
    self.freed_payloads = 0  # payloads dropped because their item left (tests, reports)

  @property
  def has_payloads(self) -> bool:
    return self.payload is not None

  def stage(self, ragged_rows, payloads, b: int) -> PendingInsert:
    """Stage an insert of ``b`` rows: ``ragged_rows`` (flat values, lengths) per arena."""
    staged = [a.stage(flat, lengths) for a, (flat, lengths) in zip(self.arenas, ragged_rows,
                                                                    strict=True)]
    return PendingInsert(staged, payloads, b)

  def release(self, pending: PendingInsert) -> None:
    for a, st in zip(self.arenas, pending.staged, strict=True):
      a.release(st)

  def sync(self, state, pending: Optional[PendingInsert] = None) -> None:
    """Follow ``state``'s occupancy (see the module docstring). Lock held."""
    occ = np.asarray(state.occupied)
    keys = np.asarray(state.key).astype(np.int64)
    new = np.where(occ, keys, -1)
    changed = np.nonzero(new != self.key)[0]
    if changed.size == 0:
      return
    gone = changed[self.key[changed] >= 0]
    if gone.size:
      for a in self.arenas:
        a.free(gone)
      if self.payload is not None:
        self.freed_payloads += int(np.count_nonzero(self.payload[gone] != None))  # noqa: E711
        self.payload[gone] = None
    came = changed[new[changed] >= 0]
    if came.size:
      if pending is None or pending.first_key is None:
        raise RuntimeError(
            f"funcreplay: {came.size} items appeared in the table outside an insert of this "
            "Table (e.g. a state swapped in without its sidecars); the ragged values / "
            "payloads cannot follow them.")
      rows = (new[came] - pending.first_key) % KEY_SPACE
      if np.any(rows >= pending.rows):
        raise RuntimeError("funcreplay: an item's key does not belong to the insert in "
                           "progress; the sidecars lost track of the table.")
      for a, st in zip(self.arenas, pending.staged, strict=True):
        a.attach(came, st, rows)
      if self.payload is not None and pending.payloads is not None:
        self.payload[came] = [pending.payloads[r] for r in rows.tolist()]
    self.key[changed] = new[changed]

  def reset(self, state, ragged_values=None, payloads=None) -> None:
    """Replace everything by ``state``'s items (a load / restore): ``ragged_values``
    per arena is ``[sum_len]`` in slot order of the occupied slots (lengths from the
    state's length leaves); ``payloads`` one per occupied slot, in slot order."""
    c = self.spec.capacity
    occ = np.asarray(state.occupied)
    held = np.nonzero(occ)[0]
    self.key = np.where(occ, np.asarray(state.key).astype(np.int64), -1)
    # Only ragged tables read their length leaves here, and those store columns
    # (``core.storage.resolve``); other tables (payloads only) may store packed rows.
    data_leaves = (self.spec.signature.treedef.flatten_up_to(state.data)
                   if self.spec.ragged else ())
    for j, (leaf, r) in enumerate(self.spec.ragged):
      lengths = np.asarray(data_leaves[leaf])[held].astype(np.int32)
      values = (np.zeros((0,), r.dtype) if ragged_values is None
                else np.asarray(ragged_values[j], r.dtype))
      if int(lengths.sum()) != values.shape[0]:
        raise ValueError(f"ragged leaf {self.spec.signature.names[leaf]}: the lengths sum to "
                         f"{int(lengths.sum())} values, got {values.shape[0]}.")
      fresh = RaggedArena(r.dtype, c, initial=values.shape[0])
      st = fresh.stage(values, lengths) if held.size else None
      if st is not None:
        fresh.attach(held, st, np.arange(held.size))
        fresh.release(st)
      fresh.adopt_staged(self.arenas[j])  # an insert waiting on the limiter keeps its rows
      self.arenas[j] = fresh
    if self.payload is not None:
      self.payload = np.full((c,), None, object)
      if payloads is not None:
        if len(payloads) != held.size:
          raise ValueError(f"payloads: {len(payloads)} for {held.size} items.")
        self.payload[held] = list(payloads)

  def snapshot(self) -> dict:
    """Copies of the ragged values (per arena, ``[sum_len]`` over the occupied slots in
    slot order) and the payloads of those slots (None without payloads)."""
    held = np.nonzero(self.key >= 0)[0]
    return {"ragged": [a.gather(held)[0] for a in self.arenas],
            "payloads": None if self.payload is None else self.payload[held].tolist()}

  def rows(self, slots: np.ndarray, ragged: str):
    """``(RaggedBatch per arena, payload tuple or None)`` of ``slots`` (-1: empty row)."""
    batches = []
    for (_, r), a in zip(self.spec.ragged, self.arenas, strict=True):
      values, lengths, starts = a.gather(slots)
      batches.append(RaggedBatch.build(values, lengths, starts, r.max_len, ragged))
    payload = None
    if self.payload is not None:
      payload = tuple(self.payload[s] if s >= 0 else None for s in slots.tolist())
    return batches, payload

  def live_payloads(self) -> int:
    return 0 if self.payload is None else int(np.count_nonzero(self.payload != None))  # noqa: E711

  def memory(self) -> dict:
    """Bytes held per arena and the values they hold (for bytes-per-token reports)."""
    out = {}
    for (leaf, _), a in zip(self.spec.ragged, self.arenas, strict=True):
      out[self.spec.signature.names[leaf]] = dict(
          nbytes=a.nbytes, buffer_bytes=a.buf.nbytes, live_values=a.live,
          live_bytes=a.live * a.dtype.itemsize, compactions=a.compactions)
    return out
