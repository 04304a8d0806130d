"""The shard context of a sharded table, and the helpers its operations share.

``ShardContext`` holds what every sharded operation needs: the global and
per-shard specs, the per-shard ``FunctionalTable`` (``local``), the mesh and
its axis, the number of shards, and ``smap`` (``jax.shard_map`` over the mesh,
putting inputs where it wants them on Explicit mesh axes). ``context`` builds
it once per ``make_sharded_table``; the operations in ``local_ops``,
``global_sample`` take it as their first argument.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from funcreplay.core import counters as ctr
from funcreplay.core import numerics
from funcreplay.core import selectors as sel
from funcreplay.core.functional import FunctionalTable
from funcreplay.core.ops import rows
from funcreplay.core.spec import TableSpec
from funcreplay.native.functional import make_table


class ShardContext(NamedTuple):
  """Everything a sharded operation closes over (built by ``context``)."""

  spec: TableSpec          # the global spec (capacity C)
  local: FunctionalTable   # the per-shard table (capacity C // S)
  mesh: Mesh
  axis: str                # the mesh axis the slots are split over
  n: int                   # S, the number of shards
  sharding: NamedSharding  # NamedSharding(mesh, P(axis))
  smap: Callable           # smap(f, in_specs, out_specs): shard_map over the mesh

  @property
  def lspec(self) -> TableSpec:
    return self.local.spec

  @property
  def sh(self):
    return P(self.axis)

  @property
  def rep(self):
    return P()

  def shard_id(self):
    """This shard's index along ``axis`` (inside ``smap``)."""
    return lax.axis_index(self.axis)


def context(spec: TableSpec, mesh: Mesh, axis: str) -> ShardContext:
  """Check ``spec`` / ``mesh`` / ``axis`` and build the ``ShardContext`` of a sharded table."""
  if not isinstance(spec, TableSpec):
    raise TypeError(f"make_sharded_table expects a TableSpec, got {type(spec).__name__}.")
  if axis not in mesh.shape:
    raise ValueError(f"make_sharded_table: mesh has axes {tuple(mesh.shape)}, not {axis!r}; "
                     "pass axis= one of them.")
  n = int(mesh.shape[axis])
  if spec.capacity % n:
    raise ValueError(f"make_sharded_table: capacity {spec.capacity} is not a multiple of the "
                     f"{n} shards of mesh axis {axis!r}; round it to a multiple of {n}.")
  local = make_table(spec.replace(capacity=spec.capacity // n))
  sharding = NamedSharding(mesh, P(axis))
  explicit = jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()))

  def smap(f, in_specs, out_specs):
    # check_vma off: the per-shard ops mix replicated scalars (version, keys)
    # into loops carrying per-shard values, which the checker rejects. Jitted: called
    # eagerly, shard_map gave a zero-size leaf (a feature the spec leaves off: the weight
    # tree of a uniform table) shards of the global shape on every device, which
    # ``gather_state`` and a checkpoint's save then refused (jax 0.10.2); an eager call
    # also took ~1.6 s (~0.13 s jitted; 2 devices, a 64-slot table). Inside a caller's
    # jit this jit is inlined: the same program.
    mapped = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                                   check_vma=False))

    if not explicit:
      return mapped  # Auto axes: XLA moves mismatched inputs itself.

    def call(*args):
      # With Explicit mesh axes (the default of jax.make_mesh) shard_map
      # refuses inputs laid out otherwise: put each where it is wanted.
      args = [jax.tree_util.tree_map(lambda x, s=s: jax.reshard(x, NamedSharding(mesh, s)), a)
              for a, s in zip(args, in_specs)]
      return mapped(*args)

    return call

  return ShardContext(spec=spec, local=local, mesh=mesh, axis=axis, n=n, sharding=sharding,
                      smap=smap)


def squeeze(tree):
  return jax.tree_util.tree_map(lambda x: x[0], tree)


def expand(tree):
  return jax.tree_util.tree_map(lambda x: x[None], tree)


def per_shard(x, n, b, dtype, name):
  """Broadcast a scalar / ``[S]`` / ``[S, B]`` argument to ``[S, B]``."""
  x = jnp.asarray(x, dtype)
  if x.ndim == 1:
    if x.shape[0] != n:
      raise ValueError(f"{name}: a 1-D argument is per shard and must have shape [{n}], got "
                       f"{list(x.shape)}; pass a scalar, [{n}] or [{n}, {b}].")
    x = x[:, None]
  if x.ndim > 2 or (x.ndim == 2 and x.shape not in ((n, b), (n, 1))):
    raise ValueError(f"{name} must be a scalar, [{n}] or [{n}, {b}] (shards, batch), got "
                     f"{list(x.shape)}.")
  return jnp.broadcast_to(x, (n, b))


def check_leading(tree, n, what):
  for leaf in jax.tree_util.tree_leaves(tree):
    shape = jnp.shape(leaf)
    if len(shape) < 1 or shape[0] != n:
      raise ValueError(f"{what}: every leaf needs the shard axis first, [{n}, ...] "
                       f"({n} shards), got a leaf of shape {list(shape)}.")


def global_counter_sum(c):
  """Exact two-word sum over shards of counters ``uint32[S, 2]`` -> ``uint32[2]``."""
  total = ctr.add_sum(ctr.zero(), c[:, 1])
  return total.at[0].add(jnp.sum(c[:, 0], dtype=jnp.uint32))


def uses_priority(spec: TableSpec) -> bool:
  heap = (sel.MinHeap, sel.MaxHeap)
  return spec.prioritized or isinstance(spec.sampler, heap) or isinstance(spec.remover, heap)


def keyed_args(what: str, n: int, slots, keys, values=rows.NO_VALUES,
               values_name: str = "values", values_kinds: str = "iuf"):
  """``(slots int32[S, K], keys uint32[S, K], values [S, K] or None)`` of a sharded keyed
  call (``delete``, ``update_priorities``, ``set_metadata``), checked when tracing as the
  core checks one table's (``ops.rows.keyed_args``: integer slots and keys, keys in
  uint32 range, the values' dtype kind): ``slots`` ``[S, K]`` local slots per shard,
  ``keys`` a scalar or ``[S, K]``, ``values`` a scalar, ``[S]`` (one per shard, as
  ``insert``'s arguments) or ``[S, K]``. A flat or ``[S]`` keys array was split across
  the shards unchecked, and each shard compared all its rows with one key."""
  for name, x in (("slots", slots), ("keys", keys), (values_name, values)):
    if x is None:
      raise TypeError(f"{what}: {name} must be given, got None.")
  values = None if values is rows.NO_VALUES else values
  # Host slots stay numpy: rows.keyed_args below refuses one beyond int32 (it would wrap
  # onto another slot in a conversion here).
  host = rows.host_array(slots)
  s = host if host is not None else jnp.asarray(slots)
  if s.ndim != 2 or s.shape[0] != n:
    raise ValueError(f"{what}: slots must be [{n}, K] local slots per shard (e.g. "
                     f"batch.info.slot), got {list(s.shape)}.")
  k = keys if hasattr(keys, "dtype") else np.asarray(keys)  # host ints: numpy (rows.keyed_args)
  if k.ndim and k.shape != s.shape:
    raise ValueError(f"{what}: keys must be a scalar or of the slots' shape {list(s.shape)} "
                     f"(e.g. batch.info.key), got {list(k.shape)}.")
  flat_slots, flat, _ = rows.keyed_args(what, s.reshape(-1), k.reshape(-1) if k.ndim else k)
  s = flat_slots.reshape(s.shape)
  keys = jnp.broadcast_to(jnp.asarray(flat, jnp.uint32).reshape(k.shape), s.shape)
  if values is not None:
    v = values if hasattr(values, "dtype") else np.asarray(values)  # host ints: numpy
    if v.dtype.kind not in values_kinds:
      raise TypeError(f"{what}: {values_name} must be "
                      f"{'integers' if values_kinds == 'iu' else 'numbers'}, got {v.dtype}.")
    if "f" in values_kinds:
      values = rows.fit_float(values, np.float32, f"{what}: {values_name}")
    elif bad := numerics.beyond(v, np.int32):  # would wrap (rows.keyed_args' check)
      raise ValueError(f"{what}: {values_name} must fit int32, got values in "
                       f"[{bad[0]}, {bad[1]}].")
    values = per_shard(values, n, s.shape[1], jnp.float32 if "f" in values_kinds
                       else jnp.int32, f"{what}: {values_name}")
  return s.astype(jnp.int32), keys, values


def global_diff(state):
  """The global limiter difference of a sharded state (float32[])."""
  # Sum of per-shard p*inserts - q*samples (linear), in float32 as the
  # limiter predicates read it; no int32 overflow over many shards.
  return jnp.sum(state.limiter_diff.astype(jnp.float32))
