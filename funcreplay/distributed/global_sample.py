"""``sample_global``: one draw over the union of all shards, as one table would make it.

The local draws use the core's own sampling functions (``sampling.eligibility``,
``sampling.eligible_weight``, ``sampling.draw_weighted``, ``sampling.finish``);
only the combination across shards (an exponential race without
replacement, a multinomial with replacement) is specific to sharding.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import fixedpoint, indexes, numerics, ops, sampling
from funcreplay.core import selectors as sel
from funcreplay.core.state import TableState
from funcreplay.distributed import local_ops
from funcreplay.distributed.mesh import expand as _expand
from funcreplay.distributed.mesh import squeeze as _squeeze


def sample_global(ctx, state: TableState, rng, *, batch_size: int, version=None, where=None,
                  replace: bool = False, max_per_shard: Optional[int] = None):
  """Draw ``batch_size`` items from the union of all shards, as one table would.

  Returns ``(state, Sample)`` with leaves ``[S, M, ...]`` (``M =
  max_per_shard``, default ``batch_size``): shard ``s`` holds the rows that
  came from it as a prefix of its ``M`` rows, ``valid`` marks them, and in
  total ``min(batch_size, eligible)`` rows are valid.

  Without replacement (exact successive sampling over the union): each
  shard draws ``M`` items in order with the core sampler and attaches to the
  ``k``-th the arrival time ``T_k = sum_{j<=k} E_j / R_j`` of an
  exponential race (``E_j ~ Exp(1)``, ``R_j`` = eligible weight not yet
  drawn). By memorylessness these are distributed exactly as the first
  arrivals of a race over all items with rates ``w_i``; one ``all_gather``
  of ``S x M`` times gives the global ``batch_size``-th arrival, and each
  shard keeps its rows that arrived by then. With ``M < batch_size`` the
  result is still an exact prefix of the global draw but may hold fewer
  than ``batch_size`` rows.

  With replacement: per-shard counts from one multinomial over the shard
  totals (same key on every shard), then each shard keeps that many of its
  i.i.d. draws (capped at ``M``).

  Only the kept rows count as sampled (``times_sampled``, reuse eviction,
  counters). ``info.probability`` is ``w_i / W`` over all shards and
  ``num_eligible`` the global eligible count.
  """
  spec, lspec, n, axis, sh, rep, smap, shard_id = (ctx.spec, ctx.lspec, ctx.n, ctx.axis,
                                                   ctx.sh, ctx.rep, ctx.smap, ctx.shard_id)
  if sel.is_ordered(spec.sampler):
    raise ValueError(f"sample_global: the deterministic {type(spec.sampler).__name__} sampler "
                     "has no global order across shards (keys are per shard); use sample() "
                     "for per-shard queues/stacks.")
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"sample_global: batch_size must be a static int >= 1, got {batch_size!r}.")
  m = batch_size if max_per_shard is None else max_per_shard
  if not isinstance(m, int) or m < 1:
    raise ValueError(f"sample_global: max_per_shard must be a static int >= 1, got {m!r}.")
  if n == 1:  # one shard: the local draw already is the global one
    return local_ops.sample(ctx, state, rng, batch_size=min(m, batch_size), version=version,
                            where=where, replace=replace)
  if not replace:
    m = min(m, lspec.capacity)
  has_where = where is not None
  ver_arg = None if version is None else jnp.asarray(version, jnp.int32)

  def body(st, key, ver, wh):
    st = _squeeze(st)
    wh = _squeeze(wh) if has_where else None
    s = shard_id()
    k_draw, k_race = jax.random.split(jax.random.fold_in(key, s))
    k_shared = jax.random.fold_in(key, n + 1)  # the same on every shard
    eligible_fn, eligible_all = sampling.eligibility(lspec, st, ver, wh)
    masked = ops.masks_active(lspec, ver, wh)

    # Eligible weight of this shard, read before the draw mutates the tree.
    if spec.prioritized:
      if masked:
        total = sampling.eligible_weight(lspec, st, eligible_all())
      else:
        total = st.weight_tree[1]
    else:
      total = ops.count(lspec, st, wh, ver).astype(jnp.float32)
    n_elig = ops.count(lspec, st, wh, ver)

    picked, tree, touched = sampling.draw_weighted(
        lspec, st, k_draw, m, replace, eligible_fn, eligible_all)
    valid = picked >= 0
    safe = jnp.maximum(picked, 0)
    if spec.prioritized:
      w_item = indexes.sample_weight(lspec, st.occupied[safe], st.priority[safe])
    else:
      w_item = jnp.ones((m,), jnp.float32)
    w_item = jnp.where(valid, w_item, 0.0)

    totals = lax.all_gather(total, axis)            # [S]
    if replace:
      logits = jnp.where(totals > 0, jnp.log(jnp.maximum(totals, numerics.MIN_TOTAL)),
                         -jnp.inf)
      choice = jax.random.categorical(k_shared, logits, shape=(batch_size,))
      quota = jnp.where(jnp.any(totals > 0), jnp.sum(choice == s, dtype=jnp.int32), 0)
      keep = valid & (jnp.arange(m) < quota)
    else:
      before = jnp.cumsum(w_item) - w_item
      remaining = jnp.maximum(total - before, w_item)  # float drift: never below w_k
      # Rates relative to the largest shard's total (one scale for every shard: the race's
      # order is the same): absolute totals below TINY all raced at TINY, alike.
      scale = jnp.maximum(jnp.max(totals), numerics.MIN_TOTAL)
      gaps = jax.random.exponential(k_race, (m,)) / jnp.maximum(remaining / scale,
                                                                numerics.TINY)
      t = jnp.where(valid, jnp.cumsum(gaps), jnp.inf)
      # A shard that filled all M rows and has more eligible items may have had
      # earlier arrivals after t[M-1]: only times up to the smallest such cutoff are
      # exact. A shard that drew every eligible item (``n_elig``: those of positive
      # weight) has no later arrival and cuts nothing (it cut every shard's rows at its
      # last arrival, and a full table of M-slot shards gave short batches).
      cutoff = jnp.where(valid[m - 1] & (n_elig > m), t[m - 1], jnp.inf)
      all_t = lax.all_gather(t, axis).reshape(-1)   # [S * M]
      kth = jnp.sort(all_t)[batch_size - 1] if n * m >= batch_size else jnp.inf
      limit = jnp.minimum(kth, jnp.min(lax.all_gather(cutoff, axis)))
      keep = valid & (t <= limit)

    g_total = jnp.sum(totals)
    prob = fixedpoint.divide(w_item, jnp.maximum(g_total, numerics.MIN_TOTAL))
    st = st.replace(**{("weight_tree" if spec.prioritized else "occ_tree"): tree})
    st, out = sampling.finish(
        lspec, st, jnp.where(keep, picked, -1), prob, lax.psum(n_elig, axis), ver, replace)
    tree_field = "weight_tree" if spec.prioritized else "occ_tree"
    st = sampling.restore_zeroed(lspec, st, touched, tree_field)
    return _expand(st), _expand(out)

  return smap(body, (sh, rep, rep, sh), (sh, sh))(
      state, rng, ver_arg, where if has_where else jnp.zeros((n, 0), bool))
