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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from funcreplay.core import counters as ctr
from funcreplay.core import indexes
from funcreplay.core import ops
from funcreplay.core import sampling
from funcreplay.core import staleness
from funcreplay.core import selectors as sel
from funcreplay.core.functional import FunctionalTable
from funcreplay.native.functional import make_table
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import Sample, TableState


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


# --- helpers ------------------------------------------------------------------

def _squeeze(tree):
  return jax.tree_util.tree_map(lambda x: x[0], tree)


def _expand(tree):
  return jax.tree_util.tree_map(lambda x: x[None], tree)


def _per_shard(x, n, b, dtype, name):
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


def _leading(tree, n, what):
  for leaf in jax.tree_util.tree_leaves(tree):
    shape = jnp.shape(leaf)
    if len(shape) < 1 or shape[0] != n:
      raise ValueError(f"{what}: every leaf needs the shard axis first, [{n}, ...] "
                       f"({n} shards), got a leaf of shape {list(shape)}.")


def global_counter_sum(c):
  """Exact two-word sum over shards of counters ``uint32[S, 2]`` -> ``uint32[2]``."""
  total = ctr.add_sum(ctr.zero(), c[:, 1])
  return total.at[0].add(jnp.sum(c[:, 0], dtype=jnp.uint32))


def _uses_priority(spec: TableSpec) -> bool:
  heap = (sel.MinHeap, sel.MaxHeap)
  return spec.prioritized or isinstance(spec.sampler, heap) or isinstance(spec.remover, heap)


# --- the table ------------------------------------------------------------------

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
  lspec = local.spec
  sharding = NamedSharding(mesh, P(axis))
  sh = P(axis)
  rep = P()
  explicit = jax.sharding.AxisType.Explicit in tuple(getattr(mesh, "axis_types", ()))

  def smap(f, in_specs, out_specs):
    # check_vma off: the per-shard ops mix replicated scalars (version, keys)
    # into loops carrying per-shard values, which the checker rejects.
    mapped = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                           check_vma=False)

    if not explicit:
      return mapped  # Auto axes: XLA moves mismatched inputs itself.

    def call(*args):
      # With Explicit mesh axes (the default of jax.make_mesh) shard_map
      # refuses inputs laid out otherwise: put each where it is wanted.
      args = [jax.tree_util.tree_map(lambda x, s=s: jax.reshard(x, NamedSharding(mesh, s)), a)
              for a, s in zip(args, in_specs)]
      return mapped(*args)

    return call

  def shard_id():
    return lax.axis_index(axis)

  # -- init ------------------------------------------------------------------
  def init() -> TableState:
    """A fresh sharded state, leaves ``[S, ...]``, already laid out on the mesh."""
    return smap(lambda: _expand(local.init()), (), sh)()

  # -- insert ----------------------------------------------------------------
  def insert(state: TableState, items, *, version=0, priority=None, mask=None,
             metadata=None, rng=None) -> TableState:
    """Each shard ``s`` inserts ``items[s]`` (leaves ``[S, B, ...]``).

    ``version``, ``priority``, ``mask`` and each ``metadata`` column are a
    scalar, ``[S]`` (one per shard) or ``[S, B]``. ``rng`` (Uniform remover
    only) is one key; shard ``s`` uses ``fold_in(rng, s)``. Without an explicit
    priority, new items get the largest priority seen on *any* shard, as the
    unsharded table would.
    """
    _leading(items, n, "sharded insert items")
    b = jax.tree_util.tree_leaves(items)[0].shape[1]
    args = dict(version=_per_shard(version, n, b, jnp.int32, "insert version"))
    if mask is not None:
      args["mask"] = _per_shard(mask, n, b, bool, "insert mask")
    if priority is not None:
      args["priority"] = _per_shard(priority, n, b, jnp.float32, "insert priority")
    meta = {k: _per_shard(v, n, b, jnp.int32, f"metadata[{k!r}]")
            for k, v in dict(metadata or {}).items()}
    global_default = (priority is None and spec.default_priority is None
                      and _uses_priority(spec))
    has_rng = rng is not None

    def body(st, it, a, md, key):
      st, it, a, md = _squeeze(st), _squeeze(it), _squeeze(a), _squeeze(md)
      if global_default:
        a["priority"] = jnp.full((b,), lax.pmax(st.max_priority, axis), jnp.float32)
      k = jax.random.fold_in(key, shard_id()) if has_rng else None
      return _expand(local.insert(st, it, metadata=md or None, rng=k, **a))

    key = rng if has_rng else jax.random.PRNGKey(0)
    return smap(body, (sh, sh, sh, sh, rep), sh)(state, items, args, meta, key)

  # -- sampling --------------------------------------------------------------
  def sample(state: TableState, rng, *, batch_size: int, version=None, where=None,
             replace: bool = False):
    """Every shard samples ``batch_size`` of its own items -> ``Sample`` ``[S, B, ...]``.

    ``where`` is a bool ``[S, C // S]`` mask. ``info.probability`` is the
    probability of the item under "pick a shard uniformly, then sample it"
    (``p_local / S``; 1 for the deterministic samplers) and
    ``num_eligible`` (``[S]``) is the global eligible count, so
    ``importance_weights`` sees global quantities.
    """
    has_where = where is not None

    def body(st, key, ver, wh):
      st = _squeeze(st)
      k = jax.random.fold_in(key, shard_id())
      st, out = local.sample(st, k, batch_size=batch_size, version=ver,
                             where=_squeeze(wh) if has_where else None, replace=replace)
      prob = out.info.probability
      if not sel.is_ordered(spec.sampler):
        prob = prob / n
      info = dataclasses.replace(out.info, probability=prob)
      out = dataclasses.replace(out, info=info, num_eligible=lax.psum(out.num_eligible, axis))
      return _expand(st), _expand(out)

    return smap(body, (sh, rep, rep, sh), (sh, sh))(
        state, rng, None if version is None else jnp.asarray(version, jnp.int32),
        where if has_where else jnp.zeros((n, 0), bool))

  def sample_global(state: TableState, rng, *, batch_size: int, version=None, where=None,
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
      return sample(state, rng, batch_size=min(m, batch_size), version=version, where=where,
                    replace=replace)
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
      eligible_fn, eligible_all = _eligibility(lspec, st, ver, wh)
      masked = ops.masks_active(lspec, ver, wh)

      # Eligible weight of this shard, read before the draw mutates the tree.
      if spec.prioritized:
        if masked:
          w_all = indexes.sample_weight(lspec, st.occupied, st.priority)
          total = jnp.sum(jnp.where(eligible_all(), w_all, 0.0))
        else:
          total = st.weight_tree[1]
      else:
        total = ops.count(lspec, st, wh, ver).astype(jnp.float32)
      n_elig = ops.count(lspec, st, wh, ver)

      picked, tree, touched = sampling._draw_weighted(  # noqa: SLF001
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
        logits = jnp.where(totals > 0, jnp.log(jnp.maximum(totals, 1e-30)), -jnp.inf)
        choice = jax.random.categorical(k_shared, logits, shape=(batch_size,))
        quota = jnp.where(jnp.any(totals > 0), jnp.sum(choice == s, dtype=jnp.int32), 0)
        keep = valid & (jnp.arange(m) < quota)
      else:
        before = jnp.cumsum(w_item) - w_item
        remaining = jnp.maximum(total - before, w_item)  # float drift: never below w_k
        gaps = jax.random.exponential(k_race, (m,)) / jnp.maximum(remaining, 1e-30)
        t = jnp.where(valid, jnp.cumsum(gaps), jnp.inf)
        # A shard that filled all M rows may have had earlier arrivals after
        # t[M-1]: only times up to the smallest such cutoff are exact.
        cutoff = jnp.where(valid[m - 1], t[m - 1], jnp.inf)
        all_t = lax.all_gather(t, axis).reshape(-1)   # [S * M]
        kth = jnp.sort(all_t)[batch_size - 1] if n * m >= batch_size else jnp.inf
        limit = jnp.minimum(kth, jnp.min(lax.all_gather(cutoff, axis)))
        keep = valid & (t <= limit)

      g_total = jnp.sum(totals)
      prob = w_item / jnp.maximum(g_total, 1e-30)
      st = st.replace(**{("weight_tree" if spec.prioritized else "occ_tree"): tree})
      st, out = sampling._finish(  # noqa: SLF001
          lspec, st, jnp.where(keep, picked, -1), prob, lax.psum(n_elig, axis), ver, replace)
      tree_field = "weight_tree" if spec.prioritized else "occ_tree"
      st = sampling.restore_zeroed(lspec, st, touched, tree_field)
      return _expand(st), _expand(out)

    return smap(body, (sh, rep, rep, sh), (sh, sh))(
        state, rng, ver_arg, where if has_where else jnp.zeros((n, 0), bool))

  # -- per-slot updates ------------------------------------------------------
  def delete(state, slots, keys):
    """Per shard: ``slots``/``keys`` are ``[S, K]`` local slots (e.g. ``info.slot``)."""
    return smap(lambda st, s, k: _expand(local.delete(_squeeze(st), s[0], k[0])),
                (sh, sh, sh), sh)(state, _slots(slots), _keys(keys))

  def update_priorities(state, slots, keys, priorities):
    """Per shard: ``[S, K]`` local slots, keys and priorities (from ``info``)."""
    slots = _slots(slots)
    prios = jnp.broadcast_to(jnp.asarray(priorities, jnp.float32), slots.shape)
    return smap(lambda st, s, k, p: _expand(local.update_priorities(_squeeze(st), s[0], k[0],
                                                                     p[0])),
                (sh, sh, sh, sh), sh)(state, slots, _keys(keys), prios)

  def set_metadata(state, slots, keys, column: str, values):
    """Per shard: ``[S, K]`` local slots, keys and int32 values of ``column``."""
    slots = _slots(slots)
    vals = jnp.broadcast_to(jnp.asarray(values, jnp.int32), slots.shape)
    return smap(lambda st, s, k, v: _expand(local.set_metadata(_squeeze(st), s[0], k[0],
                                                                column, v[0])),
                (sh, sh, sh, sh), sh)(state, slots, _keys(keys), vals)

  def evict_stale(state, version):
    """Every shard frees its items too stale for ``version``."""
    return smap(lambda st, v: _expand(local.evict_stale(_squeeze(st), v)), (sh, rep), sh)(
        state, jnp.asarray(version, jnp.int32))

  def _slots(x):
    x = jnp.asarray(x, jnp.int32)
    if x.ndim != 2 or x.shape[0] != n:
      raise ValueError(f"slots must be [{n}, K] local slots per shard (e.g. batch.info.slot), "
                       f"got {list(x.shape)}.")
    return x

  def _keys(x):
    return jnp.asarray(x, jnp.uint32)

  # -- queries ---------------------------------------------------------------
  def eligible(state, version=None, where=None):
    """bool ``[S, C // S]``: items a sample at ``version`` within ``where`` may return."""
    has_where = where is not None
    ver = None if version is None else jnp.asarray(version, jnp.int32)

    def per_shard(st, v, wh):
      return local.eligible(_squeeze(st), v, wh[0] if has_where else None)[None]

    return smap(per_shard, (sh, rep, sh), sh)(state, ver,
                                              where if has_where else jnp.zeros((n, 0), bool))

  def count(state, where=None, version=None):
    """Global number of eligible items (int32[], replicated), by ``psum``."""
    has_where = where is not None
    return smap(lambda st, wh, v: lax.psum(local.count(_squeeze(st),
                                                       wh[0] if has_where else None, v), axis),
                (sh, sh, rep), rep)(state, where if has_where else jnp.zeros((n, 0), bool),
                                    None if version is None else jnp.asarray(version, jnp.int32))

  def _global_diff(state):
    # Sum of per-shard p*inserts - q*samples (linear), in float32 as the
    # limiter predicates read it; no int32 overflow over many shards.
    return jnp.sum(state.limiter_diff.astype(jnp.float32))

  def can_insert(state, num_items=1):
    """Global rate limiter: may ``num_items`` more items be inserted (in total)?"""
    return spec.rate_limiter.can_insert(jnp.sum(state.occ_tree[:, 1]), _global_diff(state),
                                        num_items)

  def can_sample(state, batch_size=1, version=None, where=None):
    """Global rate limiter allows ``batch_size`` samples and that many items are eligible."""
    return (spec.rate_limiter.can_sample(jnp.sum(state.occ_tree[:, 1]), _global_diff(state),
                                         batch_size)
            & (count(state, where, version) >= batch_size))

  def stats(state) -> ops.Stats:
    """Global ``Stats``: sizes and counters summed over shards (exactly), max priority maxed."""
    c = {k: global_counter_sum(v) for k, v in state.counters.items()}
    removed = sum(ctr.to_float(c[k]) for k in ("deletes", "evicted_capacity", "evicted_stale",
                                                 "evicted_reuse"))
    samples = ctr.to_float(c["samples"])
    return ops.Stats(
        size=jnp.sum(state.occ_tree[:, 1]), capacity=jnp.int32(spec.capacity), counters=c,
        mean_reuse_at_eviction=jnp.where(removed > 0, ctr.to_float(c["removed_reuse_sum"])
                                         / jnp.maximum(removed, 1), 0.0),
        mean_staleness_sampled=jnp.where(samples > 0, ctr.to_float(c["sampled_staleness_sum"])
                                         / jnp.maximum(samples, 1), 0.0),
        max_priority=jnp.max(state.max_priority))

  return ShardedTable(
      spec=spec, local=local, mesh=mesh, axis=axis, num_shards=n, sharding=sharding,
      init=init, insert=insert, sample=sample, sample_global=sample_global, delete=delete,
      update_priorities=update_priorities, set_metadata=set_metadata, evict_stale=evict_stale,
      count=count, eligible=eligible, can_insert=can_insert, can_sample=can_sample, stats=stats,
      shard_state=lambda state: shard_state(state, mesh, axis),
      shard_items=lambda items: shard_items(items, mesh, axis))


def _eligibility(spec, state, ver, where):
  """(eligible_fn(slots) -> bool[K], eligible_all() -> bool[C]) as ``sampling.sample`` uses."""
  eligible_where = None if where is None else ops.eligible_mask(spec, state, None, where)

  def eligible_all():
    return ops.eligible_mask(spec, state, ver, where)

  def eligible_fn(slots):
    ok = state.occupied[slots]
    if ver is not None and spec.max_staleness is not None:
      ok = ok & (state.version[slots] >= staleness.threshold(spec, ver))
    if eligible_where is not None:
      ok = ok & eligible_where[slots]
    return ok

  return eligible_fn, eligible_all


# --- moving states and items on/off the mesh ------------------------------------

def shard_state(state: TableState, mesh: Mesh, axis: str = "data") -> TableState:
  """Lay out a host (numpy) or device sharded state ``[S, ...]`` on ``mesh``.

  Every process passes the *whole* state (e.g. from ``gather_state`` or a
  checkpoint); each keeps only its addressable shards. The inverse of
  ``gather_state``.
  """
  sharding = NamedSharding(mesh, P(axis))
  n = int(mesh.shape[axis])
  _leading(state, n, "shard_state")

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  return jax.tree_util.tree_map(put, state)


def gather_state(state: TableState) -> TableState:
  """The whole sharded state as numpy arrays on the host (every process gets it all)."""
  leaves = jax.tree_util.tree_leaves(state)
  if all(getattr(x, "is_fully_addressable", True) for x in leaves):
    return jax.device_get(state)
  from jax.experimental import multihost_utils  # only needed across processes
  return multihost_utils.process_allgather(state, tiled=True)


def shard_items(items, mesh: Mesh, axis: str = "data"):
  """Global ``[S, B, ...]`` items from each process's local shards ``[S_local, B, ...]``.

  In one process ``S_local = S``. Across processes each passes the rows of
  the shards on its own devices, in mesh order.
  """
  sharding = NamedSharding(mesh, P(axis))
  return jax.tree_util.tree_map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), items)


def importance_weights(sample: Sample, beta: float):
  """PER weights ``(N * P(i))**-beta`` normalised by the max over *all* shards' rows.

  For a sharded ``Sample`` (leaves ``[S, M]``); ``fr.importance_weights``
  expects an unsharded one.
  """
  n = jnp.maximum(sample.num_eligible, 1).astype(jnp.float32)[:, None]
  p = jnp.where(sample.valid, sample.info.probability, 1.0)
  w = jnp.where(sample.valid, jnp.power(n * jnp.maximum(p, 1e-30), -beta), 0.0)
  return w / jnp.maximum(jnp.max(w), 1e-30)
