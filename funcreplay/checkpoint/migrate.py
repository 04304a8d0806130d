"""Migrations: older checkpoint schemas, and growing the capacity of a restored state.

Schemas: ``format.SCHEMA_VERSION`` is 2. A schema-1 checkpoint (before the
manifest CRC and the occupied-rows layout) is read as it is: its manifest has
no ``manifest_crc32`` to verify (``format.read_manifest``) and no ``rows``
entry, so every leaf is whole (``rows.unpack`` does nothing); checkpoints
older still, without the version index, get it rebuilt from the columns
(``core``'s derived leaves). ``tests/checkpoint/fixtures/checkpoint_v1`` is one written by
the schema-1 code; its restore is checked bit for bit.

Growing from ``C`` to ``C' > C`` slots keeps every item, its key, version,
times_sampled, priority, metadata and touch stamp (heaps), and every counter;
the trees are rebuilt for the new tree size (sum-tree nodes are always
``fl(left + right)`` of their children, so a rebuild gives the same values
incremental updates would).

Slot order: with a ``Fifo`` remover the slots form a ring whose oldest-written
slot is ``write_pos``. The ring is *unrolled* into the new table: new slot
``i`` holds old slot ``(write_pos + i) % C`` for ``i < C`` and the new
``write_pos`` is ``C``, so the next inserts fill the ``C' - C`` new slots and
then overwrite in exactly the order the old ring would have (oldest first,
holes left by deletes included). Items therefore may move to new slot
numbers; their keys do not change, so a ``(slot, key)`` pair handed out
before the save is ignored by ``update_priorities`` / ``delete`` rather than
applied to another item. A host ``Table``'s ragged values and payloads, kept
per item in slot order, move with their items (``item_order``). Other removers
find victims by key or priority order, so their items keep their slot numbers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from funcreplay.core import caches, indexes
from funcreplay.core import selectors as sel
from funcreplay.core import state as state_lib
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState

_COLUMNS = ("occupied", "key", "version", "times_sampled", "priority")


def grow(old: TableSpec, new: TableSpec, state: TableState) -> TableState:
  """An unsharded host (numpy) ``state`` of spec ``old`` moved into ``new`` (larger capacity).

  Args:
    old: the spec ``state`` was saved with (capacity C).
    new: equal to ``old`` except ``capacity`` C' > C.
    state: ``TableState`` of numpy arrays, slot columns ``[C]``.

  Returns:
    ``TableState`` of numpy arrays for ``new`` (slot columns ``[C']``).
  """
  c, c2 = old.capacity, new.capacity
  assert c2 > c, (c, c2)
  fifo = sel.is_ring(old.remover)
  write_pos = int(state.write_pos)
  order = _slot_order(old, state)
  # Columns are overwritten below and the trees rebuilt: zeros are enough.
  fresh = jax.tree_util.tree_map(lambda x: np.zeros(x.shape, x.dtype),
                                 jax.eval_shape(functools.partial(state_lib.init_state, new)))

  def put(fresh_col, col):
    out = np.array(fresh_col, copy=True)
    out[:c] = np.asarray(col)[order]
    return out

  cols = {name: put(getattr(fresh, name), getattr(state, name)) for name in _COLUMNS}
  if new.touch_stamps:  # the heaps' stamps move with their items; the clock stays last
    touched = np.asarray(state.touched)
    cols["touched"] = np.concatenate([put(fresh.touched[:c2], touched[:c]), touched[c:]])
  grown = fresh.replace(
      data=jax.tree_util.tree_map(put, fresh.data, state.data),
      metadata={k: put(fresh.metadata[k], v) for k, v in state.metadata.items()},
      write_pos=np.asarray(c if fifo else write_pos, np.int32),
      next_key=state.next_key, max_priority=state.max_priority,
      limiter_diff=state.limiter_diff, counters=dict(state.counters),
      version_bounds=state.version_bounds, **cols)
  return jax.device_get(_rebuild(new)(jax.tree_util.tree_map(jnp.asarray, grown)))


def _slot_order(old: TableSpec, state: TableState) -> np.ndarray:
  """int[C]: the old slot that ``grow`` puts in each of the first C new slots."""
  c = old.capacity
  if not sel.is_ring(old.remover):
    return np.arange(c)
  return (int(state.write_pos) + np.arange(c)) % c


def item_order(old: TableSpec, state: TableState) -> np.ndarray:
  """int[N]: for each item of ``grow(old, new, state)`` (its occupied slots in slot
  order), its index among ``state``'s items in slot order: how per-item host data kept in
  slot order (a ``Table``'s ragged values and payloads) moves with the items."""
  occ = np.asarray(state.occupied)
  rank = np.cumsum(occ) - 1
  order = _slot_order(old, state)
  return rank[order][occ[order]]


@functools.lru_cache(maxsize=16)
def _rebuild(spec: TableSpec):
  """``indexes.rebuild`` for ``spec``, jitted once per spec (the eager version is slow)."""
  return jax.jit(functools.partial(indexes.rebuild, spec))


caches.register("checkpoint.migrate.rebuild", _rebuild.cache_clear)


def grow_sharded(old: TableSpec, new: TableSpec, state: TableState, num_shards: int) -> TableState:
  """``grow`` applied to each shard of a host sharded state (leaves ``[S, ...]``).

  ``old`` / ``new`` are the global specs; each shard grows from
  ``old.capacity // S`` to ``new.capacity // S`` slots.
  """
  lo = old.replace(capacity=old.capacity // num_shards)
  hi = new.replace(capacity=new.capacity // num_shards)
  shards = [grow(lo, hi, jax.tree_util.tree_map(lambda x, s=s: np.asarray(x)[s], state))
            for s in range(num_shards)]
  return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *shards)
