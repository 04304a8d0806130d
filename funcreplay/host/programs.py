"""The compiled programs of a host ``Table``, cached per spec and implementation.

Every ``Table`` of one spec shares one ``Ops``: its jitted insert / sample /
update programs (with the state donated), compiled once per static shape.
``cached_ops`` keeps the last 64 (spec, native) pairs and registers with
``funcreplay.core.caches`` (``fr.clear_caches``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from funcreplay import native as native_lib
from funcreplay.core import caches, inplace, ops, sampling
from funcreplay.core import selectors as sel
from funcreplay.core import state as state_lib
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState
from funcreplay.native import executor


def _copy_tree(tree):
  # jnp.copy is an explicit copy: the outputs never alias the (donated) state.
  return jax.tree_util.tree_map(jnp.copy, tree)


def where_mask(state: TableState, where, where_cols):
  """bool[C] from a slot mask and {column: (int32[K] allowed values, active bool[])}.

  ``where`` is None when the caller gave no ``where`` at all; otherwise every
  column is present (inactive ones match everything), so any ``where`` of a
  spec compiles to one variant per value bucket.
  """
  if where is None:
    return None
  mask = where
  for col, (vals, active) in where_cols.items():
    mask = mask & (~active | jnp.any(state.metadata[col][:, None] == vals[None, :], axis=1))
  return mask


class Ops:
  """The jitted operations of one spec (shared by every ``Table`` of that spec)."""

  def __init__(self, spec: TableSpec, native: bool):
    self.spec = spec
    self.native = native
    native = executor.choose(native)  # the core's executor hook: NATIVE or None
    limiter = spec.rate_limiter
    uniform_remover = isinstance(spec.remover, sel.Uniform)

    def insert(state, rng, items, version, priority, has_priority, metadata, start, n_real):
      bk = version.shape[0]
      # Largest k <= n_real - start the limiter admits now (can_insert is
      # monotone in n), so the batch goes in item by item as in Reverb.
      ns = jnp.arange(1, bk + 1, dtype=jnp.int32)
      allowed = jnp.broadcast_to(limiter.can_insert(state.size, state.limiter_diff, ns), (bk,))
      k = jnp.sum(allowed & (ns <= n_real - start), dtype=jnp.int32)
      idx = jnp.arange(bk, dtype=jnp.int32)
      mask = (idx >= start) & (idx < start + k)
      new_rng, sub = jax.random.split(rng)
      # Always pass explicit priorities (one compiled variant per bucket): the
      # default is what ops.insert would use for priority=None.
      default = state.max_priority if spec.default_priority is None else spec.default_priority
      priority = jnp.where(has_priority, priority, default)
      state = ops.insert(spec, state, items, version=version, priority=priority, mask=mask,
                         metadata=metadata, rng=sub if uniform_remover else None,
                         native=native)
      rng = jnp.where(k > 0, new_rng, rng) if uniform_remover else rng
      return state, rng, k

    def sample(state, rng, version, where, where_cols, min_valid, *, batch_size, replace,
               packed):
      mask = where_mask(state, where, where_cols)
      # Single reads of the tree root: XLA re-fuses a cheap read into every
      # use, and a use not ordered before the in-place sample costs a tree copy.
      cnt, size = inplace.once((ops.count(spec, state, mask, version), state.size))
      n_valid = jnp.where(cnt > 0, batch_size, 0) if replace else jnp.minimum(cnt, batch_size)
      limiter_ok = limiter.can_sample(size, state.limiter_diff, n_valid)
      ok = limiter_ok & (cnt >= min_valid)
      # The key advances only on a successful sample: how often a waiter
      # retried (timing) never changes the random stream.
      state, out, rng = sampling.sample(spec, state, rng, batch_size=batch_size,
                                        version=version, where=mask, replace=replace,
                                        enabled=ok, native=native, split_key=True,
                                        packed=packed)
      # One int32[3] for the host (one transfer): ok, limiter_ok, eligible count.
      flags = jnp.stack([ok.astype(jnp.int32), limiter_ok.astype(jnp.int32), cnt])
      return state, rng, out, flags

    def count(state, version, where, where_cols):
      return ops.count(spec, state, where_mask(state, where, where_cols), version)

    def evict_stale(state, version):
      before = state.size
      state = ops.evict_stale(spec, state, version)
      return state, before - state.size

    def delete(state, slots, keys):
      return ops.delete(spec, state, slots, keys)

    def update_priorities(state, slots, keys, priorities):
      return ops.update_priorities(spec, state, slots, keys, priorities, native=native)

    def set_metadata(state, slots, keys, values, *, column):
      return ops.set_metadata(spec, state, slots, keys, column, values)

    donate = dict(donate_argnums=0)
    self.init = jax.jit(functools.partial(state_lib.init_state, spec))
    self.insert = jax.jit(insert, **donate)
    self.sample = jax.jit(sample, static_argnames=("batch_size", "replace", "packed"),
                          **donate)
    self.count = jax.jit(count)
    self.evict_stale = jax.jit(evict_stale, **donate)
    self.delete = jax.jit(delete, **donate)
    self.update_priorities = jax.jit(update_priorities, **donate)
    self.set_metadata = jax.jit(set_metadata, static_argnames=("column",), **donate)
    self.stats = jax.jit(lambda s: _copy_tree(ops.stats(spec, s)))
    self.copy = jax.jit(_copy_tree)


def ops_for(spec: TableSpec, native=None) -> Ops:
  """The programs of ``spec``; ``native`` None: ``FUNCREPLAY_NATIVE`` (``native.use_native``)."""
  return cached_ops(spec, native_lib.use_native(native))


@functools.lru_cache(maxsize=64)
def cached_ops(spec: TableSpec, native: bool) -> Ops:
  return Ops(spec, native)


caches.register("host.table.ops", cached_ops.cache_clear)
