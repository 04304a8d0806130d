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
the general program. A table without holes (``TableSpec.holes`` False; Reverb's queue
may be one, its Fifo sample uses items up oldest first) holds exactly the ``N`` slots
before ``write_pos``: the ``i``-th oldest is ``(write_pos - N + i) mod C``, the ``i``-th
newest ``(write_pos - 1 - i) mod C``, O(B) and no read of the tree.

``sample`` is the whole lean program: those slots, then the lean uniform sample's
bookkeeping (``uniform_lean.finish``: the same state as the general finish for the same
slots, tests/core/test_ring_order.py). Its reads are ordered before a later insert's
writes through ``write_pos`` (every ring write is at ``write_pos``) rather than by
``inplace.settle``'s two-row rewrite of every column: on a GPU each of those rewrites is
a kernel or two (the queue's step 38 -> 23 kernels, deviceless H200; BUILD.md finding 30).
"""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import inplace, trees
from funcreplay.core import selectors as sel
from funcreplay.core.inplace import materialize
from funcreplay.core.sampling.uniform_lean import finish, kth_occupied
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def applies(spec: TableSpec, *, version=None, where=None) -> bool:
  """True when ``pick`` gives the general ordered sample's slots and ``sample`` may
  replace the general ``sampling.sample`` (static): no ``where`` or staleness mask."""
  return (type(spec.sampler) in (sel.Fifo, sel.Lifo) and sel.is_ring(spec.remover)
          and where is None and (version is None or spec.max_staleness is None))


def pick(spec: TableSpec, state: TableState, batch_size: int):
  """``(picked int32[B], num_eligible int32[])``: the ``B`` oldest (``Fifo``) or newest
  (``Lifo``) occupied slots in that order, -1 past the ``N`` items."""
  slot, valid, n = _slots(spec, state, batch_size)
  return materialize(jnp.where(valid, slot, -1)), n


def sample(spec: TableSpec, state: TableState, rng, *, batch_size: int, version=None,
           replace: bool = False):
  """Lean ``Fifo`` / ``Lifo`` sample from the ring (see the module doc); ``(state,
  Sample)`` as ``sampling.sample``. ``rng`` is not used (the order is the items' age)."""
  del rng
  if replace or not applies(spec, version=version):
    raise ValueError("lean ring-order sample: needs a Fifo or Lifo sampler, the Fifo() ring "
                     "remover, no where or staleness mask and replace=False.")
  slot, valid, n = _slots(spec, state, batch_size)
  prob = jnp.ones((batch_size,), jnp.float32)
  return finish(spec, state, slot, valid, prob, n, version,
                n_valid=jnp.minimum(n, batch_size))


def _slots(spec: TableSpec, state: TableState, batch_size: int):
  """``(slot int32[B] in range, valid bool[B], n int32[])``: ``pick``'s slots, a real
  slot where not valid."""
  # The size (occ_tree[1]) read once: XLA re-fuses a slice into each consumer, and a read
  # that feeds only ``num_eligible`` would be unordered with the sample's later writes of
  # the tree (a copy of it).
  n = inplace.once(state.size)
  i = jnp.arange(batch_size, dtype=jnp.int32)
  valid = i < n
  if not spec.holes:
    # The items are the ring window of the n slots before write_pos (TableSpec.holes):
    # the i-th oldest is its i-th slot, the i-th newest the i-th back from write_pos.
    c, w = spec.capacity, state.write_pos
    ring = w - n + i if isinstance(spec.sampler, sel.Fifo) else w - 1 - i
    return materialize(jnp.where(valid, ring + c, 0) % c), valid, n
  q = trees.count_below(state.occ_tree, state.write_pos)
  nn = jnp.maximum(n, 1)
  # ``%`` is Python's remainder (the divisor's sign): never negative here.
  k = (q + i) % nn if isinstance(spec.sampler, sel.Fifo) else (q - 1 - i) % nn
  # Materialized twice (``inplace.materialize``): k feeds every level of the descent, the
  # slots every later read and write (re-fused into those, the last level's byte reads
  # became one operation each: 64 more a step in a scan).
  slot = kth_occupied(state.occ_tree, materialize(jnp.where(valid, k, 0)), state.occupied)
  # In range where not valid too (an empty table's descent ends past the capacity).
  return materialize(jnp.where(valid, slot, 0)), valid, n
