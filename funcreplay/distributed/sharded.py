"""One table sharded over a ``jax.sharding.Mesh``: many devices, many processes.

A sharded table is ``S`` independent sub-tables (``S`` = size of the mesh
axis), each of capacity ``spec.capacity // S``, built with the **same** pure
ops (``fr.make_table``). The state is an ordinary ``TableState`` whose every
leaf carries a leading shard axis ``[S, ...]``, laid out with
``NamedSharding(mesh, P(axis))``: shard ``s`` lives on the devices of mesh
position ``s`` (replicated over any other mesh axes). The ops run under
``jax.shard_map``, so inserts and samples never move slot data between
devices; only scalars (totals, counts) and, for global sampling, ``B`` floats
per shard cross the interconnect.

Layout (Anakin / Podracer style): every per-item argument carries the shard
axis first. Items are ``[S, B, ...]`` (shard ``s`` inserts ``items[s]``), a
sample is ``[S, B, ...]`` with a ``valid`` mask, slots and keys in
``SampleInfo`` are *local* slots of the shard the row came from, so
``update_priorities(state, info.slot, info.key, p)`` takes them back as they
are.

Two ways to sample:

* ``sample``: every shard draws ``batch_size`` items from its own shard
  (the usual data-parallel learner). ``info.probability`` is the probability
  that one draw of this procedure (pick a shard uniformly, then an item
  within it) returns the item: ``p_local / S``.
* ``sample_global``: a batch of ``batch_size`` items drawn from the union of
  all shards exactly as the unsharded table would draw it (uniform or
  prioritized, with or without replacement). ``info.probability`` is the
  global single-draw probability ``w_i / sum_j w_j``. See ``sample_global``
  for how (an exponential race merged with one ``all_gather``).

Staleness, reuse limits, ``where`` masks and counters keep their meaning per
item; ``count``, ``stats``, ``can_insert`` and ``can_sample`` are global
(reduced over shards). The rate limiter of ``spec`` is applied to the global
counters.

Across processes: call ``jax.distributed.initialize`` first, build the mesh
over ``jax.devices()`` (all processes), and feed each process's local shards
with ``shard_items`` (``jax.make_array_from_process_local_data``).

Modules: ``mesh`` (the shard context and shared helpers), ``local_ops`` (the
per-shard operations), ``global_sample`` (``sample_global``), ``placement``
(``shard_state`` / ``gather_state`` / ``shard_items``); this one assembles
the ``ShardedTable``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from funcreplay.core import numerics, ops
from funcreplay.core.functional import FunctionalTable
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import Sample, TableState
from funcreplay.distributed import global_sample, local_ops
from funcreplay.distributed import mesh as mesh_lib
from funcreplay.distributed.placement import shard_items, shard_state


class ShardedTable(NamedTuple):
  """Pure functions over a sharded ``TableState`` (leaves ``[S, ...]``).

  Like ``FunctionalTable``: wrap them in ``jax.jit`` (``batch_size``,
  ``replace`` and ``max_per_shard`` are static) or call them inside your own
  jitted step. ``local`` is the per-shard ``FunctionalTable``.
  """

  spec: TableSpec
  local: FunctionalTable
  mesh: Mesh
  axis: str
  num_shards: int
  sharding: NamedSharding
  init: Callable[[], TableState]
  insert: Callable[..., TableState]
  sample: Callable[..., Any]
  sample_global: Callable[..., Any]
  delete: Callable[..., TableState]
  update_priorities: Callable[..., TableState]
  set_metadata: Callable[..., TableState]
  evict_stale: Callable[..., TableState]
  count: Callable[..., Any]
  eligible: Callable[..., Any]
  can_insert: Callable[..., Any]
  can_sample: Callable[..., Any]
  stats: Callable[..., ops.Stats]
  shard_state: Callable[..., TableState]
  shard_items: Callable[..., Any]


def make_sharded_table(spec: TableSpec, mesh: Mesh, axis: str = "data") -> ShardedTable:
  """Build a table of ``spec.capacity`` slots split over ``mesh.shape[axis]`` shards.

  Args:
    spec: the *global* table spec; ``spec.capacity`` must be a multiple of the
      number of shards. Each shard is ``make_table(spec.replace(capacity=C // S))``.
    mesh: a ``jax.sharding.Mesh`` (may span processes after
      ``jax.distributed.initialize``).
    axis: the mesh axis the slots are split over (other axes replicate).

  Example::

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    table = fr.make_sharded_table(spec, mesh)
    state = jax.jit(table.init)()
    state = jax.jit(table.insert)(state, items)          # items: [S, B, ...]
    state, batch = jax.jit(table.sample_global, static_argnames="batch_size")(
        state, rng, batch_size=256)
  """
  ctx = mesh_lib.context(spec, mesh, axis)
  p = functools.partial
  return ShardedTable(
      spec=spec, local=ctx.local, mesh=mesh, axis=axis, num_shards=ctx.n,
      sharding=ctx.sharding, init=p(local_ops.init, ctx), insert=p(local_ops.insert, ctx),
      sample=p(local_ops.sample, ctx), sample_global=p(global_sample.sample_global, ctx),
      delete=p(local_ops.delete, ctx), update_priorities=p(local_ops.update_priorities, ctx),
      set_metadata=p(local_ops.set_metadata, ctx), evict_stale=p(local_ops.evict_stale, ctx),
      count=p(local_ops.count, ctx), eligible=p(local_ops.eligible, ctx),
      can_insert=p(local_ops.can_insert, ctx), can_sample=p(local_ops.can_sample, ctx),
      stats=p(local_ops.stats, ctx),
      shard_state=lambda state: shard_state(state, mesh, axis),
      shard_items=lambda items: shard_items(items, mesh, axis))


def importance_weights(sample: Sample, beta: float):
  """PER weights ``(N * P(i))**-beta`` normalised by the max over *all* shards' rows.

  For a sharded ``Sample`` (leaves ``[S, M]``); ``fr.importance_weights``
  expects an unsharded one.
  """
  n = jnp.maximum(sample.num_eligible, 1).astype(jnp.float32)[:, None]
  p = jnp.where(sample.valid, sample.info.probability, 1.0)
  w = jnp.where(sample.valid, jnp.power(n * jnp.maximum(p, numerics.TINY), -beta), 0.0)
  return w / jnp.maximum(jnp.max(w), numerics.TINY)
