"""Grouped queries in one pass: ``count_by``, ``select_by`` (the rows of a multi-group
take or peek) and ``gather`` (rows by slot, without touching any counter).

xtuner's learner asks ``is_ready({task: n, ...})`` and then ``take_batch({task: n,
...})``; one ``count`` / ``sample(where=...)`` per task is one O(C) pass per task.
Here every slot gets a group id once (``group_ids``: O(C K) compares, K the number of
requested values, vectorized), the counts are one scatter-add, and the rows of every
group come from two ``lax.top_k`` stages over ``[K, C]`` float32 scores (``_top_by_group``:
O(C K) work, then a sort of the ``2 K min(B, C)`` candidates), all in one program per call.
When the order keys are not exact in float32 (integer keys spanning >= 2**24 from their
smallest eligible value), the rows come from one sort of all slots by ``(group, order)``
instead (``_sorted_by_group``: O(C log C)).

The order within a group is the sampler's: the deterministic selectors sort by their
keys (``ordering.order_keys``); ``Uniform`` by random keys (a uniformly random subset,
in random order); ``Prioritized`` by exponential races ``-log(u) / w`` (the k smallest
are a weighted draw without replacement, successive sampling: Efraimidis & Spirakis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import indexes, ordering, storage
from funcreplay.core import selectors as sel
from funcreplay.core.ops.queries import eligible_mask
from funcreplay.core.ops.remove import delete
from funcreplay.core.ops.rows import take as _take_rows
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import Sample, SampleInfo, TableState


def group_ids(state: TableState, column, values):
  """int32[C]: the index in ``values`` (int32[K]) of each slot's ``column`` value, K if
  none. ``column`` None puts every slot in group 0 (K must be 1)."""
  c = state.occupied.shape[0]
  k = values.shape[0]
  if column is None:
    return jnp.zeros((c,), jnp.int32)
  eq = state.metadata[column][:, None] == values[None, :]
  return jnp.where(jnp.any(eq, axis=1), jnp.argmax(eq, axis=1).astype(jnp.int32), k)


def count_by(spec: TableSpec, state: TableState, column, values, *, version=None,
             where=None):
  """int32[K]: eligible items (``eligible_mask``: occupied, fresh at ``version``, in
  ``where``) whose ``column`` equals each of ``values`` (int32[K], distinct). One pass."""
  k = values.shape[0]
  gid = group_ids(state, column, values)
  ok = eligible_mask(spec, state, version, where)
  return jnp.zeros((k + 1,), jnp.int32).at[jnp.where(ok, gid, k)].add(1)[:k]


def _order(spec: TableSpec, state: TableState, rng):
  """Sort keys of the sampler's order (``rng`` None: oldest first for random samplers)."""
  if sel.is_ordered(spec.sampler):
    return ordering.order_keys(spec.sampler, state)
  if rng is None:
    return ordering.order_keys(sel.Fifo(), state)
  c = state.occupied.shape[0]
  if spec.prioritized:
    w = indexes.sample_weight(spec, state.occupied, state.priority)
    u = jax.random.uniform(rng, (c,), jnp.float32, minval=jnp.finfo(jnp.float32).tiny)
    return (-jnp.log(u) / w,)  # w = 0: inf (such items are not eligible anyway)
  return (jax.random.bits(rng, (c,), jnp.uint32),)


FLOAT_EXACT = 2**24  # integers in [0, 2**24] are exact in float32


def _float_scores(keys, eligible):
  """``((primary, secondary) float32 [C], fits)``: scores with the order of ``keys``
  (ascending keys -> descending scores) when they are exact in float32 (``fits``).

  Integer keys count from their smallest eligible value (version, age, ... of the items
  in a table usually span far less than 2**24); float keys (the random samplers') are
  used as they are; a single key gets the slot as its tie-break."""
  c = eligible.shape[0]
  out, fits = [], jnp.bool_(True)
  for key in keys:
    if jnp.issubdtype(key.dtype, jnp.floating):
      out.append(-key.astype(jnp.float32))
      continue
    u = key.astype(jnp.uint32)
    if jnp.issubdtype(key.dtype, jnp.signedinteger):  # order-preserving into uint32
      u = lax.bitcast_convert_type(key.astype(jnp.int32), jnp.uint32) ^ jnp.uint32(1 << 31)
    rel = u - jnp.min(jnp.where(eligible, u, jnp.uint32(2**32 - 1)))
    fits = fits & (jnp.max(jnp.where(eligible, rel, 0)) < FLOAT_EXACT)
    out.append(-rel.astype(jnp.float32))
  if len(out) == 1:
    out.append(-jnp.arange(c, dtype=jnp.float32))
    fits = fits & (c < FLOAT_EXACT)
  return tuple(out), fits


def _top_by_group(gid, scores, take, kk):
  """Slots of the ``take[g]`` best items of each group, grouped and in order, without
  sorting the table: two ``lax.top_k`` over ``[K, C]`` (fast on XLA:CPU for float32,
  where a sort of C elements is not) and a sort of the ``2 K kk`` candidates.

  Stage 1 takes every item whose primary score beats the ``take[g]``-th best (``p*``);
  stage 2 fills the rest from the items tied at ``p*``, by the secondary score.
  Returns ``(ordered slots, start)`` laid out like ``_sorted_by_group``'s."""
  k = take.shape[0]
  s1, s2 = scores
  member = gid[None, :] == jnp.arange(k, dtype=jnp.int32)[:, None]
  v1, i1 = lax.top_k(jnp.where(member, s1[None, :], -jnp.inf), kk)
  pstar = jnp.take_along_axis(v1, jnp.maximum(take - 1, 0)[:, None], axis=1)
  n_gt = jnp.sum(v1 > pstar, axis=1)
  tied = member & (s1[None, :] == pstar)
  _, i2 = lax.top_k(jnp.where(tied, s2[None, :], -jnp.inf), kk)
  pos = jnp.arange(kk, dtype=jnp.int32)[None, :]
  valid = jnp.concatenate([pos < n_gt[:, None], pos < (take - n_gt)[:, None]], axis=1)
  slot = jnp.concatenate([i1, i2], axis=1).astype(jnp.int32)
  grp = jnp.where(valid, jnp.arange(k, dtype=jnp.int32)[:, None], k).reshape(-1)
  slot = slot.reshape(-1)
  ordered = lax.sort((grp, -s1[slot], -s2[slot], slot), num_keys=3)[-1]
  return ordered, jnp.cumsum(take) - take


def _sorted_by_group(gid, keys, available, take, n):
  """The same from a sort of all slots by (group, order) (O(C log C): keys not exact
  in float32): the first ``take[g]`` of each group, in ``n`` positions."""
  slots = jnp.arange(gid.shape[0], dtype=jnp.int32)
  ordered = lax.sort((gid, *keys, slots), num_keys=1 + len(keys))[-1]
  end = jnp.cumsum(take)
  t = jnp.arange(n, dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(end, t, side="right"), take.shape[0] - 1)
  src = (jnp.cumsum(available) - available)[g] + t - (end[g] - take[g])
  return _take_rows(ordered, jnp.clip(src, 0, slots.shape[0] - 1)), end - take


def select_by(spec: TableSpec, state: TableState, column, values, counts, *, batch_size: int,
              rng=None, version=None, where=None):
  """The rows of a grouped take / peek: up to ``counts[g]`` eligible items per group.

  Args:
    column, values: groups as in ``count_by`` (``column`` None: one group, all items).
    counts: int32[K] items wanted per group (>= 0).
    batch_size: static ``B >= sum(counts)``; rows are laid out group after group
      (``counts[0]`` rows of group 0, then group 1, ...), the rest invalid.
    rng: a key for the random samplers (None: oldest first).

  Returns:
    ``(slots int32[B] (-1 where invalid), group int32[B] (K past the requested rows),
    available int32[K])`` with ``available`` the ``count_by`` result.
  """
  c = state.occupied.shape[0]
  k = values.shape[0]
  eligible = eligible_mask(spec, state, version, where)
  gid = jnp.where(eligible, group_ids(state, column, values), k)
  available = jnp.zeros((k + 1,), jnp.int32).at[gid].add(1)[:k]
  keys = _order(spec, state, rng)
  counts = jnp.asarray(counts, jnp.int32)
  scores, fits = _float_scores(keys, eligible)
  kk = min(batch_size, c)
  take = jnp.minimum(counts, available)
  ordered, start = lax.cond(
      fits, lambda: _top_by_group(gid, scores, take, kk),
      lambda: _sorted_by_group(gid, keys, available, take, 2 * k * kk))
  req_end = jnp.cumsum(counts)
  r = jnp.arange(batch_size, dtype=jnp.int32)
  group = jnp.searchsorted(req_end, r, side="right").astype(jnp.int32)  # K past the end
  g = jnp.minimum(group, k - 1)
  j = r - (req_end[g] - counts[g])
  ok = (group < k) & (j < available[g])
  n = ordered.shape[0]
  picked = jnp.where(ok, _take_rows(ordered, jnp.clip(start[g] + j, 0, n - 1)), -1)
  return picked, group, available


def gather(spec: TableSpec, state: TableState, slots, num_eligible) -> Sample:
  """The items at ``slots`` (int32[B], -1: an invalid row of zeros) as a ``Sample``,
  read only: no counter, reuse count or key changes. ``probability`` is 1 (rows of a
  take or peek are chosen, not drawn)."""
  valid = slots >= 0
  safe = jnp.maximum(slots, 0)

  def rows(x):
    v = _take_rows(x, safe)
    return jnp.where(valid.reshape((-1,) + (1,) * (v.ndim - 1)), v, jnp.zeros((), v.dtype))

  info = SampleInfo(slot=jnp.where(valid, slots, -1), key=rows(state.key),
                    probability=valid.astype(jnp.float32), priority=rows(state.priority),
                    times_sampled=rows(state.times_sampled), version=rows(state.version))
  data = storage.unpack(spec.signature, spec.packed_rows,
                        jax.tree_util.tree_map(rows, state.data), 1)
  return Sample(data=data, valid=valid, info=info,
                num_eligible=jnp.asarray(num_eligible, jnp.int32))


def take_by(spec: TableSpec, state: TableState, column, values, counts, *, batch_size: int,
            rng=None, version=None, where=None):
  """``select_by`` + ``gather`` + ``delete`` (counted as deletes): xtuner's take.

  Returns ``(state, Sample, group int32[B], available int32[K])``; the sample's
  ``num_eligible`` is the total available over the requested groups.
  """
  slots, group, available = select_by(spec, state, column, values, counts,
                                      batch_size=batch_size, rng=rng, version=version,
                                      where=where)
  out = gather(spec, state, slots, jnp.sum(available))
  state = delete(spec, state, slots, out.info.key)
  return state, out, group, available


def metadata_rows(state: TableState, slots):
  """{column: int32[B]} stored metadata of ``slots`` (0 where the slot is -1)."""
  safe = jnp.maximum(slots, 0)
  return {name: jnp.where(slots >= 0, _take_rows(col, safe), 0)
          for name, col in state.metadata.items()}


__all__ = ["count_by", "gather", "group_ids", "metadata_rows", "select_by", "take_by"]
