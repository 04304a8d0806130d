"""Keyed updates: ``update_priorities`` and ``set_metadata`` (by slot and key)."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import counters as ctr
from funcreplay.core import executor, indexes, inplace, item_info
from funcreplay.core.ops import priorities_lean
from funcreplay.core.ops.rows import fit_float, keyed_args, last_occurrence
from funcreplay.core.ops.rows import key_matches as _key_matches
from funcreplay.core.ops.rows import sanitize_priorities as _sanitize_priorities
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def update_priorities(spec: TableSpec, state: TableState, slots, keys, priorities, *,
                      native: Optional[executor.Executor] = None) -> TableState:
  """Set priorities where the slot still holds ``keys``; others are ignored.

  Duplicate slots in one call: the last occurrence wins. Negative, NaN or
  infinite priorities are stored as 0 and counted in
  ``stats().invalid_priorities`` (the host ``Table`` raises instead). Under a
  heap sampler or remover each applied update stamps its item
  (``TableState.touched``): ties then prefer the least recently updated.
  ``native``: an executor (``core.executor``) whose CPU kernel runs where one applies.
  """
  slots, keys, priorities = keyed_args("update_priorities", slots, keys, priorities,
                                       "priorities")
  priorities = jnp.broadcast_to(
      jnp.asarray(fit_float(priorities, np.float32, "update_priorities: priorities"),
                  jnp.float32), slots.shape)
  keys = jnp.broadcast_to(jnp.asarray(keys, jnp.uint32), slots.shape)
  native = executor.check(native, "update_priorities")
  if native and native.supports_update_priorities(spec) and native.available():
    return lax.platform_dependent(
        state, cpu=lambda st: native.update_priorities(spec, st, slots, keys, priorities),
        default=lambda st: _update_priorities(spec, st, slots, keys, priorities))
  return _update_priorities(spec, state, slots, keys, priorities)


def _update_priorities(spec, state, slots, keys, priorities):
  if priorities_lean.applies(spec):  # no order tree: the lean program, bit for bit the general
    return priorities_lean.update_priorities(spec, state, slots, keys, priorities)
  return general_update_priorities(spec, state, slots, keys, priorities)


def general_update_priorities(spec: TableSpec, state: TableState, slots, keys, priorities):
  """The general ``update_priorities`` program (any remover; arguments as arrays).

  Public as the oracle of ``priorities_lean`` (tests/core/test_lean.py).
  """
  safe, ok = _key_matches(state, slots, keys)
  win = last_occurrence(safe, ok)
  clean, n_bad = _sanitize_priorities(priorities, win)
  info = item_info.put_field(state.item_info, jnp.where(win, safe, spec.capacity), "priority",
                             clean, mode="drop")
  c = dict(state.counters)
  c["invalid_priorities"] = ctr.add(c["invalid_priorities"], n_bad)
  max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(win, clean, 0.0), initial=0.0))
  state = state.replace(item_info=info, counters=c, max_priority=max_p)
  if spec.touch_stamps:
    # Reverb's heaps break ties by the least recent insert *or update*: update
    # k of this call gets stamp clock + k (a later duplicate wins, later stamp).
    k, cap = slots.shape[0], spec.capacity
    # Read once (inplace.once): every use of the clock below is then computed from that one
    # read, which is thus ordered before the in-place writes (re-fused into the last write,
    # the read came after the stamps' scatter and XLA copied ``touched`` twice a step).
    clock = inplace.once(state.touched[cap])
    touched = state.touched.at[jnp.where(win, safe, cap + 1)].set(
        clock + jnp.arange(k, dtype=jnp.uint32), mode="drop")
    state = state.replace(touched=touched.at[cap].set(clock + jnp.uint32(k)))
  # Occupancy is unchanged: only the trees ordered by priority move.
  return indexes.refresh(spec, state, safe, win, which=("weight_tree", "remover_tree"))


def set_metadata(spec: TableSpec, state: TableState, slots, keys, column: str,
                 values) -> TableState:
  """Set metadata ``column`` where the slot still holds ``keys`` (last write wins)."""
  if column not in spec.metadata:
    raise ValueError(f"set_metadata: unknown column {column!r}; the spec declares "
                     f"{list(spec.metadata)}.")
  slots, keys, values = keyed_args("set_metadata", slots, keys, values, values_kinds="iu")
  values = jnp.broadcast_to(jnp.asarray(values, jnp.int32), slots.shape)
  safe, ok = _key_matches(state, slots, keys)
  win = last_occurrence(safe, ok)
  col = state.metadata[column].at[jnp.where(win, safe, spec.capacity)].set(values, mode="drop")
  return state.replace(metadata={**state.metadata, column: col})
