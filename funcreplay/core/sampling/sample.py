"""``sample``: draw a batch, bump reuse counters, free exhausted items.

Weighted selectors (Uniform, Prioritized) draw from a device tree: the lean
programs (``uniform_lean``, ``prioritized_lean``) without masks, else the
draws of ``sampling.exact`` (rounds of i.i.d. candidates, successive
sampling, exact completions). All of them are the recipe the native kernel
follows bit for bit (BUILD.md "Bit recipe"): on CPU ``native`` on or off
gives the same batch and state for the same ``(state, key)``. Eligibility
comes from ``sampling.eligibility``, the bookkeeping from ``sampling.finish``.

Deterministic selectors (Fifo, Lifo, MinHeap, MaxHeap, StalestFirst,
FreshestFirst) take the first B eligible items in their order by a radix
select over top-k passes (``ordering.first_eligible``: O(C) a digit, no sort
of the table); a Fifo or Lifo sampler on a ring without masks (Reverb's queue)
has a lean program that reads the order off the ring instead, O(B log C), O(B)
in a table without holes (``ring_order``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import (
  bits,
  executor,
  fixedpoint,
  indexes,
  inplace,
  numerics,
  ops,
  ordering,
  packing,
  staleness,
  storage,
)
from funcreplay.core import selectors as sel
from funcreplay.core.sampling import exact, prioritized_lean, ring_order, uniform_lean
from funcreplay.core.sampling.draw import Weights as _Weights
from funcreplay.core.sampling.draw import draw_stratified as _draw_stratified
from funcreplay.core.sampling.draw import restore_zeroed
from funcreplay.core.sampling.eligibility import eligibility
from funcreplay.core.sampling.finish import finish as _finish
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState

MAX_BATCH_SIZE = 2**31 - 1  # rows (and slots) are indexed with int32


def sample(spec: TableSpec, state: TableState, rng, *, batch_size: int, version=None,
           where=None, replace: bool = False, stratified: bool = False, enabled=None,
           native: Optional[executor.Executor] = None, split_key: bool = False,
           packed: bool = False):
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
    native: an executor (``core.executor``) whose CPU kernel runs where one
      applies (``fr.make_table`` passes ``funcreplay.native``'s); other
      backends, and None, run the JAX implementation.
    split_key: also return the next key of a key sequence: ``next_rng, key =
      jax.random.split(rng)``, the sample uses ``key``, and ``(state, Sample,
      next_rng)`` comes back (the host ``Table`` keeps its key this way); with
      ``enabled`` False the key does not advance (``next_rng`` is ``rng``).
      For threefry keys the split is unrolled (``exact.split``, the same bits):
      on XLA:CPU jax's rolled threefry loop costs ~70 us in the same program
      (it moves the program off the caller's thread).
    packed: return the batch as a ``PackedSample`` (one uint8 buffer,
      ``funcreplay.core.packing``) instead of a ``Sample``; the native kernel
      writes it directly. Needs whole-byte item dtypes.

  Returns:
    ``(state, Sample)`` (``(state, PackedSample)`` with ``packed``; a third
    element, the next key, with ``split_key``). The state has
    ``times_sampled`` incremented for every returned row, items that reached
    ``max_times_sampled`` freed, and the ``samples`` counter advanced by the
    number of valid rows. When fewer than ``B`` items are eligible the
    remaining rows have ``valid=False``, slot -1 and zero data.
  """
  bits.check_key(rng, "sample")
  b = batch_size
  if isinstance(b, jax.core.Tracer):
    raise ValueError(f"sample: batch_size is a traced value ({b!r}); it sets the shape of the "
                     "batch, so it must be a static Python int. Under jax.jit mark it static, "
                     "e.g. jax.jit(f, static_argnames=('batch_size',)), or close over it.")
  if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_BATCH_SIZE:
    raise ValueError(f"sample: batch_size must be a static int in [1, {MAX_BATCH_SIZE}] (rows "
                     f"are indexed with int32), got {b!r}.")
  if not replace and b > spec.capacity:
    raise ValueError(f"sample: batch_size {b} exceeds capacity {spec.capacity}; without "
                     "replacement a batch cannot hold more items than the table.")
  if replace and sel.is_ordered(spec.sampler):
    raise ValueError(f"sample: replace=True is not supported by the deterministic "
                     f"{type(spec.sampler).__name__} sampler.")
  storage.check(spec, state.data, "sample")
  masked = ops.masks_active(spec, version, where)
  if stratified and (not replace or masked or sel.is_ordered(spec.sampler)):
    raise ValueError("sample: stratified=True needs replace=True, a Uniform or Prioritized "
                     "sampler, and no where/staleness mask (strata are over the whole table).")
  ver = None if version is None else staleness.as_version(version, "sample: version",
                                                           scalar=True)
  enabled = None if enabled is None else jnp.asarray(enabled, bool)
  layout = packing.layout(spec.signature, b) if packed else None  # raises if unpackable

  def portable(st):
    key = rng
    if split_key:
      next_key, key = exact.split(rng) if exact.is_threefry(rng) else jax.random.split(rng)

    def do(st):
      lean = lean_program(spec, version=ver, where=where, stratified=stratified)
      if lean is not None:
        return lean(spec, st, key, batch_size=b, version=ver, replace=replace)
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

  native = executor.check(native, "sample")
  # The kernel reproduces threefry keys only (other key implementations: portable).
  if (native and native.supports_sample(spec, stratified) and exact.is_threefry(rng)
      and native.available()):

    def kernel(st):
      st, out, next_key = native.sample(spec, st, rng, b, ver, where, replace, enabled, layout,
                                        split_key)
      if layout is not None:
        out = packing.PackedSample(out, layout)
      return (st, out, next_key) if split_key else (st, out)

    return lax.platform_dependent(state, cpu=kernel, default=portable)
  return portable(state)


def lean_program(spec: TableSpec, *, version=None, where=None, stratified: bool = False):
  """The lean portable sample program for these static arguments, or None.

  ``uniform_lean.sample`` / ``prioritized_lean.sample`` / ``ring_order.sample``
  (BUILD.md "Lean portable programs") when their ``applies`` holds (a Uniform sampler,
  no ``where`` or staleness mask, any reuse limit; a Prioritized one, no mask,
  ``max_times_sampled == 0``; a Fifo or Lifo one on the ring without masks) and the
  draw is not ``stratified``; they honour the
  same contract as the general program (valid mask, probabilities,
  ``times_sampled``, counters, used-up items freed) with different random draws
  (the uniform one; the prioritized draw is the general program's). Everything
  else takes the general program.
  """
  if stratified:
    return None
  for program in (uniform_lean, prioritized_lean, ring_order):
    if program.applies(spec, version=version, where=where):
      return program.sample
  return None


def _sample_portable(spec, state, rng, b, ver, where, replace, *, stratified, masked):
  """``sample`` in JAX operations (every backend); arguments validated."""

  eligible_fn, eligible_all = eligibility(spec, state, ver, where)

  if sel.is_ordered(spec.sampler):
    picked, num_eligible = ordering.first_eligible(spec.sampler, state, eligible_all(), b)
    prob = jnp.ones((b,), jnp.float32)
  else:
    # Totals are read before the draw, which updates the tree in place. XLA
    # would re-fuse these cheap reads into each later use, each an unordered
    # read of the tree (a copy); ``once`` makes them single reads.
    size0, unmasked_total, zero0 = inplace.once(
        (state.size, state.weight_tree[1] if spec.prioritized else jnp.float32(0),
         indexes.zero_weight_count(spec, state)))
    touched = None
    if stratified:
      w = _Weights(spec, state)
      picked = _draw_stratified(spec, state, rng, b)
      tree = w.tree
      total = unmasked_total
    elif spec.prioritized:
      tree = state.weight_tree
      total = unmasked_total
      draw_tree = tree
      if masked:  # the eligible leaves' own sum tree (its root: the eligible weight)
        # Computed once (XLA would re-fuse the leaf reads into each use, some of them
        # unordered with the in-place writes after the draw: a tree copy).
        mask = inplace.materialize(eligible_all().astype(jnp.int32)) > 0
        draw_tree = exact.masked_tree(tree, mask)
        total = draw_tree[1]
      picked = exact.successive(draw_tree, rng, b, replace, spec.tree_size,
                                indexes.tiny_weights(spec))
      if replace:
        # Materialized: with replacement the descent's last level is not, and XLA re-fused
        # it, with its reads of the tree, into each consumer of the slots; the writes of
        # the tree after the draw (a reuse limit's used-up items) waited for only some of
        # them, and XLA:CPU copied the tree twice a call.
        picked = inplace.materialize(picked)
    else:
      picked, tree, touched = exact.draw_uniform(spec, state, rng, b, replace, eligible_fn,
                                                 eligible_all, (size0, unmasked_total), masked)
    safe = jnp.maximum(picked, 0)
    if spec.prioritized:
      # The stored weight (the leaf the draw saw), not p**alpha recomputed: a kernel
      # reproduces a read, not XLA's pow.
      w_item = ops.take(state.weight_tree, spec.tree_size + safe)  # a real gather at B = 1
      num_eligible = jnp.sum(mask, dtype=jnp.int32) if masked else size0 - zero0
      # Correctly rounded from integers (fixedpoint.divide): XLA:GPU's float division is
      # not; the kernels' DivideExact (csrc/fixedpoint.h) gives the same bits.
      prob = fixedpoint.divide(w_item, jnp.maximum(total, numerics.MIN_TOTAL))
    else:
      num_eligible = ops.count(spec, state, where, ver, size=size0)
      prob = jnp.broadcast_to(
          fixedpoint.divide(1.0, jnp.maximum(num_eligible, 1).astype(jnp.float32)), (b,))
    tree_field = "weight_tree" if spec.prioritized else "occ_tree"
    # _finish writes occupied, item_info (and the trees): order the reads so far (draws,
    # fallback, counts, totals, the staleness mask's versions) before those writes.
    flag = inplace.never((picked, prob, num_eligible))
    state = state.replace(occupied=inplace.tie(state.occupied, flag),
                          item_info=inplace.tie(state.item_info, flag),
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
  # _finish writes item_info: order the ordering's reads of it (priorities, versions) first.
  state = state.replace(item_info=inplace.tie(state.item_info, inplace.never(picked)))
  state, out = _finish(spec, state, picked, prob, num_eligible, ver, replace=False)
  # As above: a later insert in the same program writes the rows and columns read here
  # (without this, XLA copied the data and ``occupied`` every step of a queue's scan).
  return inplace.settle(state, (out, state.occ_tree[1]), spec.capacity), out


