"""Lean ``Prioritized`` sampling without masks: one vectorized round, exact.

Applies (``applies``) when the sampler is ``Prioritized``, no ``where`` mask,
no staleness mask and ``max_times_sampled == 0``. Any remover.

Program (B batch, M = B + max(8, B // 2) candidates, T = ``weight_tree[1]``):

1. ``M`` i.i.d. draws proportional to weight: ``u_m = (hi_m >> 8) * 2**-24``
   (``draws.words(rng, M)``, a float32 in [0, 1)), target ``u_m * T``, one
   vectorized descent of the weight tree (``trees.descend_weight``,
   O(M log P), fused by XLA into one loop).
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
of the weight tree in this call (``insert.after``), so a following
``update_priorities(slots=info.slot, ...)`` in the same program updates both
in place: XLA orders by data dependencies only, and would otherwise copy.

The completion draws ``jax.random.gumbel(jax.random.fold_in(rng, 1), (C,))``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay import counters as ctr
from funcreplay import indexes, trees
from funcreplay import selectors as sel
from funcreplay.lean import draws, uniform
from funcreplay.lean.insert import after
from funcreplay.spec import TableSpec
from funcreplay.state import TableState

_U24 = 2.0**-24  # float32 resolution of a uniform in [0, 1) from 24 random bits


def applies_update(spec: TableSpec) -> bool:
  """True when ``update_priorities`` below may replace ``ops.update_priorities`` (static):
  no order tree (a ``Fifo`` or ``Uniform`` remover)."""
  return not spec.needs_remover_tree


def update_priorities(spec: TableSpec, state: TableState, slots, keys, priorities):
  """``ops.update_priorities`` for tables without an order tree, bit for bit.

  Key guard (the slot must still hold ``keys``), last occurrence wins (one
  packed sort of the K slots), bad priorities stored as 0 and counted, then
  one float sum-tree refresh of the K leaves (O(K log P), never drifting).
  """
  if not applies_update(spec):
    raise ValueError("lean update_priorities: the remover keeps an order tree.")
  cap = spec.capacity
  slots = jnp.asarray(slots, jnp.int32)
  k = slots.shape[0]
  keys = jnp.broadcast_to(jnp.asarray(keys, jnp.uint32), slots.shape)
  p = jnp.broadcast_to(jnp.asarray(priorities, jnp.float32), slots.shape)
  in_range = (slots >= 0) & (slots < cap)
  safe = jnp.where(in_range, slots, 0)
  ok = in_range & state.occupied[safe] & (state.key[safe] == keys)
  # Last valid occurrence of each slot: sort (slot, row) pairs, keep each run's last.
  s_slot, s_row = draws.sort_pairs(jnp.where(ok, safe, cap), cap + 1)
  last_sorted = jnp.concatenate([s_slot[1:] != s_slot[:-1], jnp.ones((1,), bool)])
  win = jnp.zeros((k,), bool).at[s_row].set(last_sorted, unique_indices=True) & ok
  bad = ~jnp.isfinite(p) | (p < 0)
  clean = jnp.where(bad, 0.0, p)
  c = dict(state.counters)
  c["invalid_priorities"] = ctr.add(c["invalid_priorities"],
                                    jnp.sum(bad & win, dtype=jnp.uint32))
  prio = state.priority.at[jnp.where(win, safe, cap)].set(clean, mode="drop")
  max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(win, clean, 0.0), initial=0.0))
  tree = state.weight_tree
  if spec.prioritized:
    w = indexes.sample_weight(spec, jnp.ones((k,), bool), clean)
    if k == 1:  # keep the per-level updates real scatters (see indexes.refresh)
      safe, w, win = (jnp.concatenate([a, a]) for a in (safe, w, win))
      win = win & jnp.asarray([True, False])
    tree = trees.refresh_sum(tree, safe, w, win)
  return state.replace(priority=prio, weight_tree=tree, counters=c, max_priority=max_p)


def applies(spec: TableSpec, *, version=None, where=None) -> bool:
  """True when ``sample`` below may replace the general ``sampling.sample`` (static)."""
  return (isinstance(spec.sampler, sel.Prioritized) and where is None
          and spec.max_times_sampled == 0
          and (version is None or spec.max_staleness is None))


def _first_b(d, b: int, n_max: int):
  """``(picked int32[b], n)``: the first ``b`` distinct values of ``d`` (int32[M] in
  ``[0, n_max)``) in order (-1 padded)."""
  m = d.shape[0]
  s_d, s_pos = draws.sort_pairs(d, n_max)
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
  hi, _ = draws.words(rng, m)
  u = (hi >> 8).astype(jnp.float32) * jnp.float32(_U24)
  d = trees.descend_weight(tree, u * total)
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
  prob = w_item / jnp.maximum(total, 1e-30)
  state, out = uniform.finish(spec, state, slot, valid, prob, state.size, version)
  # Order every read of priority / the tree before a later update_priorities.
  flag = jnp.sum(lax.bitcast_convert_type(out.info.priority + prob, jnp.uint32),
                 dtype=jnp.uint32)
  info = dataclasses.replace(out.info, slot=after(out.info.slot, flag))
  return state, dataclasses.replace(out, info=info)
