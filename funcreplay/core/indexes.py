"""Keeping the device trees in step with the slot columns.

The slot columns (``occupied``, ``priority``, ``key``...) are the truth; the
trees are indexes over them. Every mutation calls ``refresh`` with the slots
it touched (O(K log C)), or ``rebuild`` after an O(C) sweep such as
``evict_stale``.
"""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import inplace, item_info, ordering, position_index, powers, staleness, trees
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def sample_weight(spec: TableSpec, occupied, priority):
  """Sampling weight of a slot for the prioritized sampler: ``p**alpha`` (0 if free or
  ``p <= 0``), by ``powers.power``: the same bits on every backend and in the kernels."""
  w = powers.power(priority, spec.sampler.priority_exponent)
  return jnp.where(occupied, w, 0.0).astype(jnp.float32)


def tiny_weights(spec: TableSpec) -> bool:
  """Static: a positive total weight of ``spec``'s sampler may lie below 2**-102 (where
  ``bits.uniform24_times`` needs its exact form). Not with an exponent <= 1: a positive
  priority counts at least ``numerics.TINY`` (``powers``), so every positive weight is at
  least ``TINY**alpha >= TINY`` = 1e-30."""
  return not spec.prioritized or spec.sampler.priority_exponent > 1


def _padded(x, p, fill):
  return jnp.concatenate([x, jnp.full((p - x.shape[0],), fill, x.dtype)])


ALL_TREES = ("occ_tree", "weight_tree", "remover_tree")


def zero_weight_count(spec: TableSpec, state: TableState):
  """int32[]: occupied items whose sampling weight is 0 (``occ_tree[0]``, an otherwise
  unused node; kept for a prioritized sampler, 0 otherwise). Such items are not
  eligible: a table's eligible count is ``size - zero_weight_count``."""
  return state.occ_tree[0] if spec.prioritized else jnp.int32(0)


def refresh(spec: TableSpec, state: TableState, slots, valid=None,
            which=ALL_TREES, count_zero: bool = True) -> TableState:
  """Re-derive the leaves at ``slots`` (int32[K]) of the ``which`` trees from the columns.

  The valid entries of ``slots`` must be distinct (callers deduplicate).
  ``count_zero``: keep ``zero_weight_count`` in step, from the old leaves
  (``sample`` passes False: it refreshes leaves it zeroed for its draws, and
  the items it frees all had a positive weight).
  """
  if valid is None:
    valid = jnp.ones(slots.shape, bool)
  if slots.shape[0] == 1:
    # One slot would make every per-level update a dynamic slice, which XLA
    # re-fuses into several reads and then copies the whole tree; a second,
    # invalid entry keeps them real scatters (see ops.take).
    slots = jnp.concatenate([slots, slots])
    valid = jnp.concatenate([valid, jnp.zeros((1,), bool)])
  safe = jnp.where(valid, slots, 0)
  occ = state.occupied[safe]
  occ_tree = state.occ_tree
  if spec.prioritized and count_zero and "weight_tree" in which:
    p = spec.tree_size
    # Read once off the CPU: XLA:GPU re-fused these gathers into the count's reduction,
    # not ordered before the trees' writes below, and copied both trees (a prioritized
    # table's delete; experiments/accel_pytest.py). On the CPU the same program.
    old_occ, old_w = inplace.once_off_cpu((occ_tree[p + safe], state.weight_tree[p + safe]))
    new_w = sample_weight(spec, occ, item_info.at(state.item_info, safe, "priority"))
    delta = (jnp.sum(valid & occ & (new_w <= 0), dtype=jnp.int32)
             - jnp.sum(valid & (old_occ > 0) & (old_w <= 0), dtype=jnp.int32))
    # The tree updates below write in place: order these reads before them.
    state = state.replace(weight_tree=inplace.tie(state.weight_tree, inplace.never(old_w)))
    occ_tree = inplace.tie(occ_tree, inplace.never(old_occ))
    occ_tree = occ_tree.at[jnp.array([0, 2 * p])].add(jnp.stack([delta, 0]), mode="drop")
  if "occ_tree" in which:
    if spec.position_index:  # in step with the count tree
      state = state.replace(position_index=position_index.sync(
          state.position_index, safe, valid, occ))
    occ_tree = trees.refresh_count(occ_tree, safe, occ.astype(jnp.int32), valid)
  weight_tree = state.weight_tree
  if spec.prioritized and "weight_tree" in which:
    w = sample_weight(spec, occ, item_info.at(state.item_info, safe, "priority"))
    weight_tree = trees.refresh_sum(weight_tree, safe, w, valid)
  remover_tree = state.remover_tree
  if spec.needs_remover_tree and "remover_tree" in which:
    better = ordering.better_fn(spec.remover, state)
    remover_tree = trees.refresh_best(remover_tree, safe, occ, better, valid)
  new = dict(occ_tree=occ_tree, weight_tree=weight_tree, remover_tree=remover_tree)
  # The weight and remover trees' refreshes read item_info (priorities, keys) inside their
  # per-level updates; a later write of item_info (a sample's reuse count) must wait for
  # them, else XLA copies it. A root depends on every level: tie item_info to the roots
  # (O(1)), and those trees too (the roots' reads then precede the trees' next writes).
  # The occupancy tree reads only ``occupied``: no tie for it.
  readers = [name for name in ("weight_tree", "remover_tree")
             if name in which and new[name].size]
  if not readers:
    return state.replace(**new)
  flag = inplace.never([new[name][1] for name in readers])
  new.update({name: inplace.tie(new[name], flag) for name in readers})
  return state.replace(item_info=inplace.tie(state.item_info, flag), **new)


def rebuild(spec: TableSpec, state: TableState) -> TableState:
  """Rebuild every tree, the version index and the position index from the columns. O(C)."""
  p = spec.tree_size
  if spec.position_index:
    state = state.replace(position_index=position_index.rebuild(state.occupied))
  hist, bounds = staleness.rebuild(spec, state.version_hist, state.version_bounds,
                                   state.occupied, state.version)
  state = state.replace(version_hist=hist, version_bounds=bounds)
  occ = _padded(state.occupied, p, False)
  state = state.replace(occ_tree=trees.build_sum(occ.astype(jnp.int32)))
  if spec.prioritized:
    w = sample_weight(spec, state.occupied, state.priority)
    state = state.replace(weight_tree=trees.build_sum(_padded(w, p, 0.0)))
    zero = jnp.sum(state.occupied & (w <= 0), dtype=jnp.int32)
    state = state.replace(occ_tree=state.occ_tree.at[0].set(zero))
  if spec.needs_remover_tree:
    state = state.replace(remover_tree=remover_tree(spec, state))
  return state


def remover_tree(spec: TableSpec, state: TableState):
  """int32[2P]: the remover's arg-best tree of ``state``'s columns, built afresh (every
  node the better of its children by the remover's order; -1 where none). O(C)."""
  p = spec.tree_size
  better = ordering.better_fn(spec.remover, _PaddedView(state, p))
  return trees.build_best(_padded(state.occupied, p, False), better)


class _PaddedView:
  """Columns padded to the tree size, so comparators can index padding leaves."""

  def __init__(self, state, p):
    self.next_key = state.next_key
    self.key = _padded(state.key, p, 0)
    self.priority = _padded(state.priority, p, 0.0)
    if state.touched.size:  # stamps padded to P, the clock kept last (ordering.touch_age)
      c = state.key.shape[0]
      t = state.touched
      self.touched = jnp.concatenate([_padded(t[:c], p, 0), t[c:]])
