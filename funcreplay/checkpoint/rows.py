"""Item data on disk as the occupied rows only (schema 2).

A table is preallocated: a half-full table of 20k slots of 84x84x4 uint8
frames holds 1.1 GB of item data of which half is free slots. ``pack`` keeps,
of every item-data leaf (``.data...``, shape ``[C, ...]`` or ``[S, C/S, ...]``
for a sharded state), only the rows of occupied slots in slot order
(``x[occupied]``, shape ``[n, ...]``); ``unpack`` scatters them back into
zeros. The per-slot columns (keys, priorities, ...), the trees and the ledger
stay whole: they are ~25 bytes per slot and restore needs every bit of them.

What a restore gives back is therefore bit-exact except the item bytes of
*free* slots, which come back as zeros: nothing reads them (an insert
overwrites a slot's whole row; invalid sample rows are zeros). A table with
every slot occupied is stored as is (no gather).

The manifest records ``"rows": {"mask": ".occupied", "count": n, "leaves":
[...]}`` (None when nothing is packed); each packed entry's ``shape`` is the
stored ``[n, ...]``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from funcreplay.checkpoint.errors import CheckpointError

MASK = ".occupied"
DATA_PREFIX = ".data"


def pack(arrays: Sequence[Tuple[str, np.ndarray]]
         ) -> Tuple[List[Tuple[str, np.ndarray]], Optional[Dict[str, Any]]]:
  """``(arrays with item-data leaves cut to occupied rows, manifest "rows" entry or None)``."""
  by_name = dict(arrays)
  occ = np.asarray(by_name[MASK], bool)
  n = int(occ.sum())
  if n == occ.size:
    return list(arrays), None
  leaves = [name for name, _ in arrays if name.startswith(DATA_PREFIX)]
  out = [(name, np.asarray(a)[occ] if name in leaves else a) for name, a in arrays]
  return out, {"mask": MASK, "count": n, "leaves": leaves}


def stored_shape(name: str, shape: Tuple[int, ...], rows: Optional[Dict[str, Any]],
                 lead: int) -> Tuple[int, ...]:
  """The on-disk shape of leaf ``name`` whose in-memory shape is ``shape``.

  ``lead`` is the number of slot axes (1, or 2 for a sharded state).
  """
  if rows is None or name not in rows["leaves"]:
    return tuple(shape)
  return (rows["count"],) + tuple(shape[lead:])


def check_entry(rows: Any, names: Sequence[str], where: str) -> Optional[Dict[str, Any]]:
  """The manifest's ``rows`` entry, validated (None: every leaf stored whole)."""
  if rows is None:
    return None
  ok = (isinstance(rows, dict) and rows.get("mask") == MASK
        and isinstance(rows.get("count"), int) and not isinstance(rows["count"], bool)
        and rows["count"] >= 0 and isinstance(rows.get("leaves"), list)
        and all(isinstance(n, str) and n.startswith(DATA_PREFIX) and n in names
                for n in rows["leaves"]))
  if not ok:
    raise CheckpointError(f"{where}: rows must be null or {{mask: {MASK!r}, count: int >= 0, "
                          f"leaves: [item-data leaves]}}, got {rows!r}; the manifest is "
                          "corrupted.")
  return rows


def unpack(arrays: List[np.ndarray], names: Sequence[str],
           full: Sequence[Tuple[Tuple[int, ...], np.dtype]], rows: Optional[Dict[str, Any]],
           where: str) -> List[np.ndarray]:
  """``arrays`` (manifest order) with packed leaves scattered back to their ``full`` shapes."""
  if rows is None:
    return arrays
  occ = np.asarray(arrays[list(names).index(MASK)], bool)
  if int(occ.sum()) != rows["count"]:
    raise CheckpointError(f"{where}: {rows['count']} rows of item data are stored but "
                          f"{MASK[1:]} marks {int(occ.sum())} occupied slots; the checkpoint "
                          "is corrupted.")
  out = list(arrays)
  for i, name in enumerate(names):
    if name in rows["leaves"]:
      shape, dtype = full[i]
      a = np.zeros(shape, dtype)
      a[occ] = arrays[i]
      out[i] = a
  return out
