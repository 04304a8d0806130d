"""Freeing the items a sample used up (``max_times_sampled``), for the lean uniform and
ring-order samples (``uniform_lean.finish``).

An item is freed by the sample that brings its reuse count to
``spec.max_times_sampled``, so every occupied item is below the limit: eligible still
means occupied, and the lean draw (positions among the occupied slots) stays exact
with a reuse limit. What changes is the bookkeeping after the draw,
the general ``sampling.finish``'s and the native kernel's (``RunSample`` in
csrc/sample_core.h) to the bit:

- a valid row whose count (after this sample's increments) reached the limit frees its
  slot; with ``replace`` a slot drawn twice is freed once (its last row);
- ``occupied`` goes False there and the trees are refreshed at those slots (on the
  ring, the occupancy tree gets -1 at the leaf and every ancestor without a read: the
  slot was occupied, it was drawn); the staleness index forgets their versions;
- counters ``evicted_reuse`` (freed items) and ``removed_reuse_sum`` (their counts).

O(B log C); no condition, no loop. The item rows stay as they are (free slots are
overwritten by later inserts), as in the general program.
"""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import indexes, position_index, staleness, trees
from funcreplay.core import ledger_update as ledger
from funcreplay.core import selectors as sel
from funcreplay.core.indexes import ALL_TREES
from funcreplay.core.ops.rows import last_occurrence
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def used_up(spec: TableSpec, slot, valid, times, replace: bool):
  """bool[B]: the valid rows whose reuse count ``times`` (after this sample's increments)
  reached ``spec.max_times_sampled``; with ``replace`` only a slot's last row (a slot
  drawn twice is freed once). The rule of ``free`` and of the general finish."""
  gone = valid & (times >= spec.max_times_sampled)
  return last_occurrence(slot, gone) if replace else gone


def free(spec: TableSpec, state: TableState, slot, valid, rows, replace: bool):
  """``(state, ledger adds)`` with the used-up items of a sample freed.

  Args:
    slot: int32[B] in range (any value where not ``valid``).
    valid: bool[B], the sample's valid rows.
    rows: the rows' ``item_info`` fields (``item_info.unpack``) read after this
      sample's increments of ``times_sampled``.
    replace: the batch may repeat a slot.
  Returns the state (``occupied``, trees, staleness index) and the two counters' adds
  for ``ledger_update.update``.
  """
  times = rows["times_sampled"]
  gone = used_up(spec, slot, valid, times, replace)
  cap = spec.capacity
  idx = jnp.where(gone, slot, cap)
  if idx.shape[0] == 1:  # keep it a scatter, not a slice update (see ops.take)
    idx = jnp.concatenate([idx, jnp.full((1,), cap, idx.dtype)])
  state = state.replace(occupied=state.occupied.at[idx].set(False, mode="drop"))
  if spec.max_staleness is not None:
    hist, bounds = staleness.on_remove(spec, state.version_hist, state.version_bounds,
                                       rows["version"], gone)
    state = state.replace(version_hist=hist, version_bounds=bounds)
  trees_left = ALL_TREES
  if sel.is_ring(spec.remover):
    # A freed slot was occupied (it was drawn): -1 to its leaf and every ancestor, no
    # read of the tree or of ``occupied``. Only on the ring: with the other removers'
    # inserts (free slots from the tree, victims from the remover tree) XLA then copied
    # ``occupied`` twice a step of a sample-then-insert scan, and the refresh's read of
    # the new ``occupied`` does not; on the ring it is the refresh that made it copy.
    if spec.position_index:  # the non-ring removers' refresh below keeps it
      state = state.replace(position_index=position_index.drop(
          state.position_index, slot, gone))
    state = state.replace(occ_tree=trees.add_count(state.occ_tree, slot,
                                                   jnp.full(slot.shape, -1), gone))
    trees_left = ("weight_tree", "remover_tree")
  trees_left = tuple(name for name in trees_left if getattr(state, name).size)
  if trees_left:
    # Drawn items had a positive weight: the zero-weight count does not move.
    state = indexes.refresh(spec, state, slot, gone, which=trees_left, count_zero=False)
  adds = {"evicted_reuse": ledger.count(jnp.sum(gone, dtype=jnp.uint32)),
          "removed_reuse_sum": ledger.total(times, gone)}
  return state, adds
