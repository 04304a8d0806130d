"""Prioritized windows without masks: a weight tree over the windows, kept by ``add`` and
``update_priorities``, and the lean draw of ``core/sampling/prioritized_lean.py``.

``weight_tree`` (float32[2P], ``core.trees`` layout) has leaf ``w`` =
``priority[w]**alpha`` while window ``w`` is sampleable (stored and, with
episodes tracked, crossing no episode start) and 0 otherwise; ``positive``
counts its positive leaves (the eligible windows, ``num_eligible``). Every
node is recomputed from its children (``trees.refresh_sum``), so sums never
drift. ``add`` zeroes the windows it restarts and sets the windows it
completes, ``update_priorities`` the windows it changes: O(K log N) each.

The draw (no ``where`` / staleness / reuse mask; those take the general O(N)
program): M = B + max(8, B / 2) i.i.d. descents proportional to weight, the
first B distinct in draw order (exactly successive sampling, i.e. sampling
without replacement proportional to weight), and, only when fewer than B
distinct windows came up while more exist, the missing rows by an exact
Gumbel-top-k over the remaining weights (O(N), under one ``lax.cond``).
``replace=True``: the first B draws, no sort, no condition.
"""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import fixedpoint, inplace, numerics, powers, trees
from funcreplay.core.sampling import exact
from funcreplay.core.trajectory.spec import TrajectorySpec
from funcreplay.core.trajectory.state import TrajectoryState

_U24 = 2.0**-24  # resolution of a float32 uniform in [0, 1) from 24 random bits


def window_weight(spec: TrajectorySpec, priority):
  """float32[...]: ``priority**alpha`` (0 for a priority <= 0; ``powers.power``)."""
  return powers.power(priority, spec.sampler.priority_exponent)


def refresh(tree, positive, w, values, valid):
  """Set leaves ``w`` (int32[K], distinct where ``valid``) to ``values``; returns
  ``(tree, positive)`` with the count of positive leaves kept in step."""
  if w.shape[0] == 1:
    # One slot would turn the per-level updates into dynamic slices, which XLA re-fuses
    # into several reads and then copies the whole tree (as ``indexes.refresh``).
    w, values, valid = (jnp.concatenate([x, x]) for x in (w, values, valid))
    valid = valid.at[1].set(False)
  safe = jnp.where(valid, w, 0)
  old = trees.leaf_values(tree, safe)
  positive = positive + jnp.sum(valid & (values > 0), dtype=jnp.int32) \
      - jnp.sum(valid & (old > 0), dtype=jnp.int32)
  # The tree update below writes in place: order the read of the old leaves before it.
  tree = inplace.tie(tree, inplace.never(old))
  return trees.refresh_sum(tree, safe, values, valid), positive


def draw(spec: TrajectorySpec, state: TrajectoryState, rng, b: int, replace: bool):
  """``(w int32[b] in range, valid bool[b], num_eligible, probability float32[b])``."""
  tree = state.weight_tree
  # Read once (a slice is re-fused into each consumer, and each copy would be a read that
  # ``sample``'s ordering flag does not cover; see ``inplace.once``).
  total = inplace.once(tree[1])
  # The item table's exact successive sampling (``sampling.exact.successive``): the same
  # draws, first B distinct, and the same transcendental-free completion.
  picked = exact.successive(tree, rng, b, replace, spec.tree_size)
  picked = jnp.where(picked >= 0, jnp.minimum(picked, spec.num_windows - 1), -1)
  valid = picked >= 0
  w = jnp.maximum(picked, 0)
  prob = fixedpoint.divide(trees.leaf_values(tree, w), jnp.maximum(total, numerics.MIN_TOTAL))
  return w, valid, state.positive, prob
