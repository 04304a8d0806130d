"""Device-resident complete binary trees over the table's slots.

All trees are flat arrays of length ``2P`` (``P`` = next power of two >=
capacity): node 1 is the root, node ``n`` has children ``2n`` and ``2n+1``,
and slot ``s`` is leaf ``P + s``. Index 0 is unused.

* Sum trees (int32 counts or float32 weights) give O(log C) prefix-sum
  descents: the k-th occupied or free slot, or a slot drawn proportionally to
  its weight (``weight_descent``).
* Arg-best trees hold, at every node, the slot of the best leaf below it
  under a comparator (oldest key, lowest priority, ...), or -1. The root is
  the remover's next victim.

Updates touch the ``log2 P`` ancestors of the changed leaves (and, in a float
sum tree, every node of the top few levels, at most ``2**_DENSE_MAX``), so a
batch of B changes costs O(B log C). Every internal node is *recomputed*
from its two children (never adjusted by a delta), so float sums cannot drift:
each node is always exactly ``fl(left + right)`` of its current children.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import inplace


def depth(tree_size: int) -> int:
  return max(0, tree_size.bit_length() - 1)


def build_sum(leaves: jnp.ndarray) -> jnp.ndarray:
  """A sum tree over ``leaves[P]`` (P a power of two). O(P)."""
  p = leaves.shape[0]
  levels = [leaves]
  while levels[-1].shape[0] > 1:
    cur = levels[-1]
    levels.append(cur[0::2] + cur[1::2])
  pad = jnp.zeros((1,), leaves.dtype)
  tree = jnp.concatenate([pad] + levels[::-1])
  assert tree.shape[0] == 2 * p
  return tree


def refresh_sum(tree: jnp.ndarray, slots: jnp.ndarray, values: jnp.ndarray,
                valid: jnp.ndarray | None = None, dense: int | None = None) -> jnp.ndarray:
  """Set leaves ``slots`` to ``values`` and recompute their ancestors.

  The changed paths are recomputed up to depth ``dense`` (default
  ``dense_depth(K)``), and every node above it from the nodes at that depth:
  O(K log P + 2**dense) work, each node ``fl(left + right)`` as always.

  Args:
    tree: ``[2P]`` sum tree.
    slots: int32 ``[K]``; entries with ``valid=False`` are ignored.
    values: ``[K]`` new leaf values. Duplicate slots must carry equal values.
    valid: optional bool ``[K]``.
    dense: static; the depth from which every node above is recomputed.
  """
  p = tree.shape[0] // 2
  if valid is None:
    valid = jnp.ones(slots.shape, bool)
  leaf = jnp.where(valid, p + slots, 2 * p)  # out of range -> dropped
  tree = tree.at[leaf].set(values.astype(tree.dtype), mode="drop")
  block = _BLOCK if slots.shape[0] <= _FEW else _BLOCK_MANY
  if dense is None:
    dense = dense_depth(slots.shape[0])
  dense = min(dense, depth(p))
  tree = _recompute_in_blocks(tree, jnp.where(valid, p + slots, p), valid, block,
                              stop=dense)
  return _recompute_top(tree, dense)


def dense_depth(k: int) -> int:
  """The depth above which ``refresh_sum`` of ``k`` leaves recomputes every node (static):
  about ``2**_DENSE_MARGIN`` nodes per leaf, at most ``2**_DENSE_MAX`` in all."""
  return max(0, min((k - 1).bit_length() + _DENSE_MARGIN, _DENSE_MAX))


def _recompute_top(tree, dense: int):
  """Every node above depth ``dense`` recomputed from the nodes at that depth, level by
  level (``build_sum``: the same ``left + right`` as a sparse recompute, so unchanged
  nodes keep their bits). O(2**dense), one update of the tree's first ``2**dense``."""
  if dense == 0:
    return tree
  base = tree[1 << dense: 2 << dense]
  top = build_sum(base)[1:1 << dense]
  if top.dtype.itemsize == 4:
    # Computed once (a reduction, which XLA never fuses into consumers), so that no later
    # read of the top (a sample's ``tree[1]``) is re-fused into a read of the old tree
    # that the update below must wait for: XLA:CPU in jax 0.11 copied the tree twice a
    # step for it (a one-row prioritized insert, then a sample, in a scan; BUILD.md "On
    # XLA:GPU (second measurements)" item 6). The same values.
    top = lax.bitcast_convert_type(
        inplace.materialize(lax.bitcast_convert_type(top, jnp.int32)), top.dtype)
  return lax.dynamic_update_slice_in_dim(tree, top, 1, 0)


# Levels recomputed per gather/scatter pair. Each array operation has a fixed
# cost on CPU that dominates small batches (a one-item insert into a 1M-slot
# prioritized table: 66 -> 17 us for the weight tree with 4 levels per pair);
# for more leaves the extra nodes moved cost more, and 2 levels per pair
# measured best for K = 256 in a scan (prioritized sample + update_priorities:
# ~1.2x the speed of one level per pair, and of 3 or 4; CPU-time A/B, loaded VM).
_FEW, _BLOCK, _BLOCK_MANY = 128, 4, 2

# Above a depth where the K changed paths cover most nodes anyway, ``refresh_sum``
# recomputes every node from one level (``_recompute_top``): a few thousand adds in one
# or two operations instead of a gather and a scatter per pair of levels, each a fixed
# cost on CPU. 2**_DENSE_MARGIN nodes per changed leaf at the dense level measured best
# in a scan, C = 262,144 (BUILD.md finding 25): a prioritized insert of 1 / 16 rows
# 5.4 -> 3.0 / 22.8 -> 15.4 us, sample 256 + update_priorities 291 -> 247 us; 2 or 4 gave
# less for small K, 8 more for K = 256. At most 2**_DENSE_MAX nodes (64 KB of float32):
# XLA:CPU splits an operation that reads more than 256 KB across its threads.
_DENSE_MARGIN, _DENSE_MAX = 6, 14


# Up to this many leaves, ``_blocks`` reads each block with its own dynamic slice. XLA:CPU
# prices a gather by the operand it reads, so a gather of a few blocks from a tree over
# 256 KB is split across its threads, a hand-off each time (BUILD.md "Lean portable
# programs", finding 14); a dynamic slice is priced by what it reads. Measured in-scan,
# C = 262,144: a prioritized update of 1 / 4 / 8 rows 11 -> 1.0 / 1.6 / 2.5 us a step.
# XLA fuses up to 8 such slices into one operation; at 16 each became its own (57 -> 133
# fusions in the insert, also in chunks of 8), so beyond 8 rows: one (split) gather.
_SLICED = 8


def _blocks(tree, starts, width: int):
  """``tree[starts[i] : starts[i] + width]`` stacked: ``[K, width]``."""
  if starts.shape[0] > _SLICED:
    return tree[starts[:, None] + jnp.arange(width)[None, :]]
  return jnp.stack([lax.dynamic_slice_in_dim(tree, starts[i], width)
                    for i in range(starts.shape[0])])


def _recompute_in_blocks(tree, leaf, valid, block: int = _BLOCK, stop: int = 0):
  """Recompute the ancestors of ``leaf`` (tree indices ``[K]``) ``block`` levels at a time.

  Each step gathers the ``2**k`` final nodes under the ancestor ``k`` levels
  up and rewrites every node between them and it, each as ``left + right``
  of its children: the same float operations in the same order as a
  level-by-level recompute, so the result is bit-identical. Nodes off the
  changed paths are rewritten with the values they already hold.
  """
  p = tree.shape[0] // 2
  done, levels = 0, depth(p) - stop
  while done < levels:
    k = min(block, levels - done)
    top = leaf >> (done + k)
    vals = _blocks(tree, top << k, 1 << k)
    outs, idxs = [], []
    for j in range(1, k + 1):
      vals = vals[:, 0::2] + vals[:, 1::2]
      idx = (top << (k - j))[:, None] + jnp.arange(1 << (k - j))[None, :]
      outs.append(vals)
      idxs.append(jnp.where(valid[:, None], idx, 2 * p))
    tree = tree.at[jnp.concatenate(idxs, 1).reshape(-1)].set(
        jnp.concatenate(outs, 1).reshape(-1), mode="drop")
    done += k
  return tree


def refresh_count(tree: jnp.ndarray, slots: jnp.ndarray, values: jnp.ndarray,
                  valid: jnp.ndarray | None = None) -> jnp.ndarray:
  """``refresh_sum`` for integer count trees, in one gather and one scatter-add.

  Each changed leaf's delta is added to the leaf and all its ancestors at
  once: integer sums are exact, so the result equals a level-by-level
  recompute, at two array operations instead of ``2 log2 P`` (which is what
  dominates a small insert on CPU, where every operation has a fixed cost).

  Args:
    tree: ``[2P]`` integer sum tree in which every internal node equals the
      sum of its children.
    slots: int32 ``[K]``; the valid entries must be distinct (every caller
      passes deduplicated slots); entries with ``valid=False`` are ignored.
    values: ``[K]`` new leaf values.
    valid: optional bool ``[K]``.
  """
  p = tree.shape[0] // 2
  if valid is None:
    valid = jnp.ones(slots.shape, bool)
  leaf = p + jnp.where(valid, slots, 0)
  return add_count(tree, slots, values.astype(tree.dtype) - tree[leaf], valid)


def add_count(tree: jnp.ndarray, slots: jnp.ndarray, delta: jnp.ndarray,
              valid: jnp.ndarray | None = None) -> jnp.ndarray:
  """``delta`` added to the leaves ``slots`` of an integer count tree and to all their
  ancestors, in one scatter-add (``refresh_count`` when the caller knows the old leaf
  values: no gather of the tree).

  Args:
    tree: ``[2P]`` integer sum tree.
    slots: int32 ``[K]``, the valid entries distinct.
    delta: ``[K]`` change of each leaf.
    valid: optional bool ``[K]``; entries with False are ignored.
  """
  p = tree.shape[0] // 2
  if valid is None:
    valid = jnp.ones(slots.shape, bool)
  leaf = p + jnp.where(valid, slots, 0)
  delta = jnp.where(valid, delta.astype(tree.dtype), 0)
  levels = jnp.arange(depth(p) + 1, dtype=jnp.int32)[:, None]
  nodes = jnp.where(valid[None, :], leaf[None, :] >> levels, 2 * p)  # leaf .. root
  return tree.at[nodes.reshape(-1)].add(
      jnp.broadcast_to(delta[None, :], nodes.shape).reshape(-1), mode="drop")


def add_one(tree: jnp.ndarray, slots: jnp.ndarray, where: jnp.ndarray) -> jnp.ndarray:
  """1 added to the leaves ``slots`` (int32 ``[K]``, distinct where ``where``) of an integer
  count tree ``[2P]`` where ``where`` (bool ``[K]``), and to all their ancestors, by one
  scatter-add whose only computed operand is the node indices (``add_count`` with
  deltas of 1 and 0, one operation fewer; neither gathers the tree).

  The entries not added go out of range (dropped), and the added values are a constant
  literal: ones for the ``depth + 1`` levels and a last, always dropped, row of zeros, so
  that the constant is not uniform (XLA turns a uniform constant into a broadcast, which
  it runs as one more operation each step of a scan; ``add_count``'s computed values are
  one more too: XLA:CPU's executor pays per operation, BUILD.md finding 15)."""
  p = tree.shape[0] // 2
  d = depth(p) + 1
  # numpy constants: literals in the program (an iota-based mask is hoisted out of a
  # ``lax.scan`` as an operation run on every call, see ledger_update).
  levels = np.arange(d + 1, dtype=np.int32)[:, None]
  live = where[None, :] & (levels < d)
  nodes = jnp.where(live, (p + slots[None, :]) >> levels, 2 * p)  # leaf .. root, dropped
  ones = np.repeat((levels[:, 0] < d).astype(tree.dtype), slots.shape[0])
  return tree.at[nodes.reshape(-1)].add(ones, mode="drop")


def total(tree: jnp.ndarray) -> jnp.ndarray:
  return tree[1]


def leaf_values(tree: jnp.ndarray, slots: jnp.ndarray) -> jnp.ndarray:
  return tree[tree.shape[0] // 2 + slots]


def descend_count(tree: jnp.ndarray, k: jnp.ndarray, free: bool) -> jnp.ndarray:
  """The k-th (0-based) occupied slot, or the k-th free slot if ``free``.

  ``tree`` is an int32 occupancy count tree; ``k`` int32 ``[M]`` must be below
  the number of occupied (or free) slots.
  """
  p = tree.shape[0] // 2
  node = jnp.ones(k.shape, jnp.int32)
  child_size = p
  for _ in range(depth(p)):
    child_size //= 2
    left = 2 * node
    cnt = tree[left]
    if free:
      cnt = child_size - cnt
    go_right = k >= cnt
    k = jnp.where(go_right, k - cnt, k)
    node = left + go_right.astype(jnp.int32)
  return node - p


def count_below(tree: jnp.ndarray, pos) -> jnp.ndarray:
  """int32[]: the sum of the leaves before ``pos`` (int32[], in ``[0, P]``) of a count tree.

  Up from the leaf ``pos``: each level adds the left sibling where the path is a right
  child. ``depth(P)`` scalar reads whose addresses do not depend on one another
  (``(P + pos) >> level``), O(log P)."""
  p = tree.shape[0] // 2
  pos = jnp.asarray(pos, jnp.int32)
  # pos == P (every leaf before it) is the root's count; below it the walk starts at leaf pos.
  node = p + jnp.minimum(pos, p - 1)
  total = jnp.int32(0)
  for level in range(depth(p)):
    n = node >> level
    total = total + jnp.where((n & 1) == 1, tree[n - 1], 0)
  return jnp.where(pos >= p, tree[1], total)


# --- arg-best trees ---------------------------------------------------------

Better = Callable[[jnp.ndarray, jnp.ndarray], jnp.ndarray]
"""``better(a, b)``: bool array, True where slot ``a`` beats slot ``b``
(both valid slot indices)."""


def _combine(better: Better, a: jnp.ndarray, b: jnp.ndarray) -> jnp.ndarray:
  a_ok, b_ok = a >= 0, b >= 0
  safe_a, safe_b = jnp.maximum(a, 0), jnp.maximum(b, 0)
  take_a = a_ok & (~b_ok | better(safe_a, safe_b))
  return jnp.where(take_a, a, b)


def build_best(present: jnp.ndarray, better: Better) -> jnp.ndarray:
  """Arg-best tree over slots where ``present[P]`` is True. O(P)."""
  p = present.shape[0]
  levels = [jnp.where(present, jnp.arange(p, dtype=jnp.int32), -1)]
  while levels[-1].shape[0] > 1:
    cur = levels[-1]
    levels.append(_combine(better, cur[0::2], cur[1::2]))
  return jnp.concatenate([jnp.full((1,), -1, jnp.int32)] + levels[::-1])


def refresh_best(tree: jnp.ndarray, slots: jnp.ndarray, present: jnp.ndarray,
                 better: Better, valid: jnp.ndarray | None = None) -> jnp.ndarray:
  """Re-evaluate leaves ``slots`` (present or not) and their ancestors."""
  p = tree.shape[0] // 2
  if valid is None:
    valid = jnp.ones(slots.shape, bool)
  leaf = jnp.where(valid, p + slots, 2 * p)
  tree = tree.at[leaf].set(jnp.where(present, slots, -1).astype(jnp.int32), mode="drop")
  node = jnp.where(valid, p + slots, 1)
  for _ in range(depth(p)):
    node = jnp.maximum(node // 2, 1)
    tree = tree.at[node].set(_combine(better, tree[2 * node], tree[2 * node + 1]))
  return tree


def best(tree: jnp.ndarray) -> jnp.ndarray:
  """The best slot overall, or -1 if no leaf is present."""
  return tree[1]

