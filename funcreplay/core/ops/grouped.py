"""Grouped queries in one pass: ``count_by``, ``select_by`` (the rows of a multi-group
take or peek) and ``gather`` (rows by slot, without touching any counter).

xtuner's learner asks ``is_ready({task: n, ...})`` and then ``take_batch({task: n,
...})``; one ``count`` / ``sample(where=...)`` per task is one O(C) pass per task.
Here every slot gets a group id once (``group_ids``: O(C K) compares, K the number of
requested values, vectorized), the counts are one scatter-add, and the rows of every
group come from one sort of all slots by ``(group, order)``: O(C log C) once per call,
whatever K is.

The order within a group is the sampler's: the deterministic selectors sort by their
keys (``ordering.order_keys``); ``Uniform`` by random keys (a uniformly random subset,
in random order); ``Prioritized`` by exponential races ``-log(u) / w`` (the k smallest
are a weighted draw without replacement, successive sampling: Efraimidis & Spirakis).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import indexes, ordering
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
  gid = jnp.where(eligible_mask(spec, state, version, where), group_ids(state, column, values), k)
  available = jnp.zeros((k + 1,), jnp.int32).at[gid].add(1)[:k]
  keys = _order(spec, state, rng)
  slots = jnp.arange(c, dtype=jnp.int32)
  ordered = lax.sort((gid, *keys, slots), num_keys=1 + len(keys))[-1]
  start = jnp.cumsum(available) - available          # first sorted position of each group
  counts = jnp.asarray(counts, jnp.int32)
  req_end = jnp.cumsum(counts)
  r = jnp.arange(batch_size, dtype=jnp.int32)
  group = jnp.searchsorted(req_end, r, side="right").astype(jnp.int32)  # K past the end
  g = jnp.minimum(group, k - 1)
  j = r - (req_end[g] - counts[g])
  ok = (group < k) & (j < available[g])
  picked = jnp.where(ok, _take_rows(ordered, jnp.clip(start[g] + j, 0, c - 1)), -1)
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
  return Sample(data=jax.tree_util.tree_map(rows, state.data), valid=valid, info=info,
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
