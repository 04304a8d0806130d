"""``insert`` for a ``Fifo``-remover table in one CPU kernel (``FifoInsertImpl``).

The arguments are prepared exactly as the portable ``ops.insert`` prepares
them (validated rows, sanitized priorities, ``priority**alpha`` for a
prioritized sampler); the kernel writes the rows at the ring position,
counts the overwritten items, keeps the ledger (ring position, next key,
counters, ``max_priority``, the rate limiter's diff), the occupancy and
weight trees and the staleness version index (in the portable order: advance the window,
remove the overwritten items, add the new ones). The result is bit-identical
to the portable path (tests/native/test_native_insert.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from funcreplay import native
from funcreplay.core import indexes, storage
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def insert(spec: TableSpec, state: TableState, items, mask, versions, prios, meta_rows,
           n_bad) -> TableState:
  """The portable ``ops.insert`` from the validated rows on (Fifo remover).

  ``n_bad``: uint32[], invalid priorities among the rows (counted in the
  ledger with everything else the insert changes there).
  """
  b = mask.shape[0]
  # Packed rows (core.storage): the items become one uint32[B, R] leaf here, one copy
  # per row in the kernel.
  item_leaves = ([storage.pack(spec.signature, True, items, 1)] if spec.packed_rows
                 else spec.signature.treedef.flatten_up_to(items))
  item_leaves = [jnp.asarray(x) for x in item_leaves]
  weights = (indexes.sample_weight(spec, jnp.ones((b,), bool), prios) if spec.prioritized
             else jnp.zeros((0,), jnp.float32))
  meta_names = list(spec.metadata)
  data_leaves, data_def = jax.tree_util.tree_flatten(state.data)
  # The kernel's calling layout (FifoInsertImpl in csrc/kernels.cc): the rows (typed
  # there), a row per metadata column and item leaf, then the state, each state operand
  # aliased to the result of the same column (which is typed). ``item_info`` goes whole
  # (uint32[C, 4]): the kernel writes each new item's row in place; the properties
  # ``state.key`` & co. are strided copies, never operands.
  rows = [mask, versions, prios, weights, jnp.asarray(n_bad, jnp.uint32)]
  tail_rows = [*[meta_rows[k] for k in meta_names], *item_leaves]
  fixed_state = [state.occupied, state.item_info, state.occ_tree, state.weight_tree,
                 state.ledger, state.version_hist, state.version_bounds, state.position_index]
  state_ops = [*fixed_state, *[state.metadata[k] for k in meta_names], *data_leaves]
  state_at = len(rows) + len(tail_rows)
  out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state_ops]
  call = jax.ffi.ffi_call("funcreplay_fifo_insert", out_types, vmap_method="sequential",
                          input_output_aliases=native.state_aliases(state_ops, state_at))
  res = native.keep_empty(call(*rows, *tail_rows, *state_ops, capacity=spec.capacity,
                               n_meta=len(meta_names), n_data=len(data_leaves),
                               ledger=native.ledger_attr(spec)), state_ops)
  n_fixed = len(fixed_state)
  occupied, item_info, occ_tree, weight_tree, ledger, hist, bounds, pindex = res[:n_fixed]
  k = n_fixed + len(meta_names)
  metadata = dict(zip(meta_names, res[n_fixed:k]))
  data = jax.tree_util.tree_unflatten(data_def, res[k:])
  return state.replace(
      data=data, occupied=occupied, item_info=item_info, metadata=metadata, occ_tree=occ_tree,
      weight_tree=weight_tree, ledger=ledger, version_hist=hist, version_bounds=bounds,
      position_index=pindex)
