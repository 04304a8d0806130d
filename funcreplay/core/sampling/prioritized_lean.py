"""Lean ``Prioritized`` sampling without masks: one vectorized round, exact.

Applies (``applies``) when the sampler is ``Prioritized``, no ``where`` mask,
no staleness mask and ``max_times_sampled == 0``. Any remover.

Program (B batch, M = B + max(8, B // 2) candidates, T = ``weight_tree[1]``):

1. ``M`` i.i.d. draws proportional to weight: ``u_m = (hi_m >> 8) * 2**-24``
   (``bits.words(rng, M)``, a float32 in [0, 1)), target ``u_m * T``, one
   vectorized descent of the weight tree (``trees.descend_weight_blocked``:
   ``trees.descend_weight`` bit for bit, 2 levels per step), O(M log P).
2. Without replacement: keep the first occurrence of each slot, in draw
   order, and the first B of those (one sort of M pairs). I.i.d. draws with
   repeats discarded are exactly successive sampling (sampling without
   replacement proportionally to weight).
3. If fewer than B distinct slots came up (weight concentrated on fewer than
   ~B items; a rare event for a table of thousands of comparable
   priorities), the missing rows are completed exactly by a Gumbel-top-k
   over the weights with the slots drawn so far removed (O(C)). This is the
   one ``conditional`` of the program, taken only then. With ``replace`` the
   first B draws are the batch and there is no sort and no condition.
4. ``times_sampled`` scatter-add, counters, ``info.probability = w / T``.

``info.slot`` is returned data-dependent on every read of ``priority`` and
of the weight tree in this call (``uniform_lean.finish``), so a following
``update_priorities(slots=info.slot, ...)`` in the same program updates both
in place: XLA orders by data dependencies only, and would otherwise copy.

The completion draws ``jax.random.gumbel(jax.random.fold_in(rng, 1), (C,))``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import bits, indexes, inplace, numerics, trees
from funcreplay.core import selectors as sel
from funcreplay.core.sampling import uniform_lean as uniform
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState

_U24 = 2.0**-24  # float32 resolution of a uniform in [0, 1) from 24 random bits


def applies(spec: TableSpec, *, version=None, where=None) -> bool:
  """True when ``sample`` below may replace the general ``sampling.sample`` (static)."""
  return (isinstance(spec.sampler, sel.Prioritized) and where is None
          and spec.max_times_sampled == 0
          and (version is None or spec.max_staleness is None))


def _first_b(d, b: int, n_max: int):
  """``(picked int32[b], n)``: the first ``b`` distinct values of ``d`` (int32[M] in
  ``[0, n_max)``) in order (-1 padded)."""
  m = d.shape[0]
  s_d, s_pos = bits.sort_pairs(d, n_max)
  first_sorted = jnp.concatenate([jnp.ones((1,), bool), s_d[1:] != s_d[:-1]])
  first = jnp.zeros((m,), bool).at[s_pos].set(first_sorted, unique_indices=True)
  rank = jnp.cumsum(first.astype(jnp.int32)) - 1
  picked = jnp.full((b,), -1, jnp.int32).at[jnp.where(first & (rank < b), rank, b)].set(
      d, mode="drop")
  return picked, jnp.minimum(rank[-1] + 1, b)


def _complete(spec, key, weights, picked, n):
  """Rows ``n..B-1`` of ``picked`` by a Gumbel-top-k over ``weights`` minus ``picked``."""
  b = picked.shape[0]
  drawn = jnp.zeros((spec.capacity,), bool).at[jnp.where(picked >= 0, picked, spec.capacity)
                                               ].set(True, mode="drop")
  ok = (weights > 0) & ~drawn
  logits = jnp.where(ok, jnp.log(jnp.where(ok, weights, 1.0)), -jnp.inf)
  k = min(b, spec.capacity)
  vals, top = lax.top_k(logits + jax.random.gumbel(key, logits.shape), k)
  top = jnp.concatenate([jnp.where(jnp.isfinite(vals), top, -1),
                         jnp.full((b - k,), -1, jnp.int32)])
  pos = jnp.arange(b) - n
  return jnp.where(pos < 0, picked, top[jnp.clip(pos, 0, b - 1)])


def sample(spec: TableSpec, state: TableState, rng, *, batch_size: int, version=None,
           replace: bool = False):
  """Lean prioritized ``sample`` (module doc); ``(state, Sample)`` as ``sampling.sample``."""
  if not applies(spec, version=version):
    raise ValueError("lean prioritized sample: needs a Prioritized sampler, "
                     "max_times_sampled=0 and no staleness mask.")
  b = batch_size
  m = b if replace else b + max(8, b // 2)
  tree = state.weight_tree
  total = tree[1]
  hi, _ = bits.words(rng, m)
  u = (hi >> 8).astype(jnp.float32) * jnp.float32(_U24)
  d = trees.descend_weight_blocked(tree, u * total, inplace.materialize)
  alive = total > 0
  if replace:
    picked = jnp.where(alive, d, -1)
  else:
    picked, n = _first_b(d, b, spec.tree_size)
    picked = jnp.where(alive, picked, -1)

    def complete(p):
      w = trees.leaf_values(tree, jnp.arange(spec.capacity, dtype=jnp.int32))
      return _complete(spec, jax.random.fold_in(rng, 1), w, p, n)

    picked = lax.cond(alive & (n < b), complete, lambda p: p, picked)
  valid = picked >= 0
  slot = jnp.maximum(picked, 0)
  w_item = indexes.sample_weight(spec, state.occupied[slot], state.priority[slot])
  prob = w_item / jnp.maximum(total, numerics.TINY)
  # Eligible = occupied with a positive weight (zero-weight items are never drawn).
  # occ_tree's root (size) and node 0 (the zero-weight count) are read once (inplace.once)
  # so the flag below orders them before a later update_priorities' write of the count
  # (else XLA copies occ_tree).
  size, zero = inplace.once((state.size, indexes.zero_weight_count(spec, state)))
  num_eligible = size - zero
  # finish orders every read (these included) before a later insert / update_priorities.
  return uniform.finish(spec, state, slot, valid, prob, num_eligible, version,
                        reads=(size, zero))
