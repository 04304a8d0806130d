"""``update_priorities`` in one CPU kernel (``UpdatePrioritiesImpl``).

For tables without an order tree (``Fifo`` / ``Uniform`` remover) and
without a heap sampler (whose ``TableState.touched`` stamps only the portable
op keeps). The key guard, last-write-wins, sanitizing, the weight-tree
refresh and the ledger (``max_priority``, the ``invalid_priorities`` counter)
happen in the kernel; ``priority**alpha`` of the sanitized priorities is
computed here with the portable expression, so the tree matches the portable
path bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from funcreplay import native
from funcreplay.core import indexes
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def update_priorities(spec: TableSpec, state: TableState, slots, keys, priorities):
  """``slots`` int32[K], ``keys`` uint32[K], ``priorities`` float32[K] (as given)."""
  k = slots.shape[0]
  if spec.prioritized:
    bad = ~jnp.isfinite(priorities) | (priorities < 0)
    clean = jnp.where(bad, 0.0, priorities).astype(jnp.float32)
    weights = indexes.sample_weight(spec, jnp.ones((k,), bool), clean)
  else:
    weights = jnp.zeros((0,), jnp.float32)
  # item_info whole (uint32[C, 4]): the kernel checks each row's key and writes its
  # priority word in place.
  state_ops = [state.occupied, state.item_info, state.weight_tree, state.ledger, state.occ_tree]
  rows = [slots, keys, priorities, weights]
  call = jax.ffi.ffi_call(
      "funcreplay_update_priorities", [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state_ops],
      vmap_method="sequential",
      input_output_aliases=native.state_aliases(state_ops, len(rows)))
  occupied, item_info, weight_tree, ledger, occ_tree = native.keep_empty(call(
      *rows, *state_ops, capacity=spec.capacity, ledger=native.ledger_attr(spec)), state_ops)
  return state.replace(occupied=occupied, item_info=item_info, weight_tree=weight_tree,
                       ledger=ledger, occ_tree=occ_tree)
