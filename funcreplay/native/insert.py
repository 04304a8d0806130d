"""``insert`` for a ``Fifo``-remover table in one CPU kernel (``FifoInsertImpl``).

The arguments are prepared exactly as the portable ``ops.insert`` prepares
them (validated rows, sanitized priorities, ``priority**alpha`` for a
prioritized sampler); the kernel writes the rows at the ring position,
counts the overwritten items, and keeps the occupancy and weight trees and
the staleness version index (in the portable order: advance the window,
remove the overwritten items, add the new ones). The result is bit-identical
to the portable path (tests/test_native.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from funcreplay import indexes
from funcreplay import rate_limiters as rl
from funcreplay.spec import TableSpec
from funcreplay.state import TableState

_COUNTERS = ("inserts", "evicted_capacity", "removed_reuse_sum")


def insert(spec: TableSpec, state: TableState, items, mask, versions, prios, meta_rows,
           n_real) -> TableState:
  """The portable ``ops.insert`` from the validated rows on (Fifo remover)."""
  b = mask.shape[0]
  item_leaves = spec.signature.treedef.flatten_up_to(items)
  item_leaves = [jnp.asarray(x) for x in item_leaves]
  weights = (indexes.sample_weight(spec, jnp.ones((b,), bool), prios) if spec.prioritized
             else jnp.zeros((0,), jnp.float32))
  meta_names = list(spec.metadata)
  data_leaves, data_def = jax.tree_util.tree_flatten(state.data)
  state_ops = [state.occupied, state.key, state.version, state.times_sampled, state.priority,
               state.occ_tree, state.weight_tree, state.write_pos, state.next_key,
               *[state.counters[k] for k in _COUNTERS], state.version_hist,
               state.version_bounds, *[state.metadata[k] for k in meta_names], *data_leaves]
  rows = [mask, versions, prios, weights, *[meta_rows[k] for k in meta_names], *item_leaves]
  out_types = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in state_ops]
  call = jax.ffi.ffi_call("funcreplay_fifo_insert", out_types, vmap_method="sequential",
                          input_output_aliases={len(rows) + i: i for i in range(len(state_ops))})
  res = call(*rows, *state_ops, capacity=spec.capacity, n_meta=len(meta_names),
             n_data=len(data_leaves))
  (occupied, key, version, times, priority, occ_tree, weight_tree, write_pos,
   next_key) = res[:9]
  k = 9 + len(_COUNTERS)
  counters = dict(state.counters)
  counters.update(zip(_COUNTERS, res[9:k]))
  hist, bounds = res[k:k + 2]
  k += 2
  metadata = dict(zip(meta_names, res[k:k + len(meta_names)]))
  k += len(meta_names)
  data = jax.tree_util.tree_unflatten(data_def, res[k:])
  return state.replace(
      data=data, occupied=occupied, key=key, version=version, times_sampled=times,
      priority=priority, metadata=metadata, occ_tree=occ_tree, weight_tree=weight_tree,
      write_pos=write_pos, next_key=next_key, counters=counters, version_hist=hist,
      version_bounds=bounds,
      limiter_diff=rl.update_diff(spec.rate_limiter, state.limiter_diff, inserted=n_real))
