"""Lean ``update_priorities`` for tables without an order tree (bit for bit the general one).

Applies (``applies``) when the remover keeps no order tree (``Fifo`` or
``Uniform`` removers): then a priority change touches only ``priority``, the
weight sum tree and the ledger, so the program is one key-guard gather, one
packed sort of the K slots (last occurrence wins), one scatter and one
O(K log P) sum-tree refresh.
"""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import bits, indexes, inplace, item_info, powers, trees
from funcreplay.core import counters as ctr
from funcreplay.core.inplace import after, materialize
from funcreplay.core.ops.rows import count_read, holds_key
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def applies(spec: TableSpec) -> bool:
  """True when ``update_priorities`` below may replace ``ops.update_priorities`` (static):
  no order tree (a ``Fifo`` or ``Uniform`` remover)."""
  # Heap specs keep touch stamps (spec.touch_stamps), which only the general update writes.
  return not spec.needs_remover_tree and not spec.touch_stamps


def update_priorities(spec: TableSpec, state: TableState, slots, keys, priorities):
  """``ops.update_priorities`` for tables without an order tree, bit for bit.

  Key guard (the slot must still hold ``keys``), last occurrence wins (one
  packed sort of the K slots), bad priorities stored as 0 and counted, then
  one float sum-tree refresh of the K leaves (O(K log P), never drifting).
  """
  if not applies(spec):
    raise ValueError("lean update_priorities: the remover keeps an order tree.")
  cap = spec.capacity
  slots = jnp.asarray(slots, jnp.int32)
  k = slots.shape[0]
  keys = jnp.broadcast_to(jnp.asarray(keys, jnp.uint32), slots.shape)
  p = jnp.broadcast_to(jnp.asarray(priorities, jnp.float32), slots.shape)
  in_range = (slots >= 0) & (slots < cap)
  safe = jnp.where(in_range, slots, 0)
  # The key guard's gathers, read once (``materialize``: XLA would re-fuse them into each
  # consumer) and ordered before a later insert's writes of ``occupied`` / ``key``: the
  # returned ``write_pos`` (behind every insert write) depends on them (``after``), else
  # XLA copies both columns.
  guard = materialize((in_range & holds_key(state, safe, keys)).astype(jnp.int32))
  ok = guard > 0
  # Last valid occurrence of each slot: sort (slot, row) pairs, keep each run's last.
  s_slot, s_row = bits.sort_pairs(jnp.where(ok, safe, cap), cap + 1)
  last_sorted = jnp.concatenate([s_slot[1:] != s_slot[:-1], jnp.ones((1,), bool)])
  win = jnp.zeros((k,), bool).at[s_row].set(last_sorted, unique_indices=True) & ok
  bad = ~jnp.isfinite(p) | (p < 0)
  clean = jnp.where(bad, 0.0, p)
  c = dict(state.counters)
  c["invalid_priorities"] = ctr.add(c["invalid_priorities"],
                                    jnp.sum(bad & win, dtype=jnp.uint32))
  tree = state.weight_tree
  occ_tree = state.occ_tree
  written = clean
  if spec.prioritized:
    w = indexes.sample_weight(spec, jnp.ones((k,), bool), clean)
    # Keep the zero-weight count (occ_tree[0], see indexes.zero_weight_count) in step. The
    # winners' old weights come from their priority column (a read of the weight tree would
    # make XLA copy the tree); the priority write below is ordered after that read.
    # Counted where read (rows.count_read: no gather split across XLA:CPU's threads, and
    # for K = 1 no dynamic slice re-fused into consumers the ordering below does not cover).
    alpha = spec.sampler.priority_exponent  # powers.positive: no power for alpha <= 1
    delta = (jnp.sum(win & (w <= 0), dtype=jnp.int32)
             - count_read(lambda s: item_info.at(state.item_info, s, "priority"), safe, win,
                          lambda q: ~powers.positive(q, alpha)))
    # A two-index scatter (the second out of range, dropped): a one-index one becomes a
    # dynamic-update-slice that XLA fuses into later reads, copying the tree (indexes.refresh).
    occ_tree = occ_tree.at[jnp.array([0, 2 * spec.tree_size])].add(
        jnp.stack([delta, 0]), mode="drop")
    written = after(clean, delta)
  at, values = jnp.where(win, safe, cap), written
  if k == 1:  # a two-index scatter (the second dropped): one index becomes a slice update
    at, values = jnp.concatenate([at, at + cap]), jnp.concatenate([values, values])
  info = item_info.put_field(state.item_info, at, "priority", values, mode="drop")
  max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(win, clean, 0.0), initial=0.0))
  if spec.prioritized:
    if k == 1:  # keep the per-level updates real scatters (see indexes.refresh)
      safe, w, win = (jnp.concatenate([a, a]) for a in (safe, w, win))
      win = win & jnp.asarray([True, False])
    tree = trees.refresh_sum(tree, safe, w, win)
  return state.replace(item_info=info, weight_tree=tree, occ_tree=occ_tree, counters=c,
                       max_priority=max_p,
                       write_pos=after(state.write_pos, inplace.witness(guard)))
