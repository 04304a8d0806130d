"""Draws proportional to weight: descents of a float32 sum tree (``trees``), two stages.

A one-stage descent takes a target ``u * total`` (``u`` a float32 uniform in [0, 1)) and
walks down to the leaf whose prefix-sum interval contains it. A float32 target takes at
most 2**24 values across the whole tree, so each leaf is drawn with its share rounded to a
multiple of 2**-24: among 2**20 equal weights 16 or 17 target values a leaf, probabilities
6% apart; from 2**24 leaves on, some leaves are never drawn (float32 uniforms in any
library have this limit; flashbax's sum tree too).

Two stages fix the scale. The descent draws its target afresh at the node it reached at
depth ``redraw_depth`` (``fresh * node's sum``, ``fresh`` a second, independent uniform),
so the first stage rounds a node's share of the total to 2**-24 and the second a leaf's
share of its node to 2**-24 of the node. Neither stage spans more than half the levels
plus 2, so the realised probability of a leaf is ``w / W`` times ``1 + e`` with ``|e|``
within a few ``2**(max(D, L - D) - 24)`` for ``L`` levels, redraw depth ``D`` and
comparable weights. Counted exactly over every value of both uniforms, weights in
[0.5, 1.5): 4.1e-5 at 2**16 leaves (``tests/core/test_weight_descent.py`` checks it),
4.1e-4 at 2**20 (1.3e-4 for equal weights), where one stage gave 6% among 2**20 equal
weights. Stratified draws take one stage (``fresh=None``): a stratum's target must pick
the leaf.

Invariants (both descents, and the native ``DescendWeight``, bit for bit):

* Only ``u >= left``, ``u - left``, ``fresh * sum`` and the stored nodes: no float sum
  whose order a compiler chooses (the callers' targets are one product,
  ``bits.uniform24_times``, which XLA cannot reassociate). A
  zero-weight subtree is never entered, so while the total is positive no zero-weight
  leaf is drawn, and the node at the redraw has a positive sum.
* O(log P) per target; one more multiply and one more random word than one stage.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
from jax import lax

from funcreplay.core import inplace, trees

# A multiple of 4: a step boundary of the blocked descent at 1, 2 and 4 levels a step (CPU
# and accelerators), which then needs no extra step for it.
REDRAW_ALIGN = 4


def redraw_depth(tree_size: int) -> int:
  """The depth at which a weight descent redraws its target: the multiple of 4 nearest
  half the depth, ``4 * ((depth + 4) // 8)``, so neither stage spans more than
  ``depth // 2 + 2`` levels; 0 (no redraw) below 256 leaves, where 2**-24 is already
  below 2**-16 of any equal share. ``native/csrc/draw.h`` ``RedrawDepth`` is the same rule."""
  d = trees.depth(tree_size)
  if d < 2 * REDRAW_ALIGN:
    return 0
  return REDRAW_ALIGN * ((d + REDRAW_ALIGN) // (2 * REDRAW_ALIGN))


def _redrawn(fresh, node_sum, materialize: Callable):
  """``fresh * node_sum`` (float32[M]), computed once: a backend that fused the product
  into the next level's subtraction (one fused multiply-add on a GPU: one rounding, not
  two) would descend differently from the same key."""
  return lax.bitcast_convert_type(materialize(lax.bitcast_convert_type(
      fresh * node_sum, jnp.int32)), jnp.float32)


def descend_weight(tree: jnp.ndarray, targets: jnp.ndarray,
                   fresh: jnp.ndarray | None) -> jnp.ndarray:
  """Slots drawn proportionally to the weights: ``targets`` (``[M]`` in [0, total)) pick
  the node at depth ``redraw_depth`` whose prefix-sum interval contains them, and
  ``fresh * that node's sum`` (``fresh``: float32 ``[M]`` uniforms in [0, 1), independent
  of ``targets``) the leaf below it (the module doc). Without a redraw (fewer than 256
  leaves) ``fresh`` is unused. ``fresh=None``: one stage, the target carried down to the
  leaf (``draw.draw_stratified``: each stratum's target must pick the leaf, or two strata
  could draw the same item of one node).

  Never returns a zero-weight leaf while the total is positive: at each node a
  child whose subtree sums to zero is never entered (this is what keeps
  zero-priority items unsampleable after any number of float updates); so the
  node at the redraw has a positive sum.
  """
  p = tree.shape[0] // 2
  redraw = redraw_depth(p)
  node = jnp.ones(targets.shape, jnp.int32)
  u = targets
  for level in range(1, trees.depth(p) + 1):
    left = 2 * node
    lsum = tree[left]
    rsum = tree[left + 1]
    go_right = (u >= lsum) & (rsum > 0) | (lsum <= 0)
    u = jnp.where(go_right, u - lsum, u)
    node = left + go_right.astype(jnp.int32)
    if level == redraw and fresh is not None:
      u = _redrawn(fresh, jnp.where(go_right, rsum, lsum), inplace.materialize)
  return node - p


def descend_weight_blocked(tree: jnp.ndarray, targets: jnp.ndarray, fresh: jnp.ndarray,
                           materialize: Callable, levels: int = 2,
                           top_depth: int = 13) -> jnp.ndarray:
  """``descend_weight``, bit for bit, ``levels`` binary levels per step.

  Each step reads the ``2**levels`` nodes ``levels`` levels below the current
  one (one aligned run: a single cache line, where a read of each level
  was one line per level), rebuilds the levels between as their pairwise
  sums (the stored nodes, bit for bit: every node is ``fl(left + right)``),
  and takes the same binary decisions, with the same float operations, among
  them. ``materialize`` (``inplace.materialize``) computes ``(node, target)``
  once between steps, else XLA recomputes every earlier step in each load.
  A step ends at the redraw depth, where the target is drawn afresh as in
  ``descend_weight``.
  In a scan, 2 levels per step measured ~1.3x the speed of ``descend_weight``
  for M = 384 targets (3 levels ~1.25x, 4 less, 6 slower than one level);
  reading only the deepest level then took the prioritized step from 267 to
  213 us (3 levels: 255; 4: several times slower; BUILD.md finding 25).
  """
  p = tree.shape[0] // 2
  node = jnp.ones(targets.shape, jnp.int32)
  u = targets
  left = trees.depth(p)
  redraw = redraw_depth(p)
  # The nodes down to depth ``top_depth`` are read from a copy of their own (64 KB):
  # XLA:CPU splits a fusion that reads an operand over 256 KB across 2 threads, and
  # under load each hand-off costs microseconds (the in-scan prioritized step measured
  # ~10% less CPU time than reading the tree throughout). O(2**top_depth), independent
  # of the capacity.
  top_depth = min(left, top_depth)
  top = tree
  if top_depth:
    top = lax.bitcast_convert_type(materialize(lax.bitcast_convert_type(
        tree[:2 << top_depth], jnp.int32)), tree.dtype)
  depth_now = 0
  while left:
    step = min(levels, left)
    if depth_now < redraw:
      step = min(step, redraw - depth_now)
    depth_now += step
    src = top if depth_now <= top_depth else tree
    # The nodes at depth ``step`` below ``node`` are node * 2**step + [0, 2**step): one
    # aligned run of 2**step floats (one cache line up to 16). The levels between are
    # their pairwise sums, which are the stored nodes bit for bit (every node is
    # fl(left + right) of its children, the module's invariant): one line read per step
    # instead of one per level.
    below = {(step, i): src[node * (1 << step) + i] for i in range(1 << step)}
    for d in range(step - 1, 0, -1):
      for i in range(1 << d):
        below[(d, i)] = below[(d + 1, 2 * i)] + below[(d + 1, 2 * i + 1)]
    r = jnp.zeros_like(node)  # the path so far, relative to ``node``
    for d in range(1, step + 1):
      lsum, rsum = jnp.zeros_like(u), jnp.zeros_like(u)
      for i in range(0, 1 << d, 2):
        here = 2 * r == i
        lsum = jnp.where(here, below[(d, i)], lsum)
        rsum = jnp.where(here, below[(d, i + 1)], rsum)
      go_right = (u >= lsum) & (rsum > 0) | (lsum <= 0)
      u = jnp.where(go_right, u - lsum, u)
      r = 2 * r + go_right.astype(jnp.int32)
    node = node * (1 << step) + r
    left -= step
    if depth_now == redraw:
      # The reached node's sum is the last decision's chosen child: a stored node.
      u = fresh * jnp.where(go_right, rsum, lsum)  # materialized just below
    if left:
      both = materialize(jnp.concatenate([node, lax.bitcast_convert_type(u, jnp.int32)]))
      node, u = both[:node.shape[0]], lax.bitcast_convert_type(both[node.shape[0]:], u.dtype)
  return node - p
