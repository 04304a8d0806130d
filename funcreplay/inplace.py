"""Keeping donated updates in place: order reads of a column before its writes.

XLA updates a donated buffer in place only when every read of the old
contents is known to happen first. A gather whose result does not feed the
later scatter (``info.priority = priority[slots]`` in ``sample``, then
``update_priorities`` scattering into ``priority``) leaves the two unordered,
and XLA resolves that by copying the whole ``[C]`` column: an O(C) cost per
call that grows with capacity. ``lax.optimization_barrier`` does not help
here (the CPU pipeline expands it before copy insertion), so ``settle`` adds a
real but O(1) data dependency instead: each capacity-sized leaf gets its
first row rewritten (to itself) under a predicate computed from the reads.
The predicate is never true, but XLA cannot prove it, so every later writer
of that leaf is ordered after the reads and updates in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def never(reads) -> jnp.ndarray:
  """bool[]: always False, computed from every leaf of ``reads`` (cost O(size of reads))."""
  total = jnp.uint32(0)
  for x in jax.tree_util.tree_leaves(reads):
    x = jnp.asarray(x)
    if x.size == 0:
      continue
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    bits = x.dtype.itemsize * 8
    if bits == 64:
      x = lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
    else:
      x = lax.bitcast_convert_type(x, jnp.dtype(f"uint{bits}"))
    total = total + jnp.sum(x, dtype=jnp.uint32)
  # A uint32 has at most 32 bits set; XLA does not reason about popcount ranges.
  return lax.population_count(total) > 32


def tie(leaf: jnp.ndarray, flag: jnp.ndarray) -> jnp.ndarray:
  """``leaf`` unchanged, but data-dependent on ``flag`` (an O(1) in-place row update)."""
  if leaf.ndim == 0 or leaf.shape[0] == 0:
    return leaf
  head = lax.slice_in_dim(leaf, 0, 1)
  return lax.dynamic_update_slice_in_dim(leaf, jnp.where(flag, jnp.zeros_like(head), head), 0, 0)


def settle(state, reads, capacity: int):
  """``state`` with every leaf of leading axis >= ``capacity`` ordered after ``reads``.

  Args:
    state: a ``TableState`` (any pytree of arrays).
    reads: pytree of arrays read from ``state`` that later writes must not overtake.
    capacity: C; leaves with a leading axis >= C (columns, data, trees) are tied.
  """
  flag = never(reads)
  return jax.tree_util.tree_map(
      lambda x: tie(x, flag) if x.ndim >= 1 and x.shape[0] >= capacity else x, state)
