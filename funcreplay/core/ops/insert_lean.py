"""Lean ``insert`` into a ``Fifo`` ring: every row real (no ``mask``), any weight sampler.

Applies (``applies``) when the remover is exactly ``Fifo`` and no ``mask`` is given;
``ops.insert`` then runs it (``make_table``'s portable insert).
The B rows go to slots ``(write_pos + r) mod C``, ``r < B``, as in the
general ``ops.insert``, and the resulting ``TableState`` is bit for bit the
one the general path gives (tests/core/test_lean.py).

Work (B static): one read of ``occupied`` and ``item_info`` at the B
slots (the victims and their reuse counts; ``_take``), one write of the data
rows, of ``occupied`` and of the four ``item_info`` words (each a
``dynamic_update_slice`` for B = 1, else a B-row scatter), one scatter-add of
1 to the leaves of the free victims and their ancestors (O(B log P),
``trees.add_one``), one
float sum-tree refresh for a ``Prioritized`` sampler, the version index only
with ``max_staleness``, and one ledger rewrite. Nothing else: no remover tree
(a ring needs none), no cumsum over a mask, no condition, no loop.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import (
  indexes,
  inplace,
  item_info,
  position_index,
  powers,
  staleness,
  storage,
  trees,
)
from funcreplay.core import ledger_update as ledger
from funcreplay.core import rate_limiters as rl
from funcreplay.core import selectors as sel
from funcreplay.core.inplace import after
from funcreplay.core.ops.rows import count_read
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def applies(spec: TableSpec, *, mask=None) -> bool:
  """True when ``insert`` below may replace the general ``ops.insert`` (static)."""
  # The ring only: Fifo(fill_holes=True) (Reverb's FIFO remover) fills free slots first.
  # Heap specs keep touch stamps (spec.touch_stamps), which only the general insert writes.
  return (type(spec.remover) is sel.Fifo and not spec.remover.fill_holes and mask is None
          and not spec.touch_stamps)


def _rows(x, b, dtype):
  if isinstance(x, (bool, int, float, np.ndarray, np.generic)):  # host stays host (rows.rows)
    return np.broadcast_to(np.asarray(x).astype(dtype), (b,))
  return jnp.broadcast_to(jnp.asarray(x), (b,)).astype(dtype)


def _take(col, slots, start):
  """``col[slots]`` for the ring's slots ``(start + r) mod C``, ``r < B``.

  One slot: a real gather (as ``ops.take``: a one-row read would become a dynamic
  slice that XLA re-fuses into every consumer). More: two windows of B rows, at
  ``min(start, C - B)`` (every slot before the wrap) and at 0 (the slots after it),
  and a gather from those. A gather straight from the ``[C]`` column would be one that
  XLA:CPU's parallel task assignment splits across its threads (it prices a gather by
  the operand it reads, here > 256 KB): each such hand-off cost ~1 us a step, most of a
  small insert (in-scan B = 2: 4.4-4.8 -> 2.8-3.0 us a step with the windows and
  a tree update without a gather; BUILD.md finding 14; tests/core/test_lean.py counts the split
  gathers)."""
  if slots.shape[0] == 1:
    return col[jnp.concatenate([slots, slots])][:1]
  c, b = col.shape[0], slots.shape[0]
  lo = jnp.minimum(start, c - b)
  before = lax.dynamic_slice_in_dim(col, lo, b, 0)
  after_wrap = lax.slice_in_dim(col, 0, b, axis=0)
  in_window = (slots >= lo).reshape((b,) + (1,) * (col.ndim - 1))
  return jnp.where(in_window, before[jnp.clip(slots - lo, 0, b - 1)],
                   after_wrap[jnp.clip(slots, 0, b - 1)])


def _put(col, slots, x, start):
  """``col[slots] = x`` (slots contiguous modulo C from ``start``; ``x`` [B, ...])."""
  if slots.shape[0] == 1:  # one row never wraps: an in-place dynamic_update_slice
    return lax.dynamic_update_slice_in_dim(col, x.astype(col.dtype), start, 0)
  return col.at[slots].set(x.astype(col.dtype), unique_indices=True)


def insert(spec: TableSpec, state: TableState, items: Any, *, version=0, priority=None,
           metadata: Optional[Mapping[str, Any]] = None) -> TableState:
  """Insert ``B`` items (every leaf ``[B, ...]``, ``B <= C`` static) into the ring.

  Arguments as ``ops.insert`` (validated there; this program assumes them
  valid). Returns the new state.
  """
  if not applies(spec):
    raise ValueError("lean insert: needs a Fifo remover and no mask.")
  cap = spec.capacity
  b = jax.tree_util.tree_leaves(items)[0].shape[0]
  r = jnp.arange(b, dtype=jnp.int32)
  versions = _rows(version, b, jnp.int32)
  if priority is None:
    default = state.max_priority if spec.default_priority is None else spec.default_priority
    prios, n_bad = _rows(default, b, jnp.float32), jnp.uint32(0)
  else:
    p = _rows(priority, b, jnp.float32)
    bad = ~jnp.isfinite(p) | (p < 0)
    prios, n_bad = jnp.where(bad, 0.0, p), jnp.sum(bad, dtype=jnp.uint32)
  metadata = dict(metadata or {})
  start = state.write_pos
  slots = (start + r) % cap
  keys = state.next_key + r.astype(jnp.uint32)

  old_occ = _take(state.occupied, slots, start)
  if (spec.max_times_sampled > 0 or sel.is_ordered(spec.sampler)
      or spec.max_staleness is not None):
    # Read once off the CPU: where samples write ``occupied`` too (freeing used-up items;
    # an ordered sampler's tie of every column; a staleness-masked sample's, the general
    # program's ``inplace.settle``), XLA:GPU re-fused this read into the occupancy
    # tree's scatter and the victims' counts, not ordered before the write of
    # ``occupied`` below, and copied it twice a step in a scan of insert and sample
    # (experiments/accel_copies.py). Elsewhere one kernel for nothing.
    old_occ = inplace.once_off_cpu(old_occ)
  n_evicted = jnp.sum(old_occ, dtype=jnp.uint32)
  if b == 1:
    # The victim's reuse count read inside a reduction with a scalar result: XLA:CPU
    # splits a gather from a > 256 KB column across 2 threads (a hand-off of
    # microseconds under load), a reduction to a scalar it cannot split (measured:
    # in-scan insert b1 CPU time 0.41x -> 0.49x flashbax). One int32 (< 2**31) is
    # its own exact two-word total.
    two = jnp.concatenate([slots, slots])
    occ2 = jnp.concatenate([old_occ, jnp.zeros((1,), bool)])
    lo = jnp.sum(jnp.where(occ2, item_info.at(state.item_info, two, "times_sampled"),
                           0)).astype(jnp.uint32)
    reuse_sum = (jnp.uint32(0), lo)
    old = None
  else:
    old = item_info.unpack(_take(state.item_info, slots, start))  # the victims' rows
    reuse_sum = ledger.total(old["times_sampled"], old_occ)
  # Reads of item_info whose results do not feed its write below: one reduction of them
  # orders them first (inplace.after), else XLA would copy item_info.
  read = reuse_sum[0] ^ reuse_sum[1]

  hist, bounds = state.version_hist, state.version_bounds
  if spec.max_staleness is not None:  # the same order as ops.insert: advance, remove, add
    every = jnp.ones((b,), bool)
    # One slot read at two indices: a real gather, as ``_take`` (not a re-fused slice).
    old_versions = (item_info.at(state.item_info, jnp.concatenate([slots, slots]), "version")[:1]
                    if old is None else old["version"])
    # Read once off the CPU: XLA:GPU recomputed the read inside the histogram's scatter,
    # not ordered before the write of item_info below, and copied item_info twice a call.
    old_versions = inplace.once_off_cpu(old_versions)
    hist, bounds = staleness.advance(spec, hist, bounds, versions, every)
    hist, bounds = staleness.on_remove(spec, hist, bounds, old_versions, old_occ)
    hist, bounds = staleness.add(spec, hist, bounds, versions, every)
    read = read ^ jnp.sum(old_versions.astype(jnp.uint32), dtype=jnp.uint32)

  index = state.position_index
  if spec.position_index:
    # The rows whose victim was free take the next positions; an overwritten item's slot
    # keeps its own.
    index = position_index.add(index, slots, ~old_occ)
  put = lambda col, x: _put(col, slots, x, start)  # noqa: E731
  # Each leaf goes from the victim's occupancy to 1: 1 added where the victim was free (a
  # scatter-add with constant values, trees.add_one), without refresh_count's gather of
  # the old leaves (a split gather, see _take).
  occ_tree = trees.add_one(state.occ_tree, slots, ~old_occ)
  weight_tree = state.weight_tree
  if spec.prioritized:
    w = indexes.sample_weight(spec, jnp.ones((b,), bool), prios)
    # Keep the zero-weight count (occ_tree[0], see indexes.zero_weight_count) in step. The
    # victims' old weights come from their priority column (a read of the weight tree would
    # make XLA copy the tree); the priority write below is ordered after that read.
    # (powers.positive: no power computed for alpha <= 1.)
    alpha = spec.sampler.priority_exponent
    if b == 1:  # counted where read (rows.count_read: no split gather)
      n_old_zero = count_read(lambda s: item_info.at(state.item_info, s, "priority"),
                              slots, old_occ,
                              lambda p: ~powers.positive(p, alpha))
    else:
      old_zero = ~powers.positive(old["priority"], alpha)
      n_old_zero = jnp.sum(old_occ & old_zero, dtype=jnp.int32)
    # Read once off the CPU: XLA:GPU recomputed the count inside the tree's scatter below,
    # a read of item_info not ordered before its write, and copied item_info twice a call.
    n_old_zero = inplace.once_off_cpu(n_old_zero)
    zero_delta = jnp.sum(w <= 0, dtype=jnp.int32) - n_old_zero
    read = read ^ n_old_zero.astype(jnp.uint32)
    # A two-index scatter (the second out of range, dropped): a one-index one becomes a
    # dynamic-update-slice that XLA fuses into later reads, copying the tree (indexes.refresh).
    occ_tree = occ_tree.at[jnp.array([0, 2 * spec.tree_size])].add(
        jnp.stack([zero_delta, 0]), mode="drop")
    if b == 1:  # keep the per-level updates real scatters (see indexes.refresh)
      weight_tree = trees.refresh_sum(weight_tree, jnp.concatenate([slots, slots]),
                                      jnp.concatenate([w, w]),
                                      jnp.asarray([True, False]))
    else:
      weight_tree = trees.refresh_sum(weight_tree, slots, w)
  if b == 1:  # one fused row write (storage.put_one: no concatenate)
    data = storage.put_one(spec.signature, spec.packed_rows, state.data, items, start)
  else:
    data = jax.tree_util.tree_map(
        put, state.data, storage.pack(spec.signature, spec.packed_rows, items, 1))
  info_rows = item_info.pack(key=keys, version=versions,
                            times_sampled=0, priority=prios)
  state = state.replace(
      data=data,
      occupied=put(state.occupied, after(jnp.ones((b,), bool), n_evicted)),
      item_info=put(state.item_info, after(info_rows, read)),
      metadata={k: put(v, _rows(metadata.get(k, 0), b, jnp.int32))
                for k, v in state.metadata.items()},
      occ_tree=occ_tree, weight_tree=weight_tree,
      version_hist=hist, version_bounds=bounds, position_index=index,
  )
  adds = {"evicted_capacity": ledger.count(n_evicted), "removed_reuse_sum": reuse_sum,
          "inserts": ledger.count(b)}
  if priority is not None:
    adds["invalid_priorities"] = ledger.count(n_bad)
  return ledger.update(state, adds, dict(
      write_pos=(start + b) % cap,
      next_key=state.next_key + jnp.uint32(b),
      limiter_diff=rl.update_diff(spec.rate_limiter, state.limiter_diff, inserted=jnp.int32(b)),
      max_priority=jnp.maximum(state.max_priority, jnp.max(prios))))
