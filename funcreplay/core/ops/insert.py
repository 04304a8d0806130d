"""``insert``: a batch of items into free slots, or over the remover's victims.

Every function takes the static ``TableSpec`` first and is meant to be closed
over by ``make_table``. All are jit-, scan- and vmap-compatible; shapes that
must be static (batch sizes) come from the arguments' shapes.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
from jax import lax

from funcreplay.core import bits, executor, indexes, inplace, item_info, staleness, storage, trees
from funcreplay.core import counters as ctr
from funcreplay.core import rate_limiters as rl
from funcreplay.core import selectors as sel
from funcreplay.core.ops import insert_lean
from funcreplay.core.ops.remove import remove
from funcreplay.core.ops.rows import batch_size as _batch_size
from funcreplay.core.ops.rows import rows as _rows
from funcreplay.core.ops.rows import sanitize_priorities as _sanitize_priorities
from funcreplay.core.ops.rows import take
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState

# --- helpers ----------------------------------------------------------------


def _scatter_rows(tree_data, slots, rows_data, write):
  """Write ``rows_data[i]`` into ``slots[i]`` where ``write[i]`` (slots unique)."""
  c = jax.tree_util.tree_leaves(tree_data)[0].shape[0]
  idx = jnp.where(write, slots, c)
  return jax.tree_util.tree_map(lambda buf, x: buf.at[idx].set(x, mode="drop"), tree_data,
                                rows_data)


# --- insert -----------------------------------------------------------------

def insert(spec: TableSpec, state: TableState, items: Any, *, version=0, priority=None,
           mask=None, metadata: Optional[Mapping[str, Any]] = None, rng=None,
           native: Optional[executor.Executor] = None) -> TableState:
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
    native: an executor (``core.executor``) whose CPU kernel runs where one
      applies (``fr.make_table`` passes ``funcreplay.native``'s), except for one
      row into the ``Fifo`` ring of a table with no ``Prioritized`` sampler,
      ``max_staleness`` or metadata, where the lean JAX program is faster; other
      backends, and None, run the JAX implementation.

  Returns:
    The new state. Rows are inserted in order as if one at a time: free slots
    are used first; when full, the remover chooses a victim per row among
    the items and the row itself, as Reverb does (it inserts, then evicts):
    ``Lifo`` evicts the new row at once, a heap remover evicts it when its
    priority is the worst (ties: the existing item, touched less recently, goes), ``Uniform`` with
    probability ``1 / (C + 1)``; such a row counts as inserted and evicted.
    The ``Fifo`` remover is a ring: the oldest-*written* slot is overwritten,
    whether its item is still present or a hole left by a delete
    (``Fifo(fill_holes=True)``: free slots first, then the oldest item).
    Cost O(B log C) with a donated state; O(B) data movement.
  """
  b = _batch_size(spec, items)
  storage.check(spec, state.data, "insert")
  cap = spec.capacity
  if b > cap:
    raise ValueError(f"insert: batch of {b} items exceeds the table capacity {cap}; "
                     "split the batch or grow the table.")
  if isinstance(spec.remover, sel.Uniform) and rng is None:
    raise ValueError("insert: the Uniform remover needs an explicit PRNG key: pass rng=.")
  if rng is not None:
    bits.check_key(rng, "insert")
  metadata = dict(metadata or {})
  unknown = set(metadata) - set(spec.metadata)
  if unknown:
    raise ValueError(f"insert: unknown metadata columns {sorted(unknown)}; the spec declares "
                     f"{list(spec.metadata)}.")
  if b == 0:  # nothing to insert (packing and the priority max need rows): as is
    return state
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
    if insert_lean.applies(spec, mask=None if all_rows else mask):
      return insert_lean.insert(spec, state, items, version=versions, priority=priority,
                                metadata=meta_rows)
    state = _insert_rows(spec, state, items, mask, versions, prios, meta_rows, rank, n_real, rng)
    c = dict(state.counters)
    c["invalid_priorities"] = ctr.add(c["invalid_priorities"], n_bad)
    max_p = jnp.maximum(state.max_priority, jnp.max(jnp.where(mask, prios, 0.0)))
    return state.replace(counters=c, max_priority=max_p)

  native = executor.check(native, "insert")
  # One row into the plain ring (no weight tree, no version index, no metadata): the lean
  # program is the faster executor of the same algorithm there (in-scan 0.80 us a step
  # against the kernel's 1.05; an XLA:CPU custom call alone costs 0.85, BUILD.md findings
  # 14-15), so it runs for native tables too. Not otherwise: with a Prioritized sampler
  # the lean program costs 3.75 us (its sum-tree refresh), with max_staleness 4.57 (the
  # version index), the kernel 1.13 / 1.04. Static: B, the mask and the spec.
  one_row_ring = (b == 1 and all_rows and not spec.prioritized and spec.max_staleness is None
                  and not spec.metadata and insert_lean.applies(spec))
  if native and not one_row_ring and native.supports_insert(spec) and native.available():
    return lax.platform_dependent(
        state, cpu=lambda st: native.insert(spec, st, items, mask, versions, prios,
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
  if spec.touch_stamps:
    # Row r's stamp is clock + rank, as if inserted one at a time; advance the
    # clock first (like next_key): stamp ages order the heap trees.
    # The clock is read once and its write computed from that read, so the read is
    # ordered before the in-place write (as ``.add``, the write did not wait for the
    # stamps' reads, and XLA copied ``touched`` every step of a scan).
    clock = inplace.once(state.touched[cap])
    columns["touched"] = clock + rank.astype(jnp.uint32)
    state = state.replace(touched=state.touched.at[cap].set(clock + n_real.astype(jnp.uint32)))

  if sel.is_ring(spec.remover):
    slots = (state.write_pos + rank) % cap
    victims = mask & take(state.occupied, jnp.where(mask, slots, 0))
    state = remove(spec, state, slots, victims, "evicted_capacity")
    state = _write(spec, state, slots, mask, items, columns)
    state = state.replace(write_pos=(state.write_pos + n_real) % cap)
  else:
    # The size read once (inplace.once): re-fused into consumers not ordered before the
    # writes of occ_tree below, it made XLA copy the tree twice a step in a scan.
    n_free = cap - inplace.once(state.size)
    to_free = mask & (rank < n_free)
    # The free slots computed once (a reduction, or for one row a sort: XLA re-fuses
    # neither): each row write would otherwise recompute the descent, reading the tree
    # again after the refresh below started writing it, and XLA copied the tree twice a
    # call (a heap remover's insert into a table with room, on CPU and GPU;
    # experiments/accel_copies.py).
    free_slots = trees.descend_count(state.occ_tree, jnp.where(to_free, rank, 0), free=True)
    free_slots = (inplace.once(free_slots) if free_slots.shape[0] == 1
                  else inplace.materialize(free_slots))
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

  info = state.item_info
  if spec.max_staleness is not None:
    # remove read versions of these slots into the index: overwrite them after.
    info = inplace.tie(info, inplace.never((state.version_hist, state.version_bounds)))
  hist, bounds = staleness.add(spec, state.version_hist, state.version_bounds,
                               columns["version"], write)
  rows = item_info.pack(key=columns["key"], version=columns["version"],
                        times_sampled=0,
                        priority=columns["priority"])

  state = state.replace(
      data=_scatter_rows(state.data, slots,
                         storage.pack(spec.signature, spec.packed_rows, items, 1), write),
      occupied=put(state.occupied, True),
      item_info=put(info, rows),
      metadata={k: put(v, columns["metadata"][k]) for k, v in state.metadata.items()},
      version_hist=hist, version_bounds=bounds,
  )
  if "touched" in columns:
    # touched[cap] is the clock: masked rows go past it (dropped).
    state = state.replace(touched=state.touched.at[jnp.where(write, slots, cap + 1)].set(
        columns["touched"], mode="drop"))
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
  columns = jax.tree_util.tree_map(jnp.asarray, columns)  # host rows: indexed by the loop's r
  if rng is None:
    rng = jax.random.PRNGKey(0)  # unused by deterministic removers
  if isinstance(spec.remover, sel.Lifo):  # the new item is always the newest: every row goes
    c = dict(state.counters)
    c["evicted_capacity"] = ctr.add(c["evicted_capacity"], jnp.sum(need).astype(jnp.uint32))
    return state.replace(counters=c)

  def one(r, st):
    # Branch-free: row r's victim is removed and the row written under the mask ``go``
    # (nothing happens for a row that is not needed, or whose own priority makes it the
    # victim). Conditions on the state (the previous form: lax.cond per row and around the
    # loop) made XLA copy every column and the data inside a scan (47 ms a step at C =
    # 65,536; BUILD.md finding 14), since reads elsewhere are not ordered before them.
    if isinstance(spec.remover, sel.Uniform):
      k, new_wins = new_item_is_victim(spec.remover, st, columns["priority"][r],
                                       words=bits.words(jax.random.fold_in(rng, r), 1))
      victim = trees.descend_count(st.occ_tree, k[None], free=False)[0]
    else:
      victim = trees.best(st.remover_tree)
      _, new_wins = new_item_is_victim(spec.remover, st, columns["priority"][r],
                                       victim=victim)
    # Read once (inplace.once): XLA would re-fuse these reads of the remover tree and the
    # priority column into several consumers, not all ordered before the writes below,
    # and copy both every row.
    victim, new_wins = inplace.once((victim, new_wins))
    go = (need[r] & ~new_wins)[None]
    vs = jnp.maximum(victim, 0)[None]
    st = remove(spec, st, vs, go, "evicted_capacity")
    row = jax.tree_util.tree_map(lambda x: lax.dynamic_slice_in_dim(x, r, 1), items)
    cols = dict(key=columns["key"][r][None], version=columns["version"][r][None],
                priority=columns["priority"][r][None],
                metadata={k: v[r][None] for k, v in columns["metadata"].items()})
    if "touched" in columns:
      cols["touched"] = columns["touched"][r][None]
    st = _write(spec, st, vs, go, row, cols)
    c = dict(st.counters)  # the new row itself evicted (Reverb counts it inserted and evicted)
    c["evicted_capacity"] = ctr.add(c["evicted_capacity"],
                                    (need[r] & new_wins).astype(jnp.uint32))
    return st.replace(counters=c)

  return lax.fori_loop(0, b, one, state)


def new_item_is_victim(remover, state, priority, *, victim=None, words=None):
  """Whether a full table's remover picks the item being inserted (Reverb's rule).

  Reverb inserts first, then asks the remover for a victim among the ``C + 1``
  items. ``Fifo``: never (the new item is the newest). ``Lifo``: always.
  ``MinHeap`` / ``MaxHeap``: when the new ``priority`` is strictly lower /
  higher than the best existing ``victim``'s (on a tie the item least recently
  inserted or updated goes, never the new one).
  ``Uniform``: with probability ``1 / (C + 1)``: rank ``below(hi, lo, size + 1)`` of the
  random ``words`` (``(hi, lo)`` uint32[1]), exact to 2**-32. (A float32 ``u * (size + 1)``
  was not: ``jax.random.uniform`` has 2**23 values, so among 1M items some ranks had 8
  and some 9 of them, and beyond 2**24 items the new item was never the victim.)

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
    hi, lo = words
    k = bits.below(hi[0], lo[0], (size + 1).astype(jnp.uint32)).astype(jnp.int32)
    return jnp.minimum(k, size - 1), k == size
  sign = 1.0 if isinstance(remover, sel.MinHeap) else -1.0
  return None, priority * sign < item_info.at(state.item_info, victim, "priority") * sign


# --- delete / priorities / metadata ------------------------------------------


# --- staleness ----------------------------------------------------------------


# --- queries ------------------------------------------------------------------


