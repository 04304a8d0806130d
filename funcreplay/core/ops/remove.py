"""Removals: ``remove`` (every cause), ``delete``, ``evict_stale``."""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import counters as ctr
from funcreplay.core import indexes, inplace, item_info, staleness
from funcreplay.core.ops.queries import stale_mask
from funcreplay.core.ops.rows import key_matches as _key_matches
from funcreplay.core.ops.rows import keyed_args, last_occurrence, take
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def remove(spec: TableSpec, state: TableState, slots, mask, cause: str,
           rows=None) -> TableState:
  """Free ``slots[mask]`` (unique), counting them under ``cause``. Trees not refreshed.

  ``rows``: the victims' ``item_info`` fields (``item_info.unpack``) when the caller has
  read them already and orders that read before its later writes itself (``sample``'s
  finish: its outputs are those rows); else they are read here, and ordered."""
  if not spec.holes and cause != "evicted_capacity":  # the ring's own overwrite leaves none
    require_holes(spec, f"removing items ({cause})")
  n = jnp.sum(mask).astype(jnp.uint32)
  if rows is None:
    # One read of the victims' rows; once off the CPU: XLA:GPU re-fused the gather into
    # the counters' update (a consumer not ordered before the write of item_info below
    # or after this call), and copied item_info twice a row in the per-row insert loop of
    # the non-ring removers (experiments/accel_pytest.py). On the CPU the same program.
    rows = item_info.unpack(inplace.once_off_cpu(take(state.item_info, slots)))
    # The caller may overwrite these rows next (insert): order that after this read, and
    # after the reads behind ``mask`` (a key guard's reads of item_info).
    state = state.replace(item_info=inplace.tie(state.item_info,
                                                inplace.never((rows["times_sampled"], mask))))
  old = rows
  reuse = old["times_sampled"]
  if spec.max_staleness is not None:
    versions = old["version"]
    hist, bounds = staleness.on_remove(spec, state.version_hist, state.version_bounds,
                                       versions, mask)
    state = state.replace(version_hist=hist, version_bounds=bounds)
  c = dict(state.counters)
  c[cause] = ctr.add(c[cause], n)
  c["removed_reuse_sum"] = ctr.add_sum(c["removed_reuse_sum"], reuse, mask)
  occupied = state.occupied.at[jnp.where(mask, slots, state.occupied.shape[0])].set(
      False, mode="drop")
  return state.replace(occupied=occupied, counters=c)


def require_holes(spec: TableSpec, what: str) -> None:
  """Raise (when tracing, before anything changes) if ``spec.holes`` is False: ``what``
  would leave a hole in a table that promised to have none (``TableSpec.holes``)."""
  if not spec.holes:
    raise ValueError(f"{what}: the table was made with TableSpec(holes=False), so items leave "
                     "it only from its oldest end (the ring overwriting them, or, with "
                     "max_times_sampled, an unmasked Fifo sample using them up); build it "
                     "with holes=True (the default) to delete or evict items, or to sample "
                     "it with a mask under a reuse limit.")


def delete(spec: TableSpec, state: TableState, slots, keys) -> TableState:
  """Remove the items at ``slots`` whose key still equals ``keys`` (int32/uint32 [K])."""
  require_holes(spec, "delete")
  slots, keys, _ = keyed_args("delete", slots, keys)
  safe, ok = _key_matches(state, slots, keys)
  ok = last_occurrence(safe, ok)
  state = remove(spec, state, safe, ok, "deletes")
  return indexes.refresh(spec, state, safe, ok)


def evict_stale(spec: TableSpec, state: TableState, version) -> TableState:
  """Free every item too stale for ``version``. O(C)."""
  if spec.max_staleness is None:
    raise ValueError("evict_stale: the table has no max_staleness; set TableSpec.max_staleness.")
  require_holes(spec, "evict_stale")
  stale = stale_mask(spec, state, version)
  slots = jnp.arange(spec.capacity, dtype=jnp.int32)
  state = remove(spec, state, slots, stale, "evicted_stale")
  return indexes.rebuild(spec, state)
