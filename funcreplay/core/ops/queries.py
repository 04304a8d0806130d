"""Queries: eligibility masks, counts, ``can_insert`` / ``can_sample``, ``Stats``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from funcreplay.core import counters as ctr
from funcreplay.core import indexes, staleness
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState


def stale_mask(spec: TableSpec, state: TableState, version):
  """bool[C]: occupied items older than ``max_staleness`` at ``version``."""
  if spec.max_staleness is None:
    return jnp.zeros_like(state.occupied)
  return state.occupied & (state.version < staleness.threshold(spec, version))


def eligible_mask(spec: TableSpec, state: TableState, version=None, where=None):
  """bool[C]: items a sample at ``version`` restricted to ``where`` may return
  (under a ``Prioritized`` sampler, only items of positive sampling weight)."""
  ok = state.occupied
  if spec.prioritized:
    # The stored weight (the weight-tree leaf, p**alpha when set): what the draws read,
    # and what a native kernel reproduces (XLA's pow it could not, bit for bit).
    p = spec.tree_size
    ok = ok & (state.weight_tree[p:p + spec.capacity] > 0)
  if version is not None and spec.max_staleness is not None:
    ok = ok & ~stale_mask(spec, state, version)
  if where is not None:
    where = jnp.asarray(where)
    if where.shape != (spec.capacity,) or where.dtype != jnp.bool_:
      raise ValueError(f"where must be a bool mask of shape [{spec.capacity}] over slots, got "
                       f"{where.dtype}{list(where.shape)}.")
    ok = ok & where
  return ok


def masks_active(spec: TableSpec, version, where) -> bool:
  return where is not None or (version is not None and spec.max_staleness is not None)


def count(spec: TableSpec, state: TableState, where=None, version=None, size=None):
  """Number of eligible items (int32[]).

  With a ``Prioritized`` sampler only items of positive sampling weight
  (priority > 0) are eligible. O(1) without masks; with only the staleness
  mask, O(1) or O(V) from the version index in the steady state (see
  ``funcreplay.core.staleness``); O(C) with ``where``, with any mask under a
  prioritized sampler, or when the index cannot answer. ``size``:
  ``state.size`` if the caller already read it (``sample`` reads it once,
  see ``inplace``).
  """
  size = state.size if size is None else size
  if not masks_active(spec, version, where):
    return size - indexes.zero_weight_count(spec, state)
  if spec.prioritized:  # the version index does not know the weights
    return jnp.sum(eligible_mask(spec, state, version, where), dtype=jnp.int32)
  full = lambda: jnp.sum(eligible_mask(spec, state, version, where), dtype=jnp.int32)  # noqa: E731
  if where is not None:
    return full()
  return staleness.count_fresh(spec, state.version_hist, state.version_bounds, size,
                               staleness.threshold(spec, version), full)


def _check_count(n, lo: int, what: str) -> None:
  """A host count below ``lo`` (or not an integer) is refused; a traced one is taken."""
  if isinstance(n, jax.core.Tracer):
    return
  if isinstance(n, (bool, np.bool_)) or np.asarray(n).dtype.kind not in "iu" \
      or np.ndim(n) or int(n) < lo:
    raise ValueError(f"{what} must be an integer >= {lo}, got {n!r}.")


def can_insert(spec: TableSpec, state: TableState, num_items=1):
  """Rate limiter: may ``num_items`` (>= 1) be inserted now? bool[]."""
  _check_count(num_items, 1, "can_insert: num_items")
  return spec.rate_limiter.can_insert(state.size, state.limiter_diff, num_items)


def can_sample(spec: TableSpec, state: TableState, batch_size=1, version=None, where=None):
  """Rate limiter allows ``batch_size`` (>= 1) samples *and* that many items are
  eligible."""
  _check_count(batch_size, 1, "can_sample: batch_size")
  return (spec.rate_limiter.can_sample(state.size, state.limiter_diff, batch_size)
          & (count(spec, state, where, version) >= batch_size))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Stats:
  """Pure table statistics (all arrays). ``to_dict()`` gives Python numbers.

  Counters are two-word ``uint32[2]`` values (exact past 2**32).
  """

  size: jnp.ndarray
  capacity: jnp.ndarray
  counters: dict
  mean_reuse_at_eviction: jnp.ndarray
  mean_staleness_sampled: jnp.ndarray
  max_priority: jnp.ndarray

  def to_dict(self) -> dict:
    out = {"size": int(self.size), "capacity": int(self.capacity)}
    out.update({k: ctr.to_int(v) for k, v in self.counters.items()})
    removed = sum(out[k] for k in REMOVAL_COUNTERS)
    out["mean_reuse_at_eviction"] = out["removed_reuse_sum"] / removed if removed else 0.0
    out["mean_staleness_sampled"] = (out["sampled_staleness_sum"] / out["samples"]
                                     if out["samples"] else 0.0)
    out["max_priority"] = float(self.max_priority)
    return out


def stats(spec: TableSpec, state: TableState) -> Stats:
  """Size, counters, evictions by cause, mean reuse at eviction, mean staleness sampled."""
  return stats_from(dict(state.counters), state.size, spec.capacity, state.max_priority)


REMOVAL_COUNTERS = ("deletes", "evicted_capacity", "evicted_stale", "evicted_reuse")


def stats_from(counters: dict, size, capacity: int, max_priority) -> Stats:
  """``Stats`` from (possibly summed) two-word ``counters``: the one place its means are
  computed (``stats``; the sharded table passes counters summed over shards)."""
  c = counters
  removed = sum(ctr.to_float(c[k]) for k in REMOVAL_COUNTERS)
  samples = ctr.to_float(c["samples"])
  return Stats(
      size=size, capacity=jnp.int32(capacity), counters=c,
      mean_reuse_at_eviction=jnp.where(removed > 0, ctr.to_float(c["removed_reuse_sum"])
                                       / jnp.maximum(removed, 1), 0.0),
      mean_staleness_sampled=jnp.where(samples > 0, ctr.to_float(c["sampled_staleness_sum"])
                                       / jnp.maximum(samples, 1), 0.0),
      max_priority=max_priority)
