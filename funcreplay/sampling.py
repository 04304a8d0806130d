"""``sample``: draw a batch, bump reuse counters, free exhausted items.

Weighted selectors (Uniform, Prioritized) draw from a device tree:

1. Draw ``M`` candidates i.i.d. from the tree (O(M log C); a hole-free
   uniform Fifo ring draws ring positions instead, O(M)).
2. Keep, in draw order, the first occurrence of each eligible candidate.
3. If the batch is not full (masks rejected many candidates), zero the
   candidates seen so far in the tree for the rest of this call and draw
   another round; at most ``ROUNDS`` rounds. The zeroed leaves are put back
   from the columns at the end.

Step 2 is exactly *successive sampling* (sampling without replacement
proportionally to weight): i.i.d. draws with repeats discarded are draws from
the renormalised remaining distribution, and zeroing known-ineligible items
does not change the distribution over eligible ones. If the rounds run out
(heavy masks), an O(C) Gumbel-top-k over the remaining eligible weights
finishes the batch; it is the same distribution, only slower.

Deterministic selectors (Fifo, Lifo, MinHeap, MaxHeap) sort the eligible
items by their order: O(C log C), meant for queue/stack-sized tables.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay import counters as ctr
from funcreplay import indexes, inplace, ops, ordering, packing, staleness, trees
from funcreplay import native as native_lib
from funcreplay import rate_limiters as rl
from funcreplay import selectors as sel
from funcreplay.spec import TableSpec
from funcreplay.state import Sample, SampleInfo, TableState

ROUNDS = 4


def _first_occurrence(d):
  """``(first, d)``: bool[M], True at the first occurrence (in order) of each value
  of ``d``; and ``d`` itself, read back out of the sort.

  Callers use the returned ``d`` from then on: ``d`` comes from gathers of a
  tree that is then updated in place, and XLA re-fuses such gathers into every
  consumer; a consumer not ordered before the update costs a copy of the tree.
  A sort is never duplicated, so this leaves one ordered read.
  """
  m = d.shape[0]
  pos = jnp.arange(m, dtype=jnp.int32)
  s_d, s_pos = lax.sort((d, pos), num_keys=1, is_stable=True)
  first_sorted = jnp.concatenate([jnp.ones((1,), bool), s_d[1:] != s_d[:-1]])
  first = jnp.zeros((m,), bool).at[s_pos].set(first_sorted, unique_indices=True)
  return first, jnp.zeros((m,), d.dtype).at[s_pos].set(s_d, unique_indices=True)


class _Weights:
  """Uniform (occupancy counts) or prioritized (p**alpha) weight tree."""

  def __init__(self, spec: TableSpec, state: TableState):
    self.spec = spec
    self.prioritized = spec.prioritized
    self.tree = state.weight_tree if self.prioritized else state.occ_tree

  def total(self, tree):
    return tree[1]

  def draw(self, tree, u):
    if self.prioritized:
      return trees.descend_weight(tree, u * tree[1])
    tot = tree[1]
    k = jnp.minimum((u * tot.astype(jnp.float32)).astype(jnp.int32), tot - 1)
    return trees.descend_count(tree, jnp.maximum(k, 0), free=False)

  def zero(self, tree, slots, valid):
    refresh = trees.refresh_sum if self.prioritized else trees.refresh_count
    return refresh(tree, slots, jnp.zeros(slots.shape, tree.dtype), valid)

  def leaves(self, tree):
    p = tree.shape[0] // 2
    return tree[p:p + self.spec.capacity].astype(jnp.float32)


def _draw_weighted(spec, state, rng, batch_size, replace, eligible_fn, eligible_all,
                   reads=None, window=None, masked=True):
  """Draw ``B`` slots from the weight tree.

  Rounds of ``M`` i.i.d. candidates. The first round leaves the tree as it
  is: it nearly always fills the batch, and then the call never writes the
  tree (zeroing and restoring ``M`` leaves costs more than the draw). Each
  later round first zeroes the previous round's candidates (accepted or
  found ineligible), so they are not drawn again.

  Args:
    reads: values the caller read from the tree before the draw (best passed
      through ``inplace.once``); the draw, which may update the tree in
      place, is ordered after them. None: the caller read nothing.
    window: optional ``(start, filled, hole_free)`` of a uniform Fifo ring
      (``ring_window``). While ``hole_free``, candidates are drawn as ring
      positions, O(1) each, instead of by an O(log C) tree descent; a leaf
      an earlier round zeroed is rejected as a repeat. The distribution is
      the same: uniform over the items.
    masked: False if no ``where`` / staleness mask applies. With
      replacement every candidate is then accepted, so repeats need not be
      found (a sort) and nothing is zeroed.

  Returns:
    ``(picked int32[B], tree, zeroed int32[K])``: slots in draw order (-1
    where fewer eligible items exist), the weight tree, and the slots whose
    leaves are still zeroed (-1 padded, usually all -1): the caller puts
    them back with ``restore_zeroed``. The tree is threaded through (not
    copied) so XLA can update it in place.
  """
  w = _Weights(spec, state)
  b = batch_size
  m = b + max(8, b // 2)

  def draw(tree, u):
    if window is None:
      return w.draw(tree, u)
    start, filled, hole_free = window
    by_ring = lambda: (start + jnp.minimum((u * filled).astype(jnp.int32), filled - 1)  # noqa: E731
                       ) % spec.capacity
    return lax.cond(hole_free, by_ring, lambda: w.draw(tree, u))

  track = masked or not replace  # candidates can be rejected: find repeats, zero them

  def one_round(tree, picked, n, u, alive):
    """Candidates from ``tree``; ``alive``: False once the tree holds no weight."""
    if track:
      first, d = _first_occurrence(draw(tree, u))
    else:
      first, d = True, draw(tree, u)
    # A tree draw never lands on a zeroed leaf; a ring draw may (a repeat from
    # an earlier round): it is not fresh, and never zeroed twice.
    fresh = (trees.leaf_values(tree, d) > 0) & alive if window is not None else alive
    ok = eligible_fn(d) & fresh
    acc = ok if replace else ok & first
    rank = jnp.cumsum(acc.astype(jnp.int32)) - 1
    take = acc & (rank < b - n)
    picked = picked.at[jnp.where(take, n + rank, b)].set(d, mode="drop")
    remove = ((~ok if replace else take | ~ok) & first) & fresh & track
    return picked, n + jnp.sum(take, dtype=jnp.int32), jnp.where(remove, d, -1)

  # Uniforms for later rounds are drawn only when those rounds run: on CPU
  # the threefry draws cost more than the rest of a round.
  k_first, k_more, fallback_key = jax.random.split(rng, 3)
  tree0 = w.tree if reads is None else inplace.tie(w.tree, inplace.never(reads))
  picked, n, cand = one_round(tree0, jnp.full((b,), -1, jnp.int32), jnp.int32(0),
                              jax.random.uniform(k_first, (m,)), w.total(tree0) > 0)
  touched = lax.dynamic_update_slice(jnp.full((ROUNDS * m,), -1, jnp.int32), cand, (0,))

  def cond(c):
    _, _, n, rnd, _ = c
    return (n < b) & (rnd < ROUNDS)

  def body(c):
    tree, picked, n, rnd, touched = c
    if track:
      prev = lax.dynamic_slice(touched, ((rnd - 1) * m,), (m,))
      tree = w.zero(tree, jnp.maximum(prev, 0), prev >= 0)
    alive = w.total(tree) > 0
    u = jax.random.uniform(jax.random.fold_in(k_more, rnd), (m,))
    picked, n, cand = one_round(tree, picked, n, u, alive)
    touched = lax.dynamic_update_slice(touched, cand, (rnd * m,))
    return tree, picked, n, jnp.where(alive, rnd + 1, ROUNDS), touched

  tree, picked, n, rnd, touched = lax.while_loop(
      cond, body, (tree0, picked, n, jnp.int32(1), touched))
  # Leaves of rounds 0 .. rnd - 2 are zeroed; the last round's are not.
  zeroed = jnp.where(jnp.arange(ROUNDS * m) < (rnd - 1) * m, touched, -1)

  def remaining():
    # Weights left for the completion: not drawn before (picked or ineligible).
    idx = jnp.where(touched >= 0, touched, spec.capacity)
    drawn = jnp.zeros((spec.capacity,), bool).at[idx].set(True, mode="drop")
    return jnp.where(drawn, 0.0, w.leaves(tree)), eligible_all()

  picked = lax.cond(n < b, functools.partial(_complete, spec, fallback_key, n, replace,
                                             remaining), lambda p: p, picked)
  # The completion reads the tree: later in-place writes must wait for it.
  tree = inplace.tie(tree, inplace.never(picked))
  return picked, tree, zeroed


def restore_zeroed(spec: TableSpec, state: TableState, zeroed, tree_field: str) -> TableState:
  """Put the leaves ``_draw_weighted`` left zeroed back, from the columns (a no-op,
  skipped at run time, when it zeroed none)."""
  def restore(tree):
    st = indexes.refresh(spec, state.replace(**{tree_field: tree}), jnp.maximum(zeroed, 0),
                         zeroed >= 0, which=(tree_field,), count_zero=False)
    return getattr(st, tree_field)

  tree = getattr(state, tree_field)
  return state.replace(**{tree_field: lax.cond(jnp.any(zeroed >= 0), restore, lambda t: t,
                                               tree)})


def _complete(spec, key, n, replace, weights_fn, picked):
  """Rows ``n..B-1`` of ``picked`` by an O(C) Gumbel-top-k (or categorical draws with
  replacement) over ``weights_fn() -> (float32[C] weights, bool[C] eligible)``.

  The rounds of draws ran out (heavy masks); this is the same distribution,
  only slower.
  """
  b = picked.shape[0]
  weights, eligible = weights_fn()
  ok = eligible & (weights > 0)
  logits = jnp.where(ok, jnp.log(jnp.where(ok, weights, 1.0)), -jnp.inf)
  pos = jnp.arange(b) - n
  if replace:
    draws = jax.random.categorical(key, logits, shape=(b,)).astype(jnp.int32)
    extra = jnp.where(jnp.any(ok), draws[jnp.clip(pos, 0, b - 1)], -1)
  else:
    k = min(b, spec.capacity)
    top_vals, top_slots = lax.top_k(logits + jax.random.gumbel(key, logits.shape), k)
    top_slots = jnp.where(jnp.isfinite(top_vals), top_slots, -1)
    top_slots = jnp.concatenate([top_slots, jnp.full((b - k,), -1, jnp.int32)])
    extra = top_slots[jnp.clip(pos, 0, b - 1)]
  return jnp.where(pos < 0, picked, extra)


def ring_window(spec: TableSpec, state: TableState):
  """``(start, filled)`` of a ``Fifo``-remover table: the ``filled`` slots written
  so far, oldest first from slot ``start`` (wrapping). Every item lies in this
  window, so when ``state.size == filled`` the window has no holes."""
  c = spec.capacity
  hi, lo = state.counters["inserts"][0], state.counters["inserts"][1]
  filled = jnp.where(hi > 0, c, jnp.minimum(lo, jnp.uint32(c))).astype(jnp.int32)
  return (state.write_pos - filled + c) % c, filled


def _draw_stratified(spec, state, rng, batch_size):
  """One draw per equal-mass stratum of the weight tree, rows in random order."""
  w = _Weights(spec, state)
  k1, k2 = jax.random.split(rng)
  u = (jnp.arange(batch_size) + jax.random.uniform(k1, (batch_size,))) / batch_size
  slots = w.draw(w.tree, jnp.minimum(u, 1.0 - 1e-7))
  # Rows in random order: a slot-sorted batch biases consumers that split it.
  slots = jax.random.permutation(k2, slots)
  # A drawn leaf has weight > 0 exactly when the total is > 0. (The root, a
  # cheap slice, would be re-read by every fused use of the result.)
  return jnp.where(trees.leaf_values(w.tree, slots) > 0, slots, -1)


def sample(spec: TableSpec, state: TableState, rng, *, batch_size: int, version=None,
           where=None, replace: bool = False, stratified: bool = False, enabled=None,
           native: bool = False, split_key: bool = False, packed: bool = False):
  """Sample ``batch_size`` items.

  Args:
    rng: a PRNG key.
    batch_size: static ``B``.
    version: current policy version (int32 scalar). With
      ``spec.max_staleness`` set, items with ``version - item_version >
      max_staleness`` are not eligible. None disables the staleness mask.
    where: optional bool ``[C]`` mask over slots (e.g. ``state.metadata["task"] == 3``).
    replace: sample with replacement (default: a batch never repeats a slot).
      With replacement an item may appear more often in one batch than its
      remaining ``max_times_sampled`` allowance; it is freed after the batch.
    stratified: (Uniform / Prioritized, with ``replace=True``, no masks)
      split the total weight into ``B`` equal strata and draw one item from
      each, as in PER's proportional variant; rows come in random order.
    enabled: optional bool scalar (traced). When False the call samples
      nothing: the state comes back unchanged and every row is invalid
      (``num_eligible`` still reports the eligible count). Lets a jitted loop
      gate sampling on ``can_sample`` without a ``lax.cond`` of its own.
    native: use the native CPU kernel where one applies (``funcreplay.native``;
      ``make_table`` sets this). Other backends run the JAX implementation.
    split_key: also return the next key of a key sequence: the sample uses a
      key derived from ``rng``, and ``(state, Sample, next_rng)`` comes back
      (the host ``Table`` keeps its key this way); with ``enabled`` False the
      key does not advance (``next_rng`` is ``rng``). The native kernel derives
      both from ``rng`` itself: on XLA:CPU a ``jax.random.split`` in the same
      program costs ~70 us (its rolled threefry loop moves the program off
      the caller's thread).
    packed: return the batch as a ``PackedSample`` (one uint8 buffer,
      ``funcreplay.packing``) instead of a ``Sample``; the native kernel
      writes it directly. Needs whole-byte item dtypes.

  Returns:
    ``(state, Sample)`` (``(state, PackedSample)`` with ``packed``; a third
    element, the next key, with ``split_key``). The state has
    ``times_sampled`` incremented for every returned row, items that reached
    ``max_times_sampled`` freed, and the ``samples`` counter advanced by the
    number of valid rows. When fewer than ``B`` items are eligible the
    remaining rows have ``valid=False``, slot -1 and zero data.
  """
  b = batch_size
  if not isinstance(b, int) or b < 1:
    raise ValueError(f"sample: batch_size must be a static int >= 1, got {b!r}.")
  if not replace and b > spec.capacity:
    raise ValueError(f"sample: batch_size {b} exceeds capacity {spec.capacity}; without "
                     "replacement a batch cannot hold more items than the table.")
  if replace and sel.is_ordered(spec.sampler):
    raise ValueError(f"sample: replace=True is not supported by the deterministic "
                     f"{type(spec.sampler).__name__} sampler.")
  masked = ops.masks_active(spec, version, where)
  if stratified and (not replace or masked or sel.is_ordered(spec.sampler)):
    raise ValueError("sample: stratified=True needs replace=True, a Uniform or Prioritized "
                     "sampler, and no where/staleness mask (strata are over the whole table).")
  ver = None if version is None else jnp.asarray(version, jnp.int32)
  enabled = None if enabled is None else jnp.asarray(enabled, bool)
  layout = packing.layout(spec.signature, b) if packed else None  # raises if unpackable

  def portable(st):
    key = rng
    if split_key:
      next_key, key = jax.random.split(rng)

    def do(st):
      return _sample_portable(spec, st, key, b, ver, where, replace, stratified=stratified,
                              masked=masked)

    def skip(st):
      zeros = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype),
                                     jax.eval_shape(do, st)[1])
      info = dataclasses.replace(zeros.info, slot=jnp.full((b,), -1, jnp.int32))
      return st, dataclasses.replace(zeros, info=info,
                                     num_eligible=ops.count(spec, st, where, ver))

    out = do(st) if enabled is None else lax.cond(enabled, do, skip, st)
    if layout is not None:
      out = (out[0], packing.PackedSample(packing.pack(out[1], layout), layout))
    if not split_key:
      return out
    if enabled is not None:  # a disabled call keeps the key
      next_key = lax.cond(enabled, lambda: next_key, lambda: rng)
    return (*out, next_key)

  if native and native_lib.supports_sample(spec, stratified) and native_lib.available():
    from funcreplay.native import sample as native_sample

    def kernel(st):
      st, out, next_key = native_sample.sample(spec, st, rng, b, ver, where, replace, enabled,
                                               layout)
      if layout is not None:
        out = packing.PackedSample(out, layout)
      return (st, out, next_key) if split_key else (st, out)

    return lax.platform_dependent(state, cpu=kernel, default=portable)
  return portable(state)


def _sample_portable(spec, state, rng, b, ver, where, replace, *, stratified, masked):
  """``sample`` in JAX operations (every backend); arguments validated."""

  def eligible_all():
    return ops.eligible_mask(spec, state, ver, where)

  def eligible_fn(slots):
    ok = state.occupied[slots]
    if ver is not None and spec.max_staleness is not None:
      ok = ok & (state.version[slots] >= staleness.threshold(spec, ver))
    if where is not None:
      ok = ok & eligible_where[slots]
    return ok

  eligible_where = None if where is None else ops.eligible_mask(spec, state, None, where)

  if sel.is_ordered(spec.sampler):
    order, ok = ordering.sorted_eligible(spec.sampler, state, eligible_all())
    picked = jnp.where(ok[:b], order[:b], -1)
    num_eligible = jnp.sum(ok, dtype=jnp.int32)
    prob = jnp.ones((b,), jnp.float32)
  else:
    # Totals are read before the draw, which updates the tree in place. XLA
    # would re-fuse these cheap reads into each later use, each an unordered
    # read of the tree (a copy); ``once`` makes them single reads.
    size0, unmasked_total, zero0 = inplace.once(
        (state.size, state.weight_tree[1] if spec.prioritized else jnp.float32(0),
         indexes.zero_weight_count(spec, state)))
    if stratified:
      w = _Weights(spec, state)
      picked = _draw_stratified(spec, state, rng, b)
      tree, touched = w.tree, None
    else:
      window = None
      if isinstance(spec.sampler, sel.Uniform) and sel.is_ring(spec.remover):
        start, filled = ring_window(spec, state)
        window = (start, filled, size0 == filled)
      picked, tree, touched = _draw_weighted(spec, state, rng, b, replace, eligible_fn,
                                             eligible_all, (size0, unmasked_total), window,
                                             masked)
    safe = jnp.maximum(picked, 0)
    if spec.prioritized:
      w_item = indexes.sample_weight(spec, ops.take(state.occupied, safe),
                                    ops.take(state.priority, safe))
      if masked:
        mask = eligible_all()
        total = jnp.sum(jnp.where(mask, indexes.sample_weight(spec, state.occupied,
                                                              state.priority), 0.0))
        num_eligible = jnp.sum(mask, dtype=jnp.int32)
      else:
        total, num_eligible = unmasked_total, size0 - zero0
      prob = w_item / jnp.maximum(total, 1e-30)
    else:
      num_eligible = ops.count(spec, state, where, ver, size=size0)
      prob = jnp.full((b,), 1.0, jnp.float32) / jnp.maximum(num_eligible, 1).astype(jnp.float32)
    tree_field = "weight_tree" if spec.prioritized else "occ_tree"
    # _finish writes occupied (and the trees): order the reads so far (draws,
    # fallback, counts, totals) before those writes.
    flag = inplace.never((picked, prob, num_eligible))
    state = state.replace(occupied=inplace.tie(state.occupied, flag),
                          **{tree_field: inplace.tie(tree, flag)})
    state, out = _finish(spec, state, picked, prob, num_eligible, ver, replace)
    if touched is not None:
      # Put the temporarily zeroed leaves back, from the (updated) columns.
      state = restore_zeroed(spec, state, touched, tree_field)
    # Later operations in the same program (update_priorities, insert) write
    # the columns this call read: order all its reads (the returned rows and,
    # through the tree roots, the refreshes) before them.
    roots = [t[1] for t in (state.occ_tree, state.weight_tree, state.remover_tree) if t.size]
    state = inplace.settle(state, (out, roots), spec.capacity)
    return state, out
  return _finish(spec, state, picked, prob, num_eligible, ver, replace=False)


def _finish(spec, state, picked, prob, num_eligible, ver, replace):
  """Gather the rows of ``picked`` (-1: invalid), count the sample, free items
  that reached ``max_times_sampled``. ``replace``: ``picked`` may repeat a slot."""
  valid = picked >= 0
  safe = jnp.maximum(picked, 0)
  cap = spec.capacity

  def rows(x):
    v = valid.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(v, ops.take(x, safe), jnp.zeros((), x.dtype))

  data = jax.tree_util.tree_map(rows, state.data)
  idx = jnp.where(valid, safe, cap)
  if idx.shape[0] == 1:  # keep it a scatter, not a slice update (see ops.take)
    idx = jnp.concatenate([idx, jnp.full((1,), cap, idx.dtype)])
  times = state.times_sampled.at[idx].add(1, mode="drop")
  state = state.replace(times_sampled=times)
  n_valid = jnp.sum(valid, dtype=jnp.int32)
  c = dict(state.counters)
  c["samples"] = ctr.add(c["samples"], n_valid)
  if ver is not None:
    staleness = jnp.maximum(ver - ops.take(state.version, safe), 0)
    c["sampled_staleness_sum"] = ctr.add_sum(c["sampled_staleness_sum"], staleness, valid)
  state = state.replace(counters=c, limiter_diff=rl.update_diff(
      spec.rate_limiter, state.limiter_diff, sampled=n_valid))
  info = SampleInfo(
      slot=jnp.where(valid, safe, -1),
      key=jnp.where(valid, ops.take(state.key, safe), jnp.uint32(0)),
      probability=jnp.where(valid, prob, 0.0),
      priority=jnp.where(valid, ops.take(state.priority, safe), 0.0),
      times_sampled=jnp.where(valid, ops.take(times, safe), 0),
      version=jnp.where(valid, ops.take(state.version, safe), 0))
  if spec.max_times_sampled > 0:
    exhausted = valid & (ops.take(times, safe) >= spec.max_times_sampled)
    if replace:  # a slot can appear twice: count it once (without, rows are distinct)
      exhausted = ops.last_occurrence(safe, exhausted)
    state = ops._remove(spec, state, safe, exhausted, "evicted_reuse")  # noqa: SLF001
    # Sampled items had a positive weight: the zero-weight count does not move
    # (and leaves the draw zeroed would read as zero).
    state = indexes.refresh(spec, state, safe, exhausted, count_zero=False)
  return state, Sample(data=data, valid=valid, info=info, num_eligible=num_eligible)


def importance_weights(sample: Sample, beta: float):
  """PER importance weights ``(N * P(i))**-beta / max`` over valid rows (0 elsewhere)."""
  n = jnp.maximum(sample.num_eligible, 1).astype(jnp.float32)
  p = jnp.where(sample.valid, sample.info.probability, 1.0)
  w = jnp.power(n * jnp.maximum(p, 1e-30), -beta)
  w = jnp.where(sample.valid, w, 0.0)
  return w / jnp.maximum(jnp.max(w), 1e-30)
