"""Lean ``Uniform`` sampling without masks: exact, loop-free, no conditions.

Applies (``applies``) when the sampler is ``Uniform``, no ``where`` mask and no
staleness mask (``version`` None or no ``max_staleness``). Any remover, any reuse
limit (an item is freed by the sample that uses it up, so every occupied item is
eligible) but a heap remover's; the table may have holes.

Program (B = batch size, N = ``state.size``, C = capacity, P = tree size):

1. ``x = bits.without_replacement(rng, N, B)``: the first B entries of a
   uniformly random permutation of ``[0, N)`` (with ``replace``: B i.i.d.
   uniform integers in ``[0, N)``). O(B log B).
2. ``slot = k-th occupied slot`` for ``k = x``: a descent of the occupancy
   count tree (``kth_occupied``: 3 levels per step, the last 6 from the
   ``occupied`` bytes), O(B log P). Any
   bijection from ``[0, N)`` onto the occupied slots gives the same
   distribution; the descent works with holes, so there is no hole test, no
   rejection and no fallback. A table without holes (``TableSpec.holes``
   False) maps ``x`` to the ``x``-th oldest item by ring arithmetic instead
   (``ring_slot``, O(B), no read: BUILD.md finding 23).
3. Gather every data leaf and the info columns; ``times_sampled[slot] += 1``
   (one scatter-add); ``samples`` counter and ``limiter_diff``; with a
   ``version``, the ``sampled_staleness_sum`` counter; with
   ``max_times_sampled``, the used-up items freed (``used_up.free``, O(B log C)).

Invariants kept: only ``times_sampled``, the ledger and (freeing) the occupancy and
its trees change, exactly as the general ``sampling.sample`` changes them for the same
slots (rows valid for ``i < N``; invalid rows: slot -1, zero data, probability 0).

Random bits: ``bits.words(rng, B)``; row ``i`` draws ``j_i = i +
floor((hi_i * 2**32 + lo_i) * (N - i) / 2**64)`` (with ``replace``: ``j_i =
floor((hi_i * 2**32 + lo_i) * N / 2**64)``, used as ``x_i`` directly).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import (
  bits,
  fixedpoint,
  inplace,
  item_info,
  position_index,
  staleness,
  storage,
  trees,
)
from funcreplay.core import ledger_update as ledger
from funcreplay.core import rate_limiters as rl
from funcreplay.core import selectors as sel
from funcreplay.core.inplace import materialize
from funcreplay.core.sampling import used_up
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import Sample, SampleInfo, TableState


def applies(spec: TableSpec, *, version=None, where=None) -> bool:
  """True when ``sample`` below may replace the general ``sampling.sample`` (static)."""
  # A heap remover with a reuse limit (the freeing refreshes its stamp-ordered tree, and
  # the order of those reads before a later insert's writes was not found without a copy
  # of the tree) takes the general program; the native kernels have no heap remover.
  return (isinstance(spec.sampler, sel.Uniform) and where is None
          and (version is None or spec.max_staleness is None)
          and not (spec.max_times_sampled > 0 and spec.touch_stamps))


def positions(rng, n, b: int, replace: bool, n_max: int = 1 << 31):
  """``(x int32[b], valid bool[b])``: positions in ``[0, n)`` (distinct unless ``replace``)."""
  if not replace:
    return bits.without_replacement(rng, n, b, n_max)
  hi, lo = bits.words(rng, b)
  x = bits.below(hi, lo, jnp.maximum(n, 1).astype(jnp.uint32)).astype(jnp.int32)
  return x, jnp.broadcast_to(n > 0, (b,))


# Tree levels descended per step. Each step is one elementwise fusion over the B
# rows (2**_LEVELS one-element gathers of the children's counts, their running
# sum, the child taken) plus one reduction that materializes ``(node, k)``: 3 levels
# per step measured fastest in a scan (2 and 4 within noise; 6 no better; 4 levels as
# one [B, 16] gather and a ``cumsum``, the previous program, 1.6x slower: XLA:CPU
# runs the cumsum's reduce-window as a thunk of its own at ~10 us).
_LEVELS = 3
# The last levels are read from ``occupied`` (bool[C], the tree's leaves as bytes)
# rather than from the tree: 2**6 = 64 consecutive bools are one 64-byte cache line,
# where the tree's last 6 levels are 2 random lines of a ~1.3 MB region. The sample
# is memory-bound in a scan (every row is a cache miss per level it touches); this
# measured 1.0x-1.2x the speed of descending the tree to the leaves (CPU time, A/B
# runs on the loaded 2-core VM).
_LEAF_LEVELS = 6
# The 2**_LEAF_LEVELS bytes are counted in groups of 2**_GROUP_LEVELS: the group sums
# (independent adds), the group taken, then its bytes one by one. A single running sum
# over all 64 bytes is a chain of 64 dependent steps per row (~600 instructions), so
# the CPU works on one row at a time and waits for each row's cache miss in turn;
# together with the separate first-byte read (``kth_occupied``) this level went
# 18 -> 9 us of a B = 256 sample in a scan (profiled; the in-scan uniform step
# 100 -> 91 us, A/B in one process).
_GROUP_LEVELS = 3
# XLA:CPU splits every fusion that reads an operand over 256 KB across its 2 threads
# (``outer_dimension_partitions``), even a gather of a few hundred elements; under
# load each hand-off costs microseconds. The descent's upper levels (nodes below
# 2**(_TOP_DEPTH + 1), 64 KB) are read from a materialized copy of their own, so
# those steps run on one thread: measured 0.69x -> 0.79x flashbax (CPU time) and
# 0.55x -> 0.91x (wall) for the in-scan uniform step at load ~8.
_TOP_DEPTH = 13


def _take_child(k, counts):
  """``(k', j)``: the child ``j`` holding the ``k``-th occupied slot among children of
  occupied ``counts`` (a list of int32[B], one per child, in slot order), and ``k``
  relative to that child. Child ``j`` is taken when the counts of children ``0..j-1``
  sum to ``<= k`` and those of ``0..j`` to ``> k`` (the last child when no earlier
  one is); unrolled over [B] vectors, so XLA fuses the reads and the running sum
  into one loop over the rows."""
  csum, idx, sub = jnp.zeros_like(k), jnp.zeros_like(k), jnp.zeros_like(k)
  for c in counts[:-1]:
    csum = csum + c
    before = csum <= k
    idx = idx + before.astype(jnp.int32)
    sub = jnp.where(before, csum, sub)
  return k - sub, idx


def kth_occupied(tree, k, occupied=None):
  """The ``k``-th (0-based) occupied slot (int32[B]) of the occupancy count ``tree``.

  The same slot as ``trees.descend_count(tree, k, free=False)``, by ``_LEVELS``
  levels per step. With ``occupied`` (bool[C], the table's column: the tree's
  leaves), the last ``_LEAF_LEVELS`` levels count its bytes instead of reading the
  tree: on the CPU a row's block of them as one slice (``kth_in_block``, where the
  capacity is a multiple of the block), else one byte at a time (``kth_bytewise``).
  ``k`` (int32[B]) must be below the number of occupied slots.
  """
  if occupied is None:
    return kth_with_rank(tree, k)[0]
  p = tree.shape[0] // 2
  leaf_levels = min(_LEAF_LEVELS, trees.depth(p))
  node, k = _descend(tree, k, leaf_levels)
  first = (node - (p >> leaf_levels)) * (1 << leaf_levels)  # the first slot under ``node``
  bytewise = functools.partial(kth_bytewise, occupied, leaf_levels=leaf_levels, p=p)
  if occupied.shape[0] % (1 << leaf_levels):
    # The block of the last slots ends past the column (a clamped slice would shift).
    return bytewise(first, k)
  # The same slots either way. On a GPU the byte-by-byte counting is one kernel whose
  # threads are the rows; the blocks' reduction and second gather would be one more
  # (deviceless H200: 24 -> 25 kernels an in-scan uniform step).
  return lax.platform_dependent(
      first, k, cpu=functools.partial(kth_in_block, occupied, leaf_levels=leaf_levels),
      default=bytewise)


def kth_bytewise(occupied, first, k, *, leaf_levels: int, p: int):
  """``kth_in_block``'s slots, counting the block's bytes one gather each (any capacity:
  a slot at or past the column, whose tree leaf ``p`` counts, counts 0). What
  ``kth_occupied`` runs off the CPU, and on it where the capacity is not a multiple of
  the block."""
  # On CPU each row's line of ``occupied`` is read first by a loop of its own (one byte a
  # row, materialized): the B cache misses overlap there, where inside the counting
  # loop below they would come one row at a time (see _GROUP_LEVELS). Elsewhere the read
  # stays in the counting (on a GPU the rows are threads, and a loop of its own would be
  # one more kernel a sample). The same value either way.
  head = lax.platform_dependent(
      first, cpu=lambda f: materialize(_count_at(occupied, f, p)),
      default=lambda f: _count_at(occupied, f, p))
  group_levels = min(_GROUP_LEVELS, leaf_levels)
  g, n_groups = 1 << group_levels, 1 << (leaf_levels - group_levels)
  sums = [sum(_count_at(occupied, first + gi * g + j, p) if gi or j else head
              for j in range(g)) for gi in range(n_groups)]
  k, gi = _take_child(k, sums)
  start = first + gi * g
  _, idx = _take_child(k, [_count_at(occupied, start + j, p) for j in range(g)])
  return start + idx


def kth_in_block(occupied, first, k, *, leaf_levels: int):
  """The slot (int32[B]) of the ``k``-th (int32[B]) occupied byte of each row's block
  ``occupied[first : first + 2**leaf_levels]`` (``first`` int32[B], a multiple of the
  block, which must end inside the column: a clamped slice would shift). ``k`` below
  the number of occupied slots, as ``kth_occupied``'s (on an empty table both ways give
  P - 1, from ``first``; past the last occupied slot their answers, >= C, may differ).

  Two gathers of whole slices: the blocks (``[B, 64]``: one line a row, summed in groups
  by one reduction), then the group taken (``[B, 8]``, a line just read). A slice gather
  is a loop over the rows with the slice inside, so the rows' cache misses overlap;
  ``kth_bytewise`` is ~70 one-byte gathers a row in one long chain of dependent steps.
  Measured in the in-scan uniform step (insert 16 + sample 256, C = 262,144, the 2-core
  VM, variants in one process): 62-65 -> 51 us, where the step without any descent is
  27 us (BUILD.md finding 33).
  """
  block = 1 << leaf_levels
  g = 1 << min(_GROUP_LEVELS, leaf_levels)
  rows = lax.gather(occupied, first[:, None], _SLICE, (block,), mode=_CLIP).astype(jnp.int32)
  sums = jnp.sum(rows.reshape(-1, block // g, g), axis=-1)  # [B, groups]
  k, gi = _take_child(k, [sums[:, j] for j in range(block // g)])
  start = first + gi * g
  group = lax.gather(occupied, start[:, None], _SLICE, (g,), mode=_CLIP).astype(jnp.int32)
  _, idx = _take_child(k, [group[:, j] for j in range(g)])
  return start + idx


_CLIP = lax.GatherScatterMode.CLIP
_ONE = lax.GatherDimensionNumbers(offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,))
# A slice of consecutive elements a row: ``[B, size]``.
_SLICE = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(), start_index_map=(0,))


def _count_at(occupied, s, p: int):
  """int32[B]: 1 where slot ``s`` (int32[B], in ``[0, P)``) is occupied. A clamped
  gather (``s`` is never negative: no wrap-around arithmetic per read); the tree's
  leaves past the capacity C are empty and the column ends at C."""
  cap = occupied.shape[0]
  got = lax.gather(occupied, s[:, None], _ONE, (1,), mode=_CLIP).astype(jnp.int32)
  return jnp.where(s < cap, got, 0) if cap < p else got


def kth_with_rank(tree, k):
  """``(leaf, rank)``: the leaf of count ``tree`` holding the ``k``-th (0-based) counted
  unit and that unit's rank within the leaf (``kth_occupied``'s descent; leaves may
  count more than one, e.g. the set bits of a block of a bitmask)."""
  node, k = _descend(tree, k, 0)
  return node - tree.shape[0] // 2, k


def _descend(tree, k, leaf_levels: int):
  """``(node, k)``: descend count ``tree`` from the root, stopping ``leaf_levels`` above
  the leaves; ``node`` is the tree index reached, ``k`` the rank within it."""
  p = tree.shape[0] // 2
  node = jnp.ones(k.shape, jnp.int32)
  left = trees.depth(p) - leaf_levels
  # The upper levels (depth <= _TOP_DEPTH) are read from a copy of their nodes: see
  # _TOP_DEPTH. The copy is O(2**_TOP_DEPTH), independent of the capacity.
  top_depth = min(left, _TOP_DEPTH)
  top = materialize(tree[:2 << top_depth]) if left else tree
  depth_now = 0
  while left:
    step = min(_LEVELS, left)
    w = 1 << step
    depth_now += step
    src = top if depth_now <= top_depth else tree
    k, idx = _take_child(k, [src[node * w + j] for j in range(w)])
    node = node * w + idx
    left -= step
    if left or leaf_levels:
      # Materialized together: the next step would otherwise recompute this one
      # (and all before it) in each of its reads (``materialize``).
      node, k = materialize(jnp.concatenate([node, k])).reshape(2, -1)
  return node, k


def ring_slot(spec: TableSpec, state: TableState, n, x):
  """The slot of position ``x`` (int32[B], ``0 <= x < n``) in a table without holes
  (``TableSpec.holes`` False): the stored items are the ``n`` slots written last, so
  position ``x`` is the ``x``-th oldest, ``(write_pos - n + x) mod C``. O(B), no read."""
  c = spec.capacity
  return (state.write_pos - n + x + c) % c


def gather_rows(spec: TableSpec, state: TableState, slot, valid):
  """The items at ``slot`` (int32[B], in range), zero where not ``valid``: one gather
  of whole rows with row storage (``core.storage``), else one per leaf."""
  def rows(x):
    v = valid.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(v, x[slot], jnp.zeros((), x.dtype))
  return storage.unpack(spec.signature, spec.packed_rows,
                        jax.tree_util.tree_map(rows, state.data), 1)


def finish(spec: TableSpec, state: TableState, slot, valid, prob, num_eligible, version,
           reads=(), n_valid=None, replace=False):
  """The bookkeeping of a sample: ``(state, Sample)``.

  ``slot`` int32[B] in range (any value where not ``valid``), ``prob``
  float32[B]; ``replace``-drawn duplicates are fine (the scatter adds; ``replace``:
  the batch may repeat a slot). With ``spec.max_times_sampled`` the items this sample
  used up are freed (``used_up.free``).
  ``reads``: arrays the caller read from the state's columns or trees that
  feed neither ``slot`` nor the returned sample (see "Ordered" below).
  ``n_valid``: int32[], the number of valid rows when the caller knows it without
  counting (else ``sum(valid)``: XLA:CPU runs a sum of more than 32 elements as a
  windowed reduction and a reduction, two operations of a scan step).

  Ordered: the returned state's ledger (``write_pos``, behind every write of a
  following ``insert``) and ``info.slot`` (the slots of a following
  ``update_priorities``) are data-dependent on every read of this call (the
  gathered rows and info columns, through ``inplace.witness``). XLA orders by
  data dependencies only: without this, a later write in place of a column
  this call read (``insert`` writes them all) would make XLA copy the column,
  O(C) per call. An ``update_priorities`` at slots other than ``info.slot``
  is not ordered (a copy of ``priority``).
  """
  cap = spec.capacity
  data = gather_rows(spec, state, slot, valid)
  words = item_info.add_field(state.item_info, jnp.where(valid, slot, cap), "times_sampled", 1,
                              mode="drop")
  # One gather of the rows' four info words, after the increment (so ordered after the
  # scatter, which stays in place; the next writers are ordered by the witness below).
  got = item_info.unpack(words[slot])
  if n_valid is None:
    n_valid = jnp.sum(valid, dtype=jnp.int32)
  adds = {"samples": ledger.count(n_valid)}
  item_version = got["version"]
  if version is not None:
    adds["sampled_staleness_sum"] = ledger.total(staleness.behind(version, item_version),
                                                 valid)
  info = SampleInfo(
      slot=jnp.where(valid, slot, -1),
      key=jnp.where(valid, got["key"], jnp.uint32(0)),
      probability=jnp.where(valid, prob, 0.0),
      priority=jnp.where(valid, got["priority"], 0.0),
      times_sampled=jnp.where(valid, got["times_sampled"], 0),
      version=jnp.where(valid, item_version, 0))
  state = state.replace(item_info=words)
  if spec.max_times_sampled > 0:
    state, freed = used_up.free(spec, state, slot, valid, got, replace)
    adds.update(freed)
  flag = inplace.witness((data, info, reads))
  if not sel.is_ring(spec.remover):
    # Without the ring, a later insert writes its first rows at free slots it finds in
    # the occupancy tree, not at ``write_pos``: those writes are ordered after this
    # call's reads only if the tree depends on them too (a two-row scatter). Without
    # this, a sample then insert in a scan copied the data, ``occupied`` and
    # ``item_info`` every step (tests/core/test_inplace.py).
    state = state.replace(occ_tree=inplace.tie(state.occ_tree,
                                               lax.population_count(flag) > 32))
  state = ledger.update(state, adds, dict(
      limiter_diff=rl.update_diff(spec.rate_limiter, state.limiter_diff, sampled=n_valid),
      write_pos=inplace.after(state.write_pos, flag)))
  info = dataclasses.replace(info, slot=inplace.after(info.slot, flag))
  return state, Sample(data=data, valid=valid, info=info, num_eligible=num_eligible)


def sample(spec: TableSpec, state: TableState, rng, *, batch_size: int, version=None,
           replace: bool = False):
  """Lean uniform ``sample`` (see the module doc); ``(state, Sample)`` as ``sampling.sample``."""
  b = batch_size
  if not applies(spec, version=version):
    raise ValueError("lean uniform sample: needs a Uniform sampler, no where or staleness "
                     "mask, and no heap remover with a reuse limit.")
  # The size (occ_tree[1], a slice XLA re-fuses into each consumer) read once, so that
  # every use of it is ordered before a later write of the tree (see ``finish``): this
  # call's own (a reuse limit's used-up items, the non-ring remover's tie) on every
  # backend, else XLA:GPU copies the tree too; only a later insert's otherwise, which
  # needs it on CPU alone (``inplace.once_on_cpu``).
  writes_tree = spec.max_times_sampled > 0 or not sel.is_ring(spec.remover)
  n = (inplace.once if writes_tree else inplace.once_on_cpu)(state.size)
  x, valid = positions(rng, n, b, replace, spec.capacity)
  # Materialized twice: the positions feed every level of the descent, the
  # slots every gathered element (see ``materialize``).
  x = materialize(jnp.where(valid, x, 0))
  if not spec.holes:
    slot = ring_slot(spec, state, n, x)
  elif spec.position_index:  # one gather (core.position_index)
    slot = state.position_index[position_index.ORDER, x]
  else:
    slot = kth_occupied(state.occ_tree, x, state.occupied)
  slot = materialize(slot)
  # One division (fixedpoint.divide: exact, ~13 ns an element on XLA:CPU), then broadcast.
  prob = jnp.broadcast_to(fixedpoint.divide(1.0, jnp.maximum(n, 1).astype(jnp.float32)), (b,))
  # The valid rows are the first min(N, B) (without replacement) or all B when N > 0.
  n_valid = jnp.where(n > 0, b, 0) if replace else jnp.minimum(n, b)
  return finish(spec, state, slot, valid, prob, n, version, n_valid=n_valid, replace=replace)
