"""Restoring ``TableState.position_index`` (``core.position_index``).

A checkpoint stores the index as it is (the uniform sample's slots depend on it: a
table restored from it samples the same batch for the same key). A checkpoint written
before the index existed lacks it, and one may be restored into a spec that keeps an
index when the saved one did not, or the other way: then the index is rebuilt from
``occupied`` (``position_index.rebuild``, O(C)), or dropped.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import jax
import numpy as np

from funcreplay.checkpoint.errors import CheckpointError
from funcreplay.core import position_index
from funcreplay.core.spec import TableSpec


def saved_spec(spec: TableSpec, saved: Dict[str, Any], path: str) -> TableSpec:
  """``spec`` with the saved capacity and the saved table's ``position_index`` (the
  layout of the stored arrays; with it, ``holes=True``: a promise about later operations,
  which the restore checks against ``spec`` itself, not a layout)."""
  kept = bool(saved.get("position_index", False))
  try:
    return spec.replace(capacity=saved["capacity"], position_index=kept,
                        holes=spec.holes or kept)
  except ValueError as e:
    raise CheckpointError(f"{path}: the checkpoint's table kept a position index that the "
                          f"given spec cannot ({e}).") from None


def built(occupied, num_shards: Optional[int]) -> np.ndarray:
  """The index of ``occupied`` (bool[C], or [S, C] for ``num_shards``), numpy."""
  fn = position_index.rebuild if num_shards is None else jax.vmap(position_index.rebuild)
  return np.asarray(fn(np.asarray(occupied, bool)))


def fit(spec: TableSpec, state, num_shards: Optional[int]):
  """``state`` (numpy) with the index ``spec`` keeps: rebuilt when it has none of that
  shape, dropped when ``spec`` keeps none."""
  lead = () if num_shards is None else (num_shards,)
  index = np.asarray(state.position_index)
  if not spec.position_index:
    return state.replace(position_index=np.zeros(lead + (2, 0), np.int32))
  if index.shape[-1] != np.shape(state.occupied)[-1] + 1:
    return state.replace(position_index=built(state.occupied, num_shards))
  return state


def error(spec: TableSpec, state) -> str:
  """"" if the state's index is valid for its ``occupied`` (or ``spec`` keeps none), else
  what is wrong (a damaged checkpoint)."""
  if not spec.position_index:
    return ""
  index, occupied = np.asarray(state.position_index), np.asarray(state.occupied)
  for i, (x, occ) in enumerate(zip(index.reshape((-1,) + index.shape[-2:]),
                                   occupied.reshape((-1, occupied.shape[-1])))):
    why = position_index.check(x, occ)
    if why:
      return why + (f" (shard {i})" if index.ndim == 3 else "")
  return ""
