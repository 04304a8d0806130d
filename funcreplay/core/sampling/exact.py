"""The draws of ``sample`` that the native kernel follows bit for bit (one algorithm, two
executors; BUILD.md "Bit recipe", native/csrc/draw.h).

Random bits come only from the sample key ``(k0, k1)`` (its first two data words), by
streams: stream ``s`` of ``n`` rows is ``threefry2x32(k, (s, c))`` for the flat counter
``c`` in ``[0, 2n)``, word ``y0 ^ y1``; row ``i`` takes ``hi = word i``, ``lo = word n + i``.
Stream 0 is ``bits.words`` (= ``jax.random.bits(key, (2, n), uint32)``). No ``log``, no
float sum whose order XLA chooses: everything a kernel must reproduce is integer
arithmetic, ``fl(a + b)`` sums in a fixed tree order, ``u * total`` and the descents.

* ``successive`` (Prioritized, any masks): ``M = B + max(8, B // 2)`` i.i.d. descents of a
  sum tree on stream 0, target ``uniform24(hi) * total`` redrawn as ``uniform24(lo) *`` the
  node's sum at ``weight_descent.redraw_depth`` (``M = B`` with ``replace``: those are the
  batch), the first ``B``
  distinct in draw order; when fewer, rounds ``j = 1, 2, ...`` on a copy of the tree with
  every slot picked so far zeroed, ``M`` descents on stream ``j`` each, keeping first
  occurrences, until the batch is full or no weight is left (each round adds at least one
  item). I.i.d. draws with repeats discarded, then draws from the renormalised rest, are
  exactly successive sampling. Under masks the tree is ``masked_tree`` (the eligible
  leaves, O(C)), whose root is also the probabilities' total.
* ``draw_uniform`` (Uniform with masks or a reuse limit): ``ROUNDS`` rounds of ``M``
  candidates, round ``r`` on stream ``r``: ``k = below(hi, lo, tree[1])``, the k-th
  occupied slot of the count tree (``uniform_lean.kth_occupied``). In draw order a
  candidate is taken if eligible (and, without replacement, its first occurrence in the
  round) while the batch has room. Before each later round the previous round's first
  occurrences that were taken (without replacement) or found ineligible are zeroed in the
  count tree (put back by ``draw.restore_zeroed``). A batch still short is completed over
  the eligible slots not picked, in slot order, by ``uniform_lean.positions`` on stream
  ``ROUNDS`` (O(C), under heavy masks only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import bits, inplace, trees, weight_descent
from funcreplay.core.sampling.draw import ROUNDS, candidates_per_round, first_occurrence
from funcreplay.core.sampling.uniform_lean import kth_occupied


def key_words(rng):
  """``(k0, k1)``: the uint32 words of a key's data the streams use."""
  key = jnp.asarray(rng)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return key[0].astype(jnp.uint32), key[1].astype(jnp.uint32)


def is_threefry(rng) -> bool:
  """Static: ``rng`` is a raw ``uint32[2]`` key or a typed threefry key (what the native
  kernel and ``split`` reproduce; other key implementations keep ``jax.random``)."""
  key = jnp.asarray(rng) if not isinstance(rng, jax.core.Tracer) else rng
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    return key.shape == () and "threefry" in str(jax.random.key_impl(key)).lower()
  return key.shape == (2,) and key.dtype == jnp.uint32


def stream_words(rng, n: int, stream):
  """``(hi, lo)`` uint32[n]: rows of stream ``stream`` (int or traced int32)."""
  k0, k1 = key_words(rng)
  count = jnp.arange(2 * n, dtype=jnp.uint32)
  s = jnp.broadcast_to(jnp.asarray(stream).astype(jnp.uint32), count.shape)
  y0, y1 = bits.threefry2x32(k0, k1, s, count)
  w = (y0 ^ y1).reshape(2, n)
  return w[0], w[1]


def split(rng):
  """``jax.random.split(rng)`` for a threefry key, without jax's rolled loop (on XLA:CPU a
  ``while`` moves the program off the caller's thread): key ``i`` is
  ``threefry2x32(k, (0, i))``. Returns ``(next_key, sample_key)`` of ``rng``'s type."""
  k0, k1 = key_words(rng)
  y0, y1 = bits.threefry2x32(k0, k1, jnp.zeros((2,), jnp.uint32), jnp.arange(2, dtype=jnp.uint32))
  pairs = jnp.stack([y0, y1], axis=1)  # [2, 2]: key i = (y0[i], y1[i])
  if jnp.issubdtype(jnp.asarray(rng).dtype, jax.dtypes.prng_key):
    impl = jax.random.key_impl(rng)
    return (jax.random.wrap_key_data(pairs[0], impl=impl),
            jax.random.wrap_key_data(pairs[1], impl=impl))
  return pairs[0], pairs[1]


def positions(rng, n, b: int, replace: bool, stream, n_max: int = 1 << 31):
  """``uniform_lean.positions`` on stream ``stream``: ``(x int32[b], valid bool[b])``."""
  hi, lo = stream_words(rng, b, stream)
  n = jnp.asarray(n, jnp.int32)
  if replace:
    x = bits.below(hi, lo, jnp.maximum(n, 1).astype(jnp.uint32)).astype(jnp.int32)
    return x, jnp.broadcast_to(n > 0, (b,))
  i = jnp.arange(b, dtype=jnp.int32)
  valid = i < n
  r = jnp.maximum(n - i, 1).astype(jnp.uint32)
  j = jnp.where(valid, i + bits.below(hi, lo, r).astype(jnp.int32), i)
  return bits.resolve(j, n_max), valid


def first_b(d, b: int, n_max: int):
  """``(picked int32[b], n)``: the first ``b`` distinct values of ``d`` (int32[M] in
  ``[0, n_max)``) in draw order, -1 padded; ``n`` how many."""
  m = d.shape[0]
  s_d, s_pos = bits.sort_pairs(d, n_max)
  first_sorted = jnp.concatenate([jnp.ones((1,), bool), s_d[1:] != s_d[:-1]])
  first = jnp.zeros((m,), bool).at[s_pos].set(first_sorted, unique_indices=True)
  rank = jnp.cumsum(first.astype(jnp.int32)) - 1
  picked = jnp.full((b,), -1, jnp.int32).at[jnp.where(first & (rank < b), rank, b)].set(
      d, mode="drop")
  return picked, jnp.minimum(rank[-1] + 1, b)


def _complete_successive(tree, rng, picked, n, m: int, tiny: bool):
  """Rows ``n..B-1`` of ``picked``: rounds on ``tree`` with the picked slots zeroed.

  Each round first zeroes the slots the previous one took (round 1: all of ``picked``), so
  the loop holds one tree refresh (fewer operations in the program; the same tree)."""
  b = picked.shape[0]
  p = tree.shape[0] // 2

  def cond(c):
    _, _, n, j, _ = c
    return (n < b) & (j <= b)  # each round adds >= 1: b rounds suffice

  def body(c):
    t, picked, n, j, pending = c
    t = trees.refresh_sum(t, jnp.maximum(pending, 0), jnp.zeros((b,), t.dtype), pending >= 0)
    alive = t[1] > 0
    hi, lo = stream_words(rng, m, j)
    d = _descend_weight(t, bits.uniform24_times(hi, t[1], tiny), bits.uniform24(lo),
                        inplace.materialize)
    new, _ = first_b(d, b, p)  # this round's distinct slots, in draw order
    rank = jnp.arange(b, dtype=jnp.int32)
    take = (new >= 0) & (rank < b - n) & alive
    picked = picked.at[jnp.where(take, n + rank, b)].set(new, mode="drop")
    n = n + jnp.sum(take, dtype=jnp.int32)
    # No weight left: stop (n = b ends the loop; picked keeps its -1 rows).
    return t, picked, jnp.where(alive, n, b), j + 1, jnp.where(take, new, -1)

  out = lax.while_loop(cond, body, (tree, picked, n, jnp.int32(1), picked))
  return out[1]


# Levels a step of the weight descent off the CPU. On a GPU each step is one materialized
# kernel (~1 us whatever its work): 4 levels (16 one-element reads a target, then their
# pairwise sums) take the 18 levels of a 262,144-slot tree in 5 steps instead of 9, three
# kernels fewer a prioritized step (experiments/accel_hlo.py, BUILD.md finding 27; 6 levels
# no fewer). XLA:CPU runs 2 levels a step fastest (``weight_descent.descend_weight_blocked``).
ACCELERATOR_WEIGHT_LEVELS = 4


def _descend_weight(tree, targets, fresh, materialize):
  """``weight_descent.descend_weight_blocked`` with each backend's levels a step: the same
  leaves, bit for bit (chosen when the program is lowered: no condition in it)."""
  return lax.platform_dependent(
      tree, targets, fresh,
      cpu=lambda t, u, f: weight_descent.descend_weight_blocked(t, u, f, materialize),
      default=lambda t, u, f: weight_descent.descend_weight_blocked(t, u, f, materialize,
                                                           levels=ACCELERATOR_WEIGHT_LEVELS))


def successive(tree, rng, b: int, replace: bool, n_max: int, tiny: bool = True):
  """Prioritized draw from the sum ``tree`` (module doc): int32[b] slots, -1 padded.
  ``tiny`` (static): ``indexes.tiny_weights`` (``bits.uniform24_times``)."""
  m = b if replace else candidates_per_round(b)
  total = tree[1]
  hi, lo = bits.words(rng, m)
  # The targets on their own (materialized): fused into the descent's first subtraction,
  # ``u * total - left`` may become one fused multiply-add on a GPU (one rounding, not two),
  # and the same key would descend differently there.
  # With the redraw's uniforms, in one materialization (on a GPU one kernel: the random
  # words are computed once, not again in the step of the redraw).
  both = lax.bitcast_convert_type(inplace.materialize(lax.bitcast_convert_type(
      jnp.concatenate([bits.uniform24_times(hi, total, tiny), bits.uniform24(lo)]),
      jnp.int32)),
      jnp.float32)
  targets, fresh = both[:m], both[m:]
  # Bit for bit weight_descent.descend_weight, 2 levels per step on CPU (faster in a scan).
  d = _descend_weight(tree, targets, fresh, inplace.materialize)
  alive = total > 0
  if replace:
    return jnp.where(alive, d, -1)
  picked, n = first_b(d, b, n_max)
  picked = jnp.where(alive, picked, -1)
  def complete(p):
    # Named: the completion works on a copy of the tree (tests/core/test_inplace.py exempts it).
    with jax.named_scope("exact_completion"):
      return _complete_successive(tree, rng, p, n, m, tiny)

  return lax.cond(alive & (n < b), complete, lambda p: p, picked)


def masked_tree(tree, mask):
  """``trees.build_sum`` over the leaves of ``tree`` in ``mask`` (bool[C]; others 0)."""
  p = tree.shape[0] // 2
  c = mask.shape[0]
  leaves = jnp.where(mask, tree[p:p + c], 0.0)
  return trees.build_sum(jnp.concatenate([leaves, jnp.zeros((p - c,), tree.dtype)]))


def draw_uniform(spec, state, rng, b: int, replace: bool, eligible_fn, eligible_all,
                 reads=None, masked: bool = True):
  """The masked / reuse-limited uniform draw (module doc).

  ``reads``: values the caller read from the count tree before (the draw, which zeroes
  leaves in place, is ordered after them). ``masked``: False without ``where`` /
  staleness masks (then, with replacement, no repeats need finding).

  Returns ``(picked int32[B], tree, zeroed int32[K])``: slots in draw order (-1 padded),
  the count tree with the leaves of ``zeroed`` (-1 padded) still zeroed, for
  ``draw.restore_zeroed``.
  """
  m = candidates_per_round(b)
  track = masked or not replace  # candidates can be rejected: find repeats, zero them

  def one_round(tree, picked, n, r):
    tot = tree[1]
    alive = tot > 0
    hi, lo = stream_words(rng, m, r)
    k = bits.below(hi, lo, jnp.maximum(tot, 1).astype(jnp.uint32)).astype(jnp.int32)
    d = kth_occupied(tree, k)
    if track:
      first, d = first_occurrence(d)
    else:
      first = jnp.ones((m,), bool)
    ok = eligible_fn(d) & alive
    acc = ok if replace else ok & first
    rank = jnp.cumsum(acc.astype(jnp.int32)) - 1
    take = acc & (rank < b - n)
    picked = picked.at[jnp.where(take, n + rank, b)].set(d, mode="drop")
    remove = ((~ok if replace else take | ~ok) & first & alive) if track else jnp.zeros((m,), bool)
    return picked, n + jnp.sum(take, dtype=jnp.int32), jnp.where(remove, d, -1)

  tree0 = state.occ_tree if reads is None else inplace.tie(state.occ_tree, inplace.never(reads))
  picked, n, cand = one_round(tree0, jnp.full((b,), -1, jnp.int32), jnp.int32(0), 0)
  touched = lax.dynamic_update_slice(jnp.full((ROUNDS * m,), -1, jnp.int32), cand, (0,))

  def cond(c):
    _, _, n, r, _, dead = c
    return (n < b) & (r < ROUNDS) & ~dead

  def body(c):
    tree, picked, n, r, touched, _ = c
    prev = lax.dynamic_slice(touched, ((r - 1) * m,), (m,))
    tree = trees.refresh_count(tree, jnp.maximum(prev, 0), jnp.zeros((m,), tree.dtype),
                               prev >= 0)
    picked, n, cand = one_round(tree, picked, n, r)
    touched = lax.dynamic_update_slice(touched, cand, (r * m,))
    return tree, picked, n, r + 1, touched, tree[1] <= 0

  tree, picked, n, r, touched, _ = lax.while_loop(
      cond, body, (tree0, picked, n, jnp.int32(1), touched, jnp.bool_(False)))
  # Leaves of rounds 0 .. r - 2 are zeroed; the last round's are not.
  zeroed = jnp.where(jnp.arange(ROUNDS * m) < (r - 1) * m, touched, -1)

  def complete(picked):
    rest = eligible_all()
    if not replace:
      rest = rest & ~jnp.zeros((spec.capacity,), bool).at[
          jnp.where(picked >= 0, picked, spec.capacity)].set(True, mode="drop")
    n_rest = jnp.sum(rest, dtype=jnp.int32)
    idx = jnp.cumsum(rest.astype(jnp.int32)) - 1
    order = jnp.zeros((spec.capacity,), jnp.int32).at[
        jnp.where(rest, idx, spec.capacity)].set(jnp.arange(spec.capacity, dtype=jnp.int32),
                                                 mode="drop")
    x, valid = positions(rng, n_rest, b, replace, ROUNDS, spec.capacity)
    pos = jnp.arange(b) - n
    at = jnp.clip(pos, 0, b - 1)
    extra = jnp.where(valid[at], order[jnp.clip(x[at], 0, spec.capacity - 1)], -1)
    return jnp.where(pos < 0, picked, extra)

  picked = lax.cond(n < b, complete, lambda p: p, picked)
  # The completion reads the tree's columns: later in-place writes must wait for it.
  tree = inplace.tie(tree, inplace.never(picked))
  return picked, tree, zeroed
