"""Host preparation of an insert into a table with ragged leaves or payloads."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax

from funcreplay.core.spec import TableSpec
from funcreplay.host.rollout.batch import ragged_rows


def split_ragged(spec: TableSpec, items: Any, what: str):
  """``(items with each Ragged leaf replaced by its int32[B] lengths, [(flat, lengths)])``.

  Without ragged leaves ``items`` comes back as it is. The lengths take the ragged
  leaf's place, so the dense check (``check_items``) then checks every other leaf
  and the batch size."""
  if not spec.ragged:
    return items, []
  sig = spec.signature
  try:
    leaves = sig.treedef.flatten_up_to(items)
  except (ValueError, TypeError) as e:
    raise ValueError(f"{what}: item structure does not match the table signature "
                     f"{spec.item_tree} ({e}).") from None
  out = []
  for i, r in spec.ragged:
    flat, lengths = ragged_rows(r, leaves[i], None, sig.names[i], what)
    leaves[i] = lengths
    out.append((flat, lengths))

  return jax.tree_util.tree_unflatten(sig.treedef, leaves), out


def check_payloads(payload: Optional[Sequence], b: int, keeps: bool, what: str):
  """A list of ``b`` payloads (or None), or a clear error."""
  if payload is None:
    return None
  if not keeps:
    raise ValueError(f"{what}: this table keeps no payloads; create it with "
                     "fr.Table(spec, payloads=True).")
  if isinstance(payload, (str, bytes)) or not hasattr(payload, "__len__"):
    raise TypeError(f"{what}: payload must be a sequence of {b} objects (one per item), got "
                    f"{type(payload).__name__}.")
  if len(payload) != b:
    raise ValueError(f"{what}: {len(payload)} payloads for a batch of {b} items.")
  return list(payload)
