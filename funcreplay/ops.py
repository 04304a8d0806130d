"""The pure table operations (everything except ``sample``).

Every function takes the static ``TableSpec`` first and is meant to be closed
over by ``make_table``. All are jit-, scan- and vmap-compatible; shapes that
must be static (batch sizes) come from the arguments' shapes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay import counters as ctr
from funcreplay import indexes, inplace, staleness, trees
from funcreplay import native as native_lib
from funcreplay import rate_limiters as rl
from funcreplay import selectors as sel
from funcreplay.spec import TableSpec
from funcreplay.state import TableState

# --- helpers ----------------------------------------------------------------

def _batch_size(spec: TableSpec, items) -> int:
  leaves = spec.signature.treedef.flatten_up_to(items)
  sizes = set()
  for name, s, leaf in zip(spec.signature.names, spec.signature.leaves, leaves, strict=True):
    shape = tuple(jnp.shape(leaf))
    if shape[1:] != tuple(s.shape) or len(shape) != len(s.shape) + 1:
      raise ValueError(f"insert: item leaf {name}: expected shape [B, "
                       f"{', '.join(map(str, s.shape))}], got {list(shape)}.")
    if jnp.result_type(leaf) != s.dtype:
      raise TypeError(f"insert: item leaf {name}: expected dtype {s.dtype}, got "
                      f"{jnp.result_type(leaf)}.")
    sizes.add(shape[0])
  if len(sizes) != 1:
    raise ValueError(f"insert: item leaves disagree on the batch size: {sorted(sizes)}.")
  return sizes.pop()


def _rows(x, b, dtype, name):
  x = jnp.asarray(x)
  if x.ndim not in (0, 1) or (x.ndim == 1 and x.shape[0] != b):
    raise ValueError(f"{name} must be a scalar or have shape [{b}], got {list(x.shape)}.")
  return jnp.broadcast_to(x, (b,)).astype(dtype)


def _sanitize_priorities(p, counted):
  """Negative / NaN / inf -> 0 (documented); returns (clean, n_invalid)."""
  bad = ~jnp.isfinite(p) | (p < 0)
  return jnp.where(bad, 0.0, p).astype(jnp.float32), jnp.sum(bad & counted).astype(jnp.uint32)


def last_occurrence(slots, valid):
  """bool[K]: True at the last valid occurrence of each slot (O(K log K))."""
  k = slots.shape[0]
  sort_key = jnp.where(valid, slots, jnp.iinfo(jnp.int32).max)
  pos = jnp.arange(k, dtype=jnp.int32)
  s_key, s_pos = lax.sort((sort_key, pos), num_keys=1, is_stable=True)
  is_last_sorted = jnp.concatenate([s_key[1:] != s_key[:-1], jnp.ones((1,), bool)])
  is_last = jnp.zeros((k,), bool).at[s_pos].set(is_last_sorted)
  return is_last & valid


def _key_matches(state: TableState, slots, keys):
  c = state.occupied.shape[0]
  slots = jnp.asarray(slots, jnp.int32)
  in_range = (slots >= 0) & (slots < c)
  safe = jnp.where(in_range, slots, 0)
  ok = in_range & state.occupied[safe] & (state.key[safe] == jnp.asarray(keys, jnp.uint32))
  return safe, ok


def take(col, slots):
  """``col[slots]`` as a real gather even for one slot.

  A one-row gather lowers to a dynamic slice, which XLA re-fuses into every
  consumer; a consumer not ordered before a later in-place write of ``col``
  then costs a copy of the whole column. Two indices keep it a gather.
  """
  if slots.shape[0] == 1:
    return col[jnp.concatenate([slots, slots])][:1]
  return col[slots]


def _remove(spec: TableSpec, state: TableState, slots, mask, cause: str) -> TableState:
  """Free ``slots[mask]`` (unique), counting them under ``cause``. Trees not refreshed."""
  n = jnp.sum(mask).astype(jnp.uint32)
  reuse = take(state.times_sampled, slots)
  # The caller may overwrite times_sampled next (insert): order that after this read.
  state = state.replace(times_sampled=inplace.tie(state.times_sampled, inplace.never(reuse)))
  if spec.max_staleness is not None:
    versions = take(state.version, slots)
    hist, bounds = staleness.on_remove(spec, state.version_hist, state.version_bounds,
                                       versions, mask)
    state = state.replace(version_hist=hist, version_bounds=bounds)
  c = dict(state.counters)
  c[cause] = ctr.add(c[cause], n)
  c["removed_reuse_sum"] = ctr.add_sum(c["removed_reuse_sum"], reuse, mask)
  occupied = state.occupied.at[jnp.where(mask, slots, state.occupied.shape[0])].set(
      False, mode="drop")
  return state.replace(occupied=occupied, counters=c)


def _scatter_rows(tree_data, slots, rows_data, write):
  """Write ``rows_data[i]`` into ``slots[i]`` where ``write[i]`` (slots unique)."""
  c = jax.tree_util.tree_leaves(tree_data)[0].shape[0]
  idx = jnp.where(write, slots, c)
  return jax.tree_util.tree_map(lambda buf, x: buf.at[idx].set(x, mode="drop"), tree_data,
                                rows_data)


# --- insert -----------------------------------------------------------------

def insert(spec: TableSpec, state: TableState, items: Any, *, version=0, priority=None,
           mask=None, metadata: Optional[Mapping[str, Any]] = None, rng=None,
           native: bool = False) -> TableState:
  """Insert a batch of ``B`` items (``B`` static, ``B <= capacity``).

  Args:
    items: item pytree with a leading ``[B]`` axis on every leaf.
    version: int32 scalar or ``[B]``: policy version that produced each item.
    priority: float32 scalar or ``[B]``; default ``spec.default_priority`` or
      the largest priority seen so far. Negative / NaN / inf priorities are
      stored as 0 and counted in ``stats().invalid_priorities``.
    mask: bool ``[B]``; rows with False are ignored (padding), so a host can
      insert fixed-size batches without recompiling.
    metadata: dict column -> int32 scalar or ``[B]`` (missing columns: 0).
    rng: PRNG key, required only by the ``Uniform`` remover.
    native: use the native CPU kernel where one applies (``funcreplay.native``;
      ``make_table`` sets this). Other backends run the JAX implementation.

  Returns:
    The new state. Rows are inserted in order as if one at a time: free slots
    are used first; when full, the remover chooses a victim per row among
    the items and the row itself, as Reverb does (it inserts, then evicts):
    ``Lifo`` evicts the new row at once, a heap remover evicts it when its
    priority is the worst (ties: the older item goes), ``Uniform`` with
    probability ``1 / (C + 1)``; such a row counts as inserted and evicted.
    The ``Fifo`` remover is a ring: the oldest-*written* slot is overwritten,
    whether its item is still present or a hole left by a delete
    (``Fifo(fill_holes=True)``: free slots first, then the oldest item). Cost O(B log C) with a
    donated state; O(B) data movement.
  """
  b = _batch_size(spec, items)
  cap = spec.capacity
  if b > cap:
    raise ValueError(f"insert: batch of {b} items exceeds the table capacity {cap}; "
                     "split the batch or grow the table.")
  if isinstance(spec.remover, sel.Uniform) and rng is None:
    raise ValueError("insert: the Uniform remover needs an explicit PRNG key: pass rng=.")
  metadata = dict(metadata or {})
  unknown = set(metadata) - set(spec.metadata)
  if unknown:
    raise ValueError(f"insert: unknown metadata columns {sorted(unknown)}; the spec declares "
                     f"{list(spec.metadata)}.")
  all_rows = mask is None
  mask = jnp.ones((b,), bool) if mask is None else _rows(mask, b, bool, "insert mask")
  versions = _rows(version, b, jnp.int32, "insert version")
  if priority is None:
    default = state.max_priority if spec.default_priority is None else spec.default_priority
    prios, n_bad = _rows(default, b, jnp.float32, "priority"), jnp.uint32(0)
  else:
    prios, n_bad = _sanitize_priorities(_rows(priority, b, jnp.float32, "insert priority"), mask)
  meta_rows = {k: _rows(metadata.get(k, 0), b, jnp.int32, f"metadata[{k!r}]")
               for k in spec.metadata}

  if all_rows:  # every row is real: ranks are known when tracing (no scan over the mask)
    rank, n_real = jnp.arange(b, dtype=jnp.int32), jnp.int32(b)
  else:
    rank = jnp.cumsum(mask.astype(jnp.int32)) - 1
    n_real = jnp.sum(mask.astype(jnp.int32))

  def portable(state):
    state = _insert_rows(spec, state, items, mask, versions, prios, meta_rows, rank, n_real, rng)
    c = dict(state.counters)
    c["invalid_priorities"] = ctr.add(c["invalid_priorities"], n_bad)
    max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(mask, prios, 0.0)))
    return state.replace(counters=c, max_priority=max_p)

  if native and native_lib.supports_insert(spec) and native_lib.available():
    from funcreplay.native import insert as native_insert
    return lax.platform_dependent(
        state, cpu=lambda st: native_insert.insert(spec, st, items, mask, versions, prios,
                                                   meta_rows, n_bad),
        default=portable)
  return portable(state)


def _insert_rows(spec, state, items, mask, versions, prios, meta_rows, rank, n_real, rng):
  """``insert`` from the validated rows on, in JAX operations (every backend)."""
  cap = spec.capacity
  keys = state.next_key + rank.astype(jnp.uint32)
  # Advance next_key first: item ages (next_key - key) order the remover trees.
  state = state.replace(next_key=state.next_key + n_real.astype(jnp.uint32))
  hist, bounds = staleness.advance(spec, state.version_hist, state.version_bounds, versions, mask)
  state = state.replace(version_hist=hist, version_bounds=bounds)
  columns = dict(key=keys, version=versions, priority=prios, metadata=meta_rows)

  if sel.is_ring(spec.remover):
    slots = (state.write_pos + rank) % cap
    victims = mask & take(state.occupied, jnp.where(mask, slots, 0))
    state = _remove(spec, state, slots, victims, "evicted_capacity")
    state = _write(spec, state, slots, mask, items, columns)
    state = state.replace(write_pos=(state.write_pos + n_real) % cap)
  else:
    n_free = cap - state.size
    to_free = mask & (rank < n_free)
    free_slots = trees.descend_count(state.occ_tree, jnp.where(to_free, rank, 0), free=True)
    state = _write(spec, state, free_slots, to_free, items, columns)
    state = _insert_with_victims(spec, state, mask & ~to_free, items, columns, rng)

  c = dict(state.counters)
  c["inserts"] = ctr.add(c["inserts"], n_real)
  return state.replace(
      counters=c,
      limiter_diff=rl.update_diff(spec.rate_limiter, state.limiter_diff, inserted=n_real))


def _write(spec, state, slots, write, items, columns):
  """Scatter rows into unique ``slots`` where ``write`` and refresh the trees."""
  cap = spec.capacity
  idx = jnp.where(write, slots, cap)

  def put(col, x):
    return col.at[idx].set(x, mode="drop")

  version_col = state.version
  if spec.max_staleness is not None:
    # _remove read versions of these slots into the index: overwrite them after.
    version_col = inplace.tie(version_col, inplace.never((state.version_hist,
                                                          state.version_bounds)))
  hist, bounds = staleness.add(spec, state.version_hist, state.version_bounds,
                               columns["version"], write)

  state = state.replace(
      data=_scatter_rows(state.data, slots, items, write),
      occupied=put(state.occupied, True),
      key=put(state.key, columns["key"]),
      version=put(version_col, columns["version"]),
      times_sampled=put(state.times_sampled, 0),
      priority=put(state.priority, columns["priority"]),
      metadata={k: put(v, columns["metadata"][k]) for k, v in state.metadata.items()},
      version_hist=hist, version_bounds=bounds,
  )
  return indexes.refresh(spec, state, slots, write)


def _insert_with_victims(spec, state, need, items, columns, rng):
  """Insert rows ``need`` one at a time into a full table, evicting per the remover.

  Sequential on purpose: Reverb's removers run once per inserted item, so a
  later row of the same batch may evict an earlier one (e.g. Lifo). As in
  Reverb, which inserts first and then asks the remover, the row being
  inserted is itself a candidate (``new_item_is_victim``): then it is counted
  as inserted and evicted at once and the table is unchanged.
  """
  b = need.shape[0]
  if rng is None:
    rng = jax.random.PRNGKey(0)  # unused by deterministic removers
  if isinstance(spec.remover, sel.Lifo):  # the new item is always the newest: every row goes
    c = dict(state.counters)
    c["evicted_capacity"] = ctr.add(c["evicted_capacity"], jnp.sum(need).astype(jnp.uint32))
    return state.replace(counters=c)

  def one(r, st):
    def replace(st, victim):
      vs = victim[None]
      st = _remove(spec, st, vs, jnp.ones((1,), bool), "evicted_capacity")
      row = jax.tree_util.tree_map(lambda x: lax.dynamic_slice_in_dim(x, r, 1), items)
      cols = dict(key=columns["key"][r][None], version=columns["version"][r][None],
                  priority=columns["priority"][r][None],
                  metadata={k: v[r][None] for k, v in columns["metadata"].items()})
      return _write(spec, st, vs, jnp.ones((1,), bool), row, cols)

    def drop(st, victim):
      del victim
      c = dict(st.counters)
      c["evicted_capacity"] = ctr.add(c["evicted_capacity"], jnp.uint32(1))
      return st.replace(counters=c)

    def do(st):
      if isinstance(spec.remover, sel.Uniform):
        k, new_wins = new_item_is_victim(spec.remover, st, columns["priority"][r],
                                         u=jax.random.uniform(jax.random.fold_in(rng, r)))
        victim = trees.descend_count(st.occ_tree, k[None], free=False)[0]
      else:
        victim = trees.best(st.remover_tree)
        _, new_wins = new_item_is_victim(spec.remover, st, columns["priority"][r],
                                         victim=victim)
      return lax.cond(new_wins, drop, replace, st, victim)

    return lax.cond(need[r], do, lambda st: st, st)

  return lax.cond(jnp.any(need), lambda st: lax.fori_loop(0, b, one, st), lambda st: st, state)


def new_item_is_victim(remover, state, priority, *, victim=None, u=None):
  """Whether a full table's remover picks the item being inserted (Reverb's rule).

  Reverb inserts first, then asks the remover for a victim among the ``C + 1``
  items. ``Fifo``: never (the new item is the newest). ``Lifo``: always.
  ``MinHeap`` / ``MaxHeap``: when the new ``priority`` is strictly lower /
  higher than the best existing ``victim``'s (on a tie the older item goes).
  ``Uniform``: with probability ``1 / (C + 1)`` from the uniform ``u``.

  Returns:
    ``(k, is_new)``: for ``Uniform``, ``k`` int32[] is the rank of the existing
    victim among the occupied slots when ``is_new`` is False; else None.
  """
  if isinstance(remover, sel.Fifo):
    return None, jnp.asarray(False)
  if isinstance(remover, sel.Lifo):
    return None, jnp.asarray(True)
  if isinstance(remover, sel.Uniform):
    size = state.size
    k = jnp.minimum((u * (size + 1).astype(jnp.float32)).astype(jnp.int32), size)
    return jnp.minimum(k, size - 1), k == size
  sign = 1.0 if isinstance(remover, sel.MinHeap) else -1.0
  return None, priority * sign < state.priority[victim] * sign


# --- delete / priorities / metadata ------------------------------------------

def delete(spec: TableSpec, state: TableState, slots, keys) -> TableState:
  """Remove the items at ``slots`` whose key still equals ``keys`` (int32/uint32 [K])."""
  safe, ok = _key_matches(state, slots, keys)
  ok = last_occurrence(safe, ok)
  state = _remove(spec, state, safe, ok, "deletes")
  return indexes.refresh(spec, state, safe, ok)


def update_priorities(spec: TableSpec, state: TableState, slots, keys, priorities, *,
                      native: bool = False) -> TableState:
  """Set priorities where the slot still holds ``keys``; others are ignored.

  Duplicate slots in one call: the last occurrence wins. Negative, NaN or
  infinite priorities are stored as 0 and counted in
  ``stats().invalid_priorities`` (the host ``Table`` raises instead).
  ``native``: use the native CPU kernel where one applies (``make_table`` sets it).
  """
  slots = jnp.asarray(slots, jnp.int32)
  priorities = jnp.broadcast_to(jnp.asarray(priorities, jnp.float32), slots.shape)
  keys = jnp.broadcast_to(jnp.asarray(keys, jnp.uint32), slots.shape)
  if native and native_lib.supports_update_priorities(spec) and native_lib.available():
    from funcreplay.native import priorities as native_priorities
    return lax.platform_dependent(
        state, cpu=lambda st: native_priorities.update_priorities(spec, st, slots, keys,
                                                                  priorities),
        default=lambda st: _update_priorities(spec, st, slots, keys, priorities))
  return _update_priorities(spec, state, slots, keys, priorities)


def _update_priorities(spec, state, slots, keys, priorities):
  safe, ok = _key_matches(state, slots, keys)
  win = last_occurrence(safe, ok)
  clean, n_bad = _sanitize_priorities(priorities, win)
  prio = state.priority.at[jnp.where(win, safe, spec.capacity)].set(clean, mode="drop")
  c = dict(state.counters)
  c["invalid_priorities"] = ctr.add(c["invalid_priorities"], n_bad)
  max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(win, clean, 0.0), initial=0.0))
  state = state.replace(priority=prio, counters=c, max_priority=max_p)
  # Occupancy is unchanged: only the trees ordered by priority move.
  return indexes.refresh(spec, state, safe, win, which=("weight_tree", "remover_tree"))


def set_metadata(spec: TableSpec, state: TableState, slots, keys, column: str,
                 values) -> TableState:
  """Set metadata ``column`` where the slot still holds ``keys`` (last write wins)."""
  if column not in spec.metadata:
    raise ValueError(f"set_metadata: unknown column {column!r}; the spec declares "
                     f"{list(spec.metadata)}.")
  slots = jnp.asarray(slots, jnp.int32)
  values = jnp.broadcast_to(jnp.asarray(values, jnp.int32), slots.shape)
  safe, ok = _key_matches(state, slots, keys)
  win = last_occurrence(safe, ok)
  col = state.metadata[column].at[jnp.where(win, safe, spec.capacity)].set(values, mode="drop")
  return state.replace(metadata={**state.metadata, column: col})


# --- staleness ----------------------------------------------------------------

def stale_mask(spec: TableSpec, state: TableState, version):
  """bool[C]: occupied items older than ``max_staleness`` at ``version``."""
  if spec.max_staleness is None:
    return jnp.zeros_like(state.occupied)
  return state.occupied & (state.version < staleness.threshold(spec, version))


def evict_stale(spec: TableSpec, state: TableState, version) -> TableState:
  """Free every item too stale for ``version``. O(C)."""
  if spec.max_staleness is None:
    raise ValueError("evict_stale: the table has no max_staleness; set TableSpec.max_staleness.")
  stale = stale_mask(spec, state, version)
  slots = jnp.arange(spec.capacity, dtype=jnp.int32)
  state = _remove(spec, state, slots, stale, "evicted_stale")
  return indexes.rebuild(spec, state)


# --- queries ------------------------------------------------------------------

def eligible_mask(spec: TableSpec, state: TableState, version=None, where=None):
  """bool[C]: items a sample at ``version`` restricted to ``where`` may return
  (under a ``Prioritized`` sampler, only items of positive sampling weight)."""
  ok = state.occupied
  if spec.prioritized:
    ok = indexes.sample_weight(spec, ok, state.priority) > 0
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
  ``funcreplay.staleness``); O(C) with ``where``, with any mask under a
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


def can_insert(spec: TableSpec, state: TableState, num_items=1):
  """Rate limiter: may ``num_items`` be inserted now? bool[]."""
  return spec.rate_limiter.can_insert(state.size, state.limiter_diff, num_items)


def can_sample(spec: TableSpec, state: TableState, batch_size=1, version=None, where=None):
  """Rate limiter allows ``batch_size`` samples *and* that many items are eligible."""
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
    removed = sum(out[k] for k in ("deletes", "evicted_capacity", "evicted_stale", "evicted_reuse"))
    out["mean_reuse_at_eviction"] = out["removed_reuse_sum"] / removed if removed else 0.0
    out["mean_staleness_sampled"] = (out["sampled_staleness_sum"] / out["samples"]
                                     if out["samples"] else 0.0)
    out["max_priority"] = float(self.max_priority)
    return out


def stats(spec: TableSpec, state: TableState) -> Stats:
  """Size, counters, evictions by cause, mean reuse at eviction, mean staleness sampled."""
  c = state.counters
  removed = sum(ctr.to_float(c[k]) for k in ("deletes", "evicted_capacity", "evicted_stale",
                                               "evicted_reuse"))
  samples = ctr.to_float(c["samples"])
  return Stats(
      size=state.size, capacity=jnp.int32(spec.capacity), counters=dict(c),
      mean_reuse_at_eviction=jnp.where(removed > 0, ctr.to_float(c["removed_reuse_sum"])
                                       / jnp.maximum(removed, 1), 0.0),
      mean_staleness_sampled=jnp.where(samples > 0, ctr.to_float(c["sampled_staleness_sum"])
                                       / jnp.maximum(samples, 1), 0.0),
      max_priority=state.max_priority)
