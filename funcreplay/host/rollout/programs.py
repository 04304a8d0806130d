"""Jitted programs of the rollout queries (``count_by``, ``take``, ``peek``, receipts),
shared per spec like ``funcreplay.host.programs``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from funcreplay.core import caches, ops, sampling
from funcreplay.core.ops import grouped
from funcreplay.core.spec import TableSpec
from funcreplay.host.programs import where_mask


class RolloutOps:
  """The jitted grouped queries of one spec (``column`` and ``stale_ok`` are static)."""

  def __init__(self, spec: TableSpec):
    self.spec = spec

    def _version(version, stale_ok):
      return None if stale_ok else version

    def count_by(state, version, where, cols, values, *, column, stale_ok):
      return grouped.count_by(spec, state, column, values, version=_version(version, stale_ok),
                              where=where_mask(state, where, cols))

    def select(state, rng, version, where, cols, values, counts, *, column, batch_size,
               stale_ok, all_or_nothing):
      ver = _version(version, stale_ok)
      mask = where_mask(state, where, cols)
      slots, group, available = grouped.select_by(
          spec, state, column, values, counts, batch_size=batch_size, rng=rng, version=ver,
          where=mask)
      ok = jnp.all(available >= counts) if all_or_nothing else jnp.bool_(True)
      slots = jnp.where(ok, slots, -1)
      out = grouped.gather(spec, state, slots, jnp.sum(available))
      return out, group, available, grouped.metadata_rows(state, slots), ok

    def take(state, rng, version, where, cols, values, counts, *, column, batch_size,
             stale_ok):
      # All or nothing: a take that finds too few items for any group takes none.
      res = select(state, rng, version, where, cols, values, counts, column=column,
                   batch_size=batch_size, stale_ok=stale_ok, all_or_nothing=True)
      return (ops.delete(spec, state, res[0].info.slot, res[0].info.key), *res)

    def sample(state, rng, version, where, cols, values, counts, *, column, batch_size,
               stale_ok):
      # A grouped take that counts as a sample instead of deleting: reuse counts go up,
      # items reaching max_times_sampled are freed (evicted_reuse), staleness is counted.
      out, group, available, meta, ok = select(
          state, rng, version, where, cols, values, counts, column=column,
          batch_size=batch_size, stale_ok=stale_ok, all_or_nothing=True)
      slots = out.info.slot
      state, smp = sampling.finish(spec, state, slots, (slots >= 0).astype(jnp.float32),
                                   jnp.sum(available), version, False)
      return state, smp, group, available, meta, ok

    def stale(state, version):
      """Everything a receipt reports about the items ``evict_stale`` would remove."""
      mask = ops.stale_mask(spec, state, version)
      return mask, state.key, state.version, state.metadata

    def expire(state, version, value, *, column):
      mask = ops.stale_mask(spec, state, version) & (state.metadata[column] != value)
      col = jnp.where(mask, value, state.metadata[column])
      return state.replace(metadata={**state.metadata, column: col}), mask

    self.count_by = jax.jit(count_by, static_argnames=("column", "stale_ok"))
    self.take = jax.jit(take, static_argnames=("column", "batch_size", "stale_ok"),
                        donate_argnums=0)
    self.sample = jax.jit(sample, static_argnames=("column", "batch_size", "stale_ok"),
                          donate_argnums=0)
    self.peek = jax.jit(functools.partial(select, all_or_nothing=False),
                        static_argnames=("column", "batch_size", "stale_ok"))
    self.stale = jax.jit(stale)
    self.expire = jax.jit(expire, static_argnames=("column",), donate_argnums=0)


@functools.lru_cache(maxsize=64)
def rollout_ops(spec: TableSpec) -> RolloutOps:
  return RolloutOps(spec)


caches.register("host.rollout.ops", rollout_ops.cache_clear)
