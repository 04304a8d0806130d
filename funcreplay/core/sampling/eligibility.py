"""Which items a sample may return, and their total weight: one definition for every caller.

``sampling.sample`` (the portable path), the sharded table's local and global
draws (``funcreplay.distributed``) all use these, so "eligible" means the
same everywhere: occupied, fresh enough for ``max_staleness`` at ``ver``, and
allowed by ``where``.
"""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import indexes, ops, staleness
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def eligibility(spec: TableSpec, state: TableState, ver, where):
  """``(eligible_fn, eligible_all)`` for draws from ``state`` at version ``ver``.

  ``eligible_fn(slots int32[K]) -> bool[K]``: per-candidate check, O(K) (the
  ``where`` mask is evaluated once, up front); ``eligible_all() -> bool[C]``:
  the whole mask (``ops.eligible_mask``), for the exact completion and totals.
  ``ver`` None: no staleness mask; ``where`` None: no slot mask.
  """
  eligible_where = None if where is None else ops.eligible_mask(spec, state, None, where)

  def eligible_all():
    return ops.eligible_mask(spec, state, ver, where)

  def eligible_fn(slots):
    ok = state.occupied[slots]
    if ver is not None and spec.max_staleness is not None:
      ok = ok & (state.version[slots] >= staleness.threshold(spec, ver))
    if eligible_where is not None:
      ok = ok & eligible_where[slots]
    return ok

  return eligible_fn, eligible_all


def eligible_weight(spec: TableSpec, state: TableState, mask):
  """float32[]: the summed sample weight (``indexes.sample_weight``) of the items in ``mask``."""
  return jnp.sum(jnp.where(mask, indexes.sample_weight(spec, state.occupied, state.priority),
                           0.0))
