"""``Fifo`` / ``Lifo`` sampling from a ring: the B oldest (newest) items without a sort.

Applies (``applies``) when the sampler is ``Fifo`` or ``Lifo``, the remover the plain
ring (``Fifo()``, ``selectors.is_ring``) and no ``where`` or staleness mask, so that
eligible means occupied: Reverb's queue (``fr.queue``) and a Lifo sampler over a
FIFO-evicted buffer. The general ordered sample selects among all C slots by (eligible,
age), O(C) top-k passes a call (``ordering.first_eligible``; it was a sort of the table,
9.6 ms a step of a 65,536-slot queue in a scan, sample 64 + insert 64, on the 2-core
VM); this is O(B log P) and returns the same slots in the same order
(tests/core/test_ring_order.py).

Why no sort is needed. The ring writes insert ``n`` at slot ``(w0 + n) mod C`` and never
fills a hole (``ops.insert``, ``insert_lean``; a grown checkpoint keeps the order,
``checkpoint.migrate``), so the item in slot ``s`` was inserted the last time the write
position passed ``s``. Read cyclically from ``write_pos`` (the next slot written), the
slots were last passed in increasing order: the occupied ones, in that order, are the
items oldest first. With ``q`` occupied slots below ``write_pos`` and ``N`` in all
(``state.size``), the ``i``-th oldest item is the ``k``-th occupied slot for
``k = (q + i) mod N`` and the ``i``-th newest for ``k = (q - 1 - i) mod N``: one count
below ``write_pos`` (``trees.count_below``, O(log P)) and a descent per row
(``uniform_lean.kth_occupied``, O(log P)). Rows ``i >= N`` are invalid (slot -1), as in
the general program.
"""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import inplace, trees
from funcreplay.core import selectors as sel
from funcreplay.core.inplace import materialize
from funcreplay.core.sampling.uniform_lean import kth_occupied
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def applies(spec: TableSpec, *, masked: bool) -> bool:
  """True when ``pick`` gives the general ordered sample's slots (static)."""
  return (type(spec.sampler) in (sel.Fifo, sel.Lifo) and sel.is_ring(spec.remover)
          and not masked)


def pick(spec: TableSpec, state: TableState, batch_size: int):
  """``(picked int32[B], num_eligible int32[])``: the ``B`` oldest (``Fifo``) or newest
  (``Lifo``) occupied slots in that order, -1 past the ``N`` items."""
  # The size (occ_tree[1]) read once: XLA re-fuses a slice into each consumer, and a read
  # that feeds only ``num_eligible`` would be unordered with the sample's later writes of
  # the tree (a copy of it).
  n = inplace.once(state.size)
  q = trees.count_below(state.occ_tree, state.write_pos)
  i = jnp.arange(batch_size, dtype=jnp.int32)
  nn = jnp.maximum(n, 1)
  # ``%`` is Python's remainder (the divisor's sign): never negative here.
  k = (q + i) % nn if isinstance(spec.sampler, sel.Fifo) else (q - 1 - i) % nn
  valid = i < n
  # Materialized twice (``inplace.materialize``): k feeds every level of the descent, the
  # slots every later read and write (re-fused into those, the last level's byte reads
  # became one operation each: 64 more a step in a scan).
  slot = kth_occupied(state.occ_tree, materialize(jnp.where(valid, k, 0)), state.occupied)
  return materialize(jnp.where(valid, slot, -1)), n
