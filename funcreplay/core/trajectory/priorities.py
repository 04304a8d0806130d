"""``update_priorities``: new priorities for sampled windows, guarded by their keys."""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import bits
from funcreplay.core.trajectory import prioritized
from funcreplay.core.trajectory import state as st
from funcreplay.core.trajectory.spec import TrajectorySpec
from funcreplay.core.trajectory.state import TrajectoryState


def last_occurrence(w, n_max: int):
  """bool[K]: row ``i`` is the last row holding its value ``w[i]`` (int32[K] in
  ``[0, n_max]``): duplicates resolve to the last update, as in a sequential loop."""
  k = w.shape[0]
  sw, si = bits.sort_pairs(w, n_max + 1)
  last_sorted = jnp.concatenate([sw[1:] != sw[:-1], jnp.ones((1,), bool)])
  return jnp.zeros((k,), bool).at[si].set(last_sorted, unique_indices=True)


def update_priorities(spec: TrajectorySpec, state: TrajectoryState, slots, keys, priorities
                      ) -> TrajectoryState:
  """Set the priority of windows ``slots`` (int32[K], ``Sample.info.slot``) whose current
  key equals ``keys`` (uint32[K], ``Sample.info.key``) to ``priorities`` (float32[K]).

  Rows are skipped when the slot is out of range (e.g. -1 of an invalid
  sample row), the window was rewritten since it was sampled (its key
  changed) or is not stored. Negative, NaN or infinite priorities become 0 (the
  window is then not sampled). Duplicate slots: the last row wins.
  ``max_priority`` (the default priority of new windows) follows the largest
  priority set; the weight tree follows. O(K log N).
  """
  if not spec.prioritized:
    raise ValueError("update_priorities: the spec's sampler is Uniform; priorities need "
                     "sampler=fr.Prioritized(...).")
  if jnp.asarray(slots).dtype.kind not in "iu":  # a float slot would be truncated to another
    raise TypeError(f"update_priorities: slots must be integers (Sample.info.slot), got "
                    f"{jnp.asarray(slots).dtype}.")
  slots = jnp.asarray(slots, jnp.int32)
  if slots.ndim != 1:
    raise ValueError(f"update_priorities: slots must be int32[K], got shape {list(slots.shape)}.")
  keys = jnp.asarray(keys)
  priorities = jnp.asarray(priorities, jnp.float32)
  if keys.shape != slots.shape or priorities.shape != slots.shape:
    raise ValueError(f"update_priorities: slots, keys and priorities must have the same "
                     f"shape [K]; got {list(slots.shape)}, {list(keys.shape)}, "
                     f"{list(priorities.shape)}.")
  if keys.dtype != jnp.uint32:
    raise ValueError(f"update_priorities: keys must be uint32 (Sample.info.key), got "
                     f"{keys.dtype}.")
  n = spec.num_windows
  in_range = (slots >= 0) & (slots < n)
  w = jnp.where(in_range, slots, 0)
  ok = in_range & (st.keys(spec, state, w) == keys) & st.valid_windows(spec, state, w)
  ok = ok & last_occurrence(jnp.where(ok, w, n), n)
  pr = jnp.where(jnp.isfinite(priorities) & (priorities > 0), priorities, 0.0)
  priority = state.priority.at[jnp.where(ok, w, n)].set(pr, mode="drop")
  max_priority = jnp.maximum(state.max_priority, jnp.max(jnp.where(ok, pr, 0.0), initial=0.0))
  tree, positive = prioritized.refresh(state.weight_tree, state.positive, w,
                                       prioritized.window_weight(spec, pr), ok)
  return state.replace(priority=priority, max_priority=max_priority, weight_tree=tree,
                       positive=positive)
