"""Lean ``Prioritized`` sampling without masks: one vectorized round, exact.

Applies (``applies``) when the sampler is ``Prioritized``, no ``where`` mask,
no staleness mask and ``max_times_sampled == 0``. Any remover.

Program (B batch, M = B + max(8, B // 2) candidates, T = ``weight_tree[1]``):

1. ``M`` i.i.d. draws proportional to weight: ``u_m = (hi_m >> 8) * 2**-24``
   (``bits.words(rng, M)``, a float32 in [0, 1)), target ``u_m * T``, redrawn as
   ``(lo_m >> 8) * 2**-24`` times the reached node's sum about halfway down
   (``weight_descent.redraw_depth``); one vectorized descent of the weight tree
   (``weight_descent.descend_weight_blocked``: ``descend_weight`` bit for bit, 2 levels
   per step on CPU, 4 elsewhere), O(M log P).
2. Without replacement: keep the first occurrence of each slot, in draw
   order, and the first B of those (one sort of M pairs). I.i.d. draws with
   repeats discarded are exactly successive sampling (sampling without
   replacement proportionally to weight).
3. If fewer than B distinct slots came up (weight concentrated on fewer than
   ~B items; a rare event for a table of thousands of comparable
   priorities), the missing rows are completed exactly by further rounds of
   descents on a copy of the tree with the slots drawn so far zeroed
   (``exact.successive``: no transcendental, so the native kernel follows it
   bit for bit). This is the one ``conditional`` of the program, taken only
   then. With ``replace`` the first B draws are the batch and there is no
   sort and no condition.
4. ``times_sampled`` scatter-add, counters, ``info.probability = w / T``.

``info.slot`` is returned data-dependent on every read of ``priority`` and
of the weight tree in this call (``uniform_lean.finish``), so a following
``update_priorities(slots=info.slot, ...)`` in the same program updates both
in place: XLA orders by data dependencies only, and would otherwise copy.

The draw itself is ``exact.successive`` (shared with the general program under masks,
which runs it on the masked tree).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from funcreplay.core import fixedpoint, indexes, inplace, numerics, trees
from funcreplay.core import selectors as sel
from funcreplay.core.sampling import exact
from funcreplay.core.sampling import uniform_lean as uniform
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def applies(spec: TableSpec, *, version=None, where=None) -> bool:
  """True when ``sample`` below may replace the general ``sampling.sample`` (static)."""
  return (isinstance(spec.sampler, sel.Prioritized) and where is None
          and spec.max_times_sampled == 0
          and (version is None or spec.max_staleness is None))


def sample(spec: TableSpec, state: TableState, rng, *, batch_size: int, version=None,
           replace: bool = False):
  """Lean prioritized ``sample`` (module doc); ``(state, Sample)`` as ``sampling.sample``."""
  if not applies(spec, version=version):
    raise ValueError("lean prioritized sample: needs a Prioritized sampler, "
                     "max_times_sampled=0 and no staleness mask.")
  b = batch_size
  tree = state.weight_tree
  total = tree[1]
  picked = exact.successive(tree, rng, b, replace, spec.tree_size,
                            indexes.tiny_weights(spec))
  valid = picked >= 0
  slot = jnp.maximum(picked, 0)
  # The stored weight (the leaf the draw saw): a native kernel reproduces a read, not
  # XLA's pow (exact.py; for a consistent table it is the same value).
  w_item = trees.leaf_values(tree, slot)
  # Correctly rounded from integers (fixedpoint.divide; XLA:GPU's float division is not).
  # Materialized: XLA re-fuses the division, with its reads of the tree (the leaves and
  # the root), into each consumer of ``prob``; a consumer that a later write of the tree
  # does not wait for (a learner's loss, not the next update_priorities) then made XLA
  # copy the 2 MB tree twice a step in a scan (B <= 32; finding 14).
  prob = lax.bitcast_convert_type(inplace.materialize(lax.bitcast_convert_type(
      fixedpoint.divide(w_item, jnp.maximum(total, numerics.MIN_TOTAL)), jnp.int32)), jnp.float32)
  # Eligible = occupied with a positive weight (zero-weight items are never drawn).
  # occ_tree's root (size) and node 0 (the zero-weight count) are read once (on CPU:
  # inplace.once_on_cpu) so the flag below orders them before a later update_priorities'
  # write of the count (else XLA:CPU copies occ_tree).
  size, zero = inplace.once_on_cpu((state.size, indexes.zero_weight_count(spec, state)))
  num_eligible = size - zero
  # finish orders every read (these included) before a later insert / update_priorities.
  return uniform.finish(spec, state, slot, valid, prob, num_eligible, version,
                        reads=(size, zero))
