"""The weighted draws of ``sample`` (Uniform, Prioritized selectors).

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
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import bits, fixedpoint, indexes, inplace, powers, trees, weight_descent
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState

# Rounds of candidate draws in ``draw_weighted`` before the exact O(C)
# completion (``_complete``) finishes the batch. Round 0 nearly always fills it;
# later rounds run only when masks (``where``, staleness) reject many
# candidates, each drawing from the weight not yet tried. The bound keeps the
# while-loop and its buffer of zeroed leaves (``ROUNDS * M``) small: a table
# masked so heavily that 4 rounds do not suffice gets the same distribution
# from the completion.
ROUNDS = 4


def candidates_per_round(batch_size: int) -> int:
  """``M = B + max(8, B // 2)``: i.i.d. candidates drawn per round for a batch of ``B``.

  The slack over ``B`` absorbs repeats (without replacement) and candidates a
  mask rejects, so round 0 usually fills the batch; at least 8 extra so that
  a small batch is not left short by a few repeats; half of ``B`` for large
  batches, whose repeat count grows with ``B**2 / C``.
  """
  return batch_size + max(8, batch_size // 2)


def first_occurrence(d):
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


def by_weight(tree, hi, lo, tiny: bool = True):
  """``exact.successive``'s i.i.d. descents of the sum ``tree`` by the random words ``hi``,
  ``lo`` (uint32[M]): target ``uniform24(hi) * total`` (materialized, so that no backend
  fuses the product into the first subtraction), redrawn from ``uniform24(lo)``."""
  targets = lax.bitcast_convert_type(inplace.materialize(lax.bitcast_convert_type(
      bits.uniform24_times(hi, tree[1], tiny), jnp.int32)), jnp.float32)
  return weight_descent.descend_weight(tree, targets, bits.uniform24(lo))


class Weights:
  """Uniform (occupancy counts) or prioritized (p**alpha) weight tree."""

  def __init__(self, spec: TableSpec, state: TableState):
    self.spec = spec
    self.prioritized = spec.prioritized
    self.tree = state.weight_tree if self.prioritized else state.occ_tree

  def total(self, tree):
    return tree[1]

  def draw(self, tree, hi, lo):
    """Slots drawn i.i.d. by the random words ``hi``, ``lo`` (uint32[M]): proportionally
    to weight (``exact.successive``'s descent: target ``uniform24(hi) * total``, redrawn
    from ``lo``), or uniformly over the occupied slots (the ``below(hi, lo, count)``-th)."""
    if self.prioritized:
      return by_weight(tree, hi, lo, indexes.tiny_weights(self.spec))
    k = bits.below(hi, lo, jnp.maximum(tree[1], 1).astype(jnp.uint32)).astype(jnp.int32)
    return trees.descend_count(tree, k, free=False)

  def draw_at(self, tree, u):
    """The slots at fractions ``u`` (float32[M] in [0, 1)) of the total weight (or of the
    occupied slots): one-stage descents (a stratum's target picks the leaf itself)."""
    if self.prioritized:
      return weight_descent.descend_weight(tree, u * tree[1], None)
    tot = tree[1]
    k = jnp.minimum((u * tot.astype(jnp.float32)).astype(jnp.int32), tot - 1)
    return trees.descend_count(tree, jnp.maximum(k, 0), free=False)

  def zero(self, tree, slots, valid):
    refresh = trees.refresh_sum if self.prioritized else trees.refresh_count
    return refresh(tree, slots, jnp.zeros(slots.shape, tree.dtype), valid)

  def leaves(self, tree):
    p = tree.shape[0] // 2
    return tree[p:p + self.spec.capacity].astype(jnp.float32)


def draw_weighted(spec, state, rng, batch_size, replace, eligible_fn, eligible_all,
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
  w = Weights(spec, state)
  b = batch_size
  m = candidates_per_round(b)

  def draw(tree, words):
    if window is None:
      return w.draw(tree, *words)
    start, filled, hole_free = window
    hi, lo = words
    by_ring = lambda: (start + bits.below(  # noqa: E731
        hi, lo, jnp.maximum(filled, 1).astype(jnp.uint32)).astype(jnp.int32)) % spec.capacity
    return lax.cond(hole_free, by_ring, lambda: w.draw(tree, hi, lo))

  track = masked or not replace  # candidates can be rejected: find repeats, zero them

  def one_round(tree, picked, n, words, alive):
    """Candidates from ``tree`` by the random ``words`` (``(hi, lo)`` uint32[M]);
    ``alive``: False once the tree holds no weight."""
    if track:
      first, d = first_occurrence(draw(tree, words))
    else:
      first, d = True, draw(tree, words)
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

  # Random words for later rounds are drawn only when those rounds run: on CPU
  # the threefry draws cost more than the rest of a round.
  k_first, k_more, fallback_key = jax.random.split(rng, 3)
  tree0 = w.tree if reads is None else inplace.tie(w.tree, inplace.never(reads))
  picked, n, cand = one_round(tree0, jnp.full((b,), -1, jnp.int32), jnp.int32(0),
                              bits.words(k_first, m), w.total(tree0) > 0)
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
    words = bits.words(jax.random.fold_in(k_more, rnd), m)
    picked, n, cand = one_round(tree, picked, n, words, alive)
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
  """Rows ``n..B-1`` of ``picked`` by O(C) exponential races (with replacement, i.i.d.
  descents of a sum tree built over the weights) over ``weights_fn() -> (float32[C]
  weights, bool[C] eligible)``.

  The rounds of draws ran out (heavy masks); this is the same distribution,
  only slower. Both draws are the same bits on every backend (no ``jnp.log``, no Gumbel
  noise: a categorical draw was not).
  """
  b = picked.shape[0]
  weights, eligible = weights_fn()
  ok = eligible & (weights > 0)
  pos = jnp.arange(b) - n
  if replace:
    # I.i.d. descents of a tree built over the weights, as ``exact.successive`` draws with
    # replacement (stream 0's words, ``Weights.draw``).
    p = spec.tree_size
    tree = trees.build_sum(jnp.zeros((p,), jnp.float32).at[:spec.capacity].set(
        jnp.where(ok, weights, 0.0)))
    hi, lo = bits.words(key, b)
    draws = jnp.where(tree[1] > 0, by_weight(tree, hi, lo, indexes.tiny_weights(spec)), -1)
    extra = draws[jnp.clip(pos, 0, b - 1)]
  else:  # exponential races, the k smallest: the same keys on every backend (powers)
    k = min(b, spec.capacity)
    race = powers.race_keys(jax.random.bits(key, weights.shape, jnp.uint32),
                            jnp.where(ok, weights, 0.0))
    top_vals, top_slots = lax.top_k(-race, k)
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


def draw_stratified(spec, state, rng, batch_size):
  """One draw per equal-mass stratum of the weight tree, rows in random order."""
  w = Weights(spec, state)
  k1, k2 = jax.random.split(rng)
  u = fixedpoint.divide(jnp.arange(batch_size) + jax.random.uniform(k1, (batch_size,)),
                        float(batch_size))  # the same bits on every backend
  slots = w.draw_at(w.tree, jnp.minimum(u, 1.0 - 1e-7))
  # Rows in random order: a slot-sorted batch biases consumers that split it.
  slots = jax.random.permutation(k2, slots)
  # A drawn leaf has weight > 0 exactly when the total is > 0. (The root, a
  # cheap slice, would be re-read by every fused use of the result.)
  return jnp.where(trees.leaf_values(w.tree, slots) > 0, slots, -1)
