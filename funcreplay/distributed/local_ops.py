"""The per-shard operations of a sharded table (each shard runs the local table).

Each function takes the table's ``ShardContext`` first (``make_sharded_table``
binds it); states, items and per-slot arguments carry the shard axis first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import ops
from funcreplay.core import selectors as sel
from funcreplay.core.state import TableState
from funcreplay.distributed.mesh import check_leading as _leading
from funcreplay.distributed.mesh import expand as _expand
from funcreplay.distributed.mesh import global_counter_sum, global_diff, keyed_args
from funcreplay.distributed.mesh import per_shard as _per_shard
from funcreplay.distributed.mesh import squeeze as _squeeze
from funcreplay.distributed.mesh import uses_priority as _uses_priority


def init(ctx) -> TableState:
  """A fresh sharded state, leaves ``[S, ...]``, already laid out on the mesh."""
  local, sh, smap = ctx.local, ctx.sh, ctx.smap
  return smap(lambda: _expand(local.init()), (), sh)()


def insert(ctx, state: TableState, items, *, version=0, priority=None, mask=None,
           metadata=None, rng=None) -> TableState:
  """Each shard ``s`` inserts ``items[s]`` (leaves ``[S, B, ...]``).

  ``version``, ``priority``, ``mask`` and each ``metadata`` column are a
  scalar, ``[S]`` (one per shard) or ``[S, B]``. ``rng`` (Uniform remover
  only) is one key; shard ``s`` uses ``fold_in(rng, s)``. Without an explicit
  priority, new items get the largest priority seen on *any* shard, as the
  unsharded table would.
  """
  spec, local, n, axis, sh, rep, smap, shard_id = (ctx.spec, ctx.local, ctx.n, ctx.axis, ctx.sh,
                                                    ctx.rep, ctx.smap, ctx.shard_id)
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


def sample(ctx, state: TableState, rng, *, batch_size: int, version=None, where=None,
           replace: bool = False):
  """Every shard samples ``batch_size`` of its own items -> ``Sample`` ``[S, B, ...]``.

  ``where`` is a bool ``[S, C // S]`` mask. ``info.probability`` is the
  probability of the item under "pick a shard uniformly, then sample it"
  (``p_local / S``; 1 for the deterministic samplers) and
  ``num_eligible`` (``[S]``) is the global eligible count, so
  ``importance_weights`` sees global quantities.
  """
  spec, local, n, axis, sh, rep, smap, shard_id = (ctx.spec, ctx.local, ctx.n, ctx.axis, ctx.sh,
                                                   ctx.rep, ctx.smap, ctx.shard_id)
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


def delete(ctx, state, slots, keys):
  """Per shard: ``slots``/``keys`` are ``[S, K]`` local slots (e.g. ``info.slot``)."""
  local, sh, smap = ctx.local, ctx.sh, ctx.smap
  slots, keys, _ = keyed_args("delete", ctx.n, slots, keys)
  return smap(lambda st, s, k: _expand(local.delete(_squeeze(st), s[0], k[0])),
              (sh, sh, sh), sh)(state, slots, keys)


def update_priorities(ctx, state, slots, keys, priorities):
  """Per shard: ``[S, K]`` local slots and keys (from ``info``); priorities a scalar,
  ``[S]`` (one per shard) or ``[S, K]``."""
  local, sh, smap = ctx.local, ctx.sh, ctx.smap
  slots, keys, prios = keyed_args("update_priorities", ctx.n, slots, keys, priorities,
                                  "priorities")
  return smap(lambda st, s, k, p: _expand(local.update_priorities(_squeeze(st), s[0], k[0],
                                                                   p[0])),
              (sh, sh, sh, sh), sh)(state, slots, keys, prios)


def set_metadata(ctx, state, slots, keys, column: str, values):
  """Per shard: ``[S, K]`` local slots and keys; int values of ``column`` a scalar,
  ``[S]`` (one per shard) or ``[S, K]``."""
  local, sh, smap = ctx.local, ctx.sh, ctx.smap
  slots, keys, vals = keyed_args("set_metadata", ctx.n, slots, keys, values,
                                 values_kinds="iu")
  return smap(lambda st, s, k, v: _expand(local.set_metadata(_squeeze(st), s[0], k[0],
                                                              column, v[0])),
              (sh, sh, sh, sh), sh)(state, slots, keys, vals)


def evict_stale(ctx, state, version):
  """Every shard frees its items too stale for ``version``."""
  local, sh, rep, smap = ctx.local, ctx.sh, ctx.rep, ctx.smap
  return smap(lambda st, v: _expand(local.evict_stale(_squeeze(st), v)), (sh, rep), sh)(
      state, jnp.asarray(version, jnp.int32))


def eligible(ctx, state, version=None, where=None):
  """bool ``[S, C // S]``: items a sample at ``version`` within ``where`` may return."""
  local, n, sh, rep, smap = ctx.local, ctx.n, ctx.sh, ctx.rep, ctx.smap
  has_where = where is not None
  ver = None if version is None else jnp.asarray(version, jnp.int32)

  def per_shard(st, v, wh):
    return local.eligible(_squeeze(st), version=v, where=wh[0] if has_where else None)[None]

  return smap(per_shard, (sh, rep, sh), sh)(state, ver,
                                            where if has_where else jnp.zeros((n, 0), bool))


def count(ctx, state, where=None, version=None):
  """Global number of eligible items (int32[], replicated), by ``psum``."""
  local, n, axis, sh, rep, smap = ctx.local, ctx.n, ctx.axis, ctx.sh, ctx.rep, ctx.smap
  has_where = where is not None
  return smap(lambda st, wh, v: lax.psum(local.count(_squeeze(st), version=v,
                                                     where=wh[0] if has_where else None), axis),
              (sh, sh, rep), rep)(state, where if has_where else jnp.zeros((n, 0), bool),
                                  None if version is None else jnp.asarray(version, jnp.int32))


def can_insert(ctx, state, num_items=1):
  """Global rate limiter: may ``num_items`` more items be inserted (in total)?"""
  spec = ctx.spec
  return spec.rate_limiter.can_insert(jnp.sum(state.occ_tree[:, 1]), global_diff(state),
                                      num_items)


def can_sample(ctx, state, batch_size=1, version=None, where=None):
  """Global rate limiter allows ``batch_size`` samples and that many items are eligible."""
  spec = ctx.spec
  return (spec.rate_limiter.can_sample(jnp.sum(state.occ_tree[:, 1]), global_diff(state),
                                       batch_size)
          & (count(ctx, state, where, version) >= batch_size))


def stats(ctx, state) -> ops.Stats:
  """Global ``Stats``: sizes and counters summed over shards (exactly), max priority maxed."""
  c = {k: global_counter_sum(v) for k, v in state.counters.items()}
  return ops.stats_from(c, jnp.sum(state.occ_tree[:, 1]), ctx.spec.capacity,
                        jnp.max(state.max_priority))
