"""The position index: an O(1) map from a position in ``[0, size)`` to an occupied slot.

``TableSpec(position_index=True)`` keeps it (``TableState.position_index``,
int32[2, C + 1]; int32[2, 0] otherwise) so that the lean uniform sample maps its
positions ``x`` (``bits.without_replacement``) to slots with one gather,
``order[x]``, instead of descending the occupancy count tree (~20 us of the
~50 us in-scan uniform step on the CPU, 5 kernels on a GPU: BUILD.md findings
34 and 36). Any bijection from ``[0, N)`` onto the occupied slots gives the same
distribution; this one depends on the table's history, so a checkpoint stores it.

Layout (C = capacity, N = ``state.size``):
  ``index[0]`` ``order``: position -> slot. ``order[:N]`` are exactly the occupied
    slots (each once, in the order below); ``order[N:]`` is left over (not read).
  ``index[1]`` ``where``: slot -> position; -1 for a free slot.
  ``index[0, C]``: N, the index's own count (``size``). The operations read it rather
  than ``state.size``: a general sample's draw leaves count-tree leaves zeroed while
  it frees used-up items, so the tree's root is not the count then.

Invariants (every operation keeps them; ``check`` tests them):
  ``where[order[p]] == p`` for ``p < N``; ``where[s] == -1`` exactly for the free
  slots; so ``order[:N]`` is a permutation of the occupied slots.

Operations (B rows; no condition, no loop; O(B) words written):
  ``add``: the newly occupied slots of a batch go to positions ``N, N + 1, ...`` in
    row order. An overwritten (still occupied) slot keeps its position.
  ``drop``: K freed slots leave as one swap-removal: the new size is ``N' = N - K``;
    a freed position below ``N'`` (a hole) takes the slot of a kept position in
    ``[N', N)`` (a filler): the r-th hole in row order takes the r-th filler in
    position order (there are as many of each). Two cumulative sums over B.
  ``sync``: ``add`` and ``drop`` from the occupancy at ``B`` slots (the general
    operations' ``indexes.refresh``): a slot in the index but free is dropped, one
    not in it but occupied is added (after the drops).
  ``rebuild``: the occupied slots in slot order (O(C)); a restore of a checkpoint
    that did not store the index, ``evict_stale`` and a capacity migration use it.

The native CPU kernels keep it by the same rule (``csrc/position_index.h``: the
insert's appends, ``order[x]`` and the used-up items' swap-removal in the sample, on
the jitted and the direct host path), so every executor gives the same batch and state
for the same ``(state, key)`` (tests/native, tests/host/test_direct.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from funcreplay.core import inplace
from funcreplay.core.spec import TableSpec

ORDER, WHERE = 0, 1


def empty(spec: TableSpec):
  """int32[2, C + 1] (``spec.position_index``) or int32[2, 0]: no slot occupied."""
  if not spec.position_index:
    return jnp.zeros((2, 0), jnp.int32)
  return jnp.full((2, spec.capacity + 1), -1, jnp.int32).at[ORDER, -1].set(0)


def _write(index, rows, cols, values, ok):
  """``index[rows, cols] = values`` where ``ok`` (one scatter of every word)."""
  cols = jnp.where(ok, cols, index.shape[1])  # out of range: dropped
  return index.at[rows, cols].set(values, mode="drop")


def size(index):
  """int32[]: the number of indexed slots (``index[ORDER, C]``)."""
  return index[ORDER, index.shape[1] - 1]


def add(index, slots, fresh):
  """``index`` with ``slots[fresh]`` (int32[B], distinct, not in the index) appended."""
  n = size(index)
  rank = jnp.cumsum(fresh.astype(jnp.int32)) - 1
  pos = n + rank
  b = slots.shape[0]
  rows = jnp.concatenate([jnp.full((b,), ORDER), jnp.full((b,), WHERE), jnp.full((1,), ORDER)])
  cols = jnp.concatenate([pos, slots, jnp.full((1,), index.shape[1] - 1)])
  values = jnp.concatenate([slots, pos, (n + jnp.sum(fresh, dtype=jnp.int32))[None]])
  return _write(index, rows, cols, values, jnp.concatenate([fresh, fresh, jnp.ones((1,), bool)]))


def drop(index, slots, gone):
  """``index`` without ``slots[gone]`` (int32[B], distinct, each in the index): see the
  module doc for the rule."""
  b, n = slots.shape[0], size(index)
  pos = index[WHERE, jnp.where(gone, slots, 0)]
  k = jnp.sum(gone, dtype=jnp.int32)
  n_after = n - k
  hole = gone & (pos < n_after)
  hole_rank = jnp.cumsum(hole.astype(jnp.int32)) - 1
  # The freed positions at or above N' (each in [N', N), so below N' + B): marked.
  t = jnp.arange(b, dtype=jnp.int32)
  tail = gone & (pos >= n_after)
  freed_tail = jnp.zeros((b,), bool).at[jnp.where(tail, pos - n_after, b)].set(
      True, mode="drop")
  filler = (t < k) & ~freed_tail
  filler_rank = jnp.cumsum(filler.astype(jnp.int32)) - 1
  filler_pos = jnp.zeros((b,), jnp.int32).at[jnp.where(filler, filler_rank, b)].set(
      n_after + t, mode="drop")
  src = filler_pos[jnp.maximum(hole_rank, 0)]
  moved = index[ORDER, jnp.where(hole, src, 0)]
  rows = jnp.concatenate([jnp.full((b,), ORDER), jnp.full((2 * b,), WHERE),
                          jnp.full((1,), ORDER)])
  cols = jnp.concatenate([pos, moved, slots, jnp.full((1,), index.shape[1] - 1)])
  values = jnp.concatenate([moved, pos, jnp.full((b,), -1, jnp.int32), n_after[None]])
  return _write(index, rows, cols, values,
                jnp.concatenate([hole, hole, gone, jnp.ones((1,), bool)]))


def sync(index, slots, valid, occupied_now):
  """``index`` made to agree with ``occupied_now`` (bool[B], the occupancy after an
  operation) at ``slots[valid]`` (distinct): the slots freed are dropped, then the slots
  newly occupied added."""
  safe = jnp.where(valid, slots, 0)
  # Read once off the CPU: XLA:GPU re-fused these reads (and the occupancy the caller
  # read) into the index's scatters, not ordered before the writes, and copied the index
  # and ``occupied`` twice a row in the per-row insert loop of a full table with a
  # non-ring remover (experiments/accel_copies.py). On the CPU the same program.
  indexed, occupied_now = inplace.once_off_cpu((index[WHERE, safe] >= 0, occupied_now))
  index = drop(index, safe, valid & indexed & ~occupied_now)
  return add(index, safe, valid & ~indexed & occupied_now)


def rebuild(occupied):
  """int32[2, C + 1]: the index of ``occupied`` (bool[C]) with its slots in slot order.
  O(C)."""
  c = occupied.shape[0]
  pos = jnp.cumsum(occupied.astype(jnp.int32)) - 1
  slots = jnp.arange(c, dtype=jnp.int32)
  order = jnp.full((c,), -1, jnp.int32).at[jnp.where(occupied, pos, c)].set(slots, mode="drop")
  n = jnp.sum(occupied, dtype=jnp.int32)
  return jnp.stack([jnp.append(order, n), jnp.append(jnp.where(occupied, pos, -1), -1)])


def check(index, occupied) -> str:
  """"" if ``index`` (int32[2, C + 1]) is a valid index of ``occupied`` (bool[C]), else
  what is wrong (numpy; tests and restores)."""
  index, occupied = np.asarray(index), np.asarray(occupied, bool)
  c = occupied.shape[-1]
  if index.shape != (2, c + 1):
    return f"the position index has shape {list(index.shape)}, not [2, {c + 1}]"
  order, where = index[ORDER, :c], index[WHERE, :c]
  n = int(occupied.sum())
  if int(index[ORDER, c]) != n:
    return f"the position index counts {int(index[ORDER, c])} items, the table holds {n}"
  if np.any((where >= 0) != occupied):
    bad = np.flatnonzero((where >= 0) != occupied)[:5].tolist()
    return f"the position index disagrees with the occupied slots at slots {bad}"
  head = order[:n]
  if np.any((head < 0) | (head >= c)) or not np.all(occupied[head]):
    return "the position index's first `size` entries are not all occupied slots"
  if np.any(where[head] != np.arange(n)):
    return "the position index's two halves are not inverse to each other"
  return ""
