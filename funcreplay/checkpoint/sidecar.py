"""Host-side extras of a checkpoint: the ragged values and (opt-in) payloads of a
``Table`` (``funcreplay.host.rollout``), stored as extra ``.npy`` files of the same
checkpoint directory (same atomic write, CRC-32s in the same manifest).

Their entries carry leaf names starting with ``PREFIX``; ``split`` takes them out of a
manifest so the state's own checks see exactly the state's arrays. Payloads are one
``uint8`` array of ``pickle`` bytes, written only when the caller asks
(``Table.save(path, payloads="pickle")``) and read only when the restoring caller
allows it (``allow_pickle=True``): unpickling runs code from the file.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from funcreplay.checkpoint import format as fmt
from funcreplay.checkpoint.errors import CheckpointError

PREFIX = "sidecar."
PAYLOADS = PREFIX + "payloads"
PAYLOAD_POLICIES = ("refuse", "pickle", "drop")


def ragged_name(i: int) -> str:
  return f"{PREFIX}ragged.{i}"


def to_arrays(snapshot: Optional[Dict[str, Any]], payloads: str) -> List[Tuple[str, np.ndarray]]:
  """Named arrays of a table's sidecar snapshot (``Table.checkpoint_state``'s
  ``host["sidecars"]``), with the payload policy applied."""
  if payloads not in PAYLOAD_POLICIES:
    raise ValueError(f"save: payloads must be one of {PAYLOAD_POLICIES}, got {payloads!r}.")
  if snapshot is None:
    return []
  out = [(ragged_name(i), np.ascontiguousarray(v)) for i, v in enumerate(snapshot["ragged"])]
  held = snapshot.get("payloads")
  if held is not None and any(p is not None for p in held):
    if payloads == "refuse":
      n = sum(p is not None for p in held)
      raise ValueError(
          f"save: the table holds {n} payloads, which only pickle can store; pass "
          "payloads='pickle' to include them (restore then needs allow_pickle=True) or "
          "payloads='drop' to save without them.")
    if payloads == "pickle":
      blob = pickle.dumps(list(held), protocol=pickle.HIGHEST_PROTOCOL)
      out.append((PAYLOADS, np.frombuffer(blob, np.uint8).copy()))
  return out


def split(manifest: Dict[str, Any]):
  """``(manifest without sidecar entries, the sidecar entries)``."""
  entries = manifest.get("arrays", [])
  side = [e for e in entries if isinstance(e, dict) and str(e.get("leaf", "")).startswith(PREFIX)]
  if not side:
    return manifest, []
  rest = [e for e in entries if e not in side]
  return {**manifest, "arrays": rest}, side


def read(path: str, manifest: Dict[str, Any], entries, verify: bool) -> Optional[Dict[str, Any]]:
  """``{leaf name: array}`` of the sidecar entries (CRC-checked), or None without any."""
  if not entries:
    return None
  arrays = fmt.read_arrays(path, {**manifest, "arrays": entries}, verify=verify)
  return {e["leaf"]: a for e, a in zip(entries, arrays, strict=True)}


def values(sidecar: Optional[Dict[str, Any]], spec, path: str, allow_pickle: bool,
           payloads: Optional[bool], state=None, order: Optional[np.ndarray] = None):
  """``(keep payloads?, (ragged values per Ragged leaf, payloads or None))`` for
  ``Table.from_state``. ``payloads`` None: keep them iff the checkpoint has them.
  ``order`` (``Restored.sidecar_order``, with the restored ``state``): the items moved, so
  their pieces are put in the new slot order."""
  sidecar = sidecar or {}
  ragged = []
  # Tables with ragged leaves store columns (``storage.resolve``): the lengths are a leaf.
  leaves = (spec.signature.treedef.flatten_up_to(state.data)
            if order is not None and spec.ragged else None)
  for i, (leaf, _) in enumerate(spec.ragged):
    if ragged_name(i) not in sidecar:
      raise CheckpointError(f"{path}: the values of ragged leaf {spec.signature.names[leaf]} "
                            "are missing from the checkpoint.")
    got = sidecar[ragged_name(i)]
    if order is not None:
      lengths = np.asarray(leaves[leaf])[np.asarray(state.occupied)].astype(np.int64)
      got = _moved_values(got, lengths, order)
    ragged.append(got)
  keep = (PAYLOADS in sidecar) if payloads is None else bool(payloads)
  held = None
  if PAYLOADS in sidecar and keep:
    if not allow_pickle:
      raise CheckpointError(
          f"{os.path.join(path, PAYLOADS)}: the checkpoint holds pickled payloads; restore "
          "with allow_pickle=True if you trust it (unpickling runs code from the file), or "
          "payloads=False to restore without them.")
    held = pickle.loads(sidecar[PAYLOADS].tobytes())
    if order is not None and isinstance(held, list) and len(held) == len(order):
      held = [held[j] for j in order]  # a count that differs: Table.from_state says so
  return keep, (ragged, held)


def _moved_values(values: np.ndarray, lengths: np.ndarray, order: np.ndarray) -> np.ndarray:
  """The concatenated per-item ``values`` (saved item ``j``'s piece the ``j``-th) put in the
  items' new order: new item ``i`` is saved item ``order[i]`` and has ``lengths[i]`` values.
  Values whose total differs from ``lengths`` are returned as they are (the table's reset
  reports the mismatch)."""
  if int(lengths.sum()) != values.shape[0] or len(lengths) != len(order):
    return values
  saved_lengths = np.empty_like(lengths)
  saved_lengths[order] = lengths
  saved_starts = np.cumsum(saved_lengths) - saved_lengths
  new_starts = np.cumsum(lengths) - lengths
  # Value k of new item i is value k of saved item order[i].
  shift = np.repeat(saved_starts[order] - new_starts, lengths)
  return values[np.arange(values.shape[0]) + shift]
