"""``TableSpec``: the static, hashable configuration of one table.

Nothing in here lives in the state pytree: a spec is closed over by the pure
functions that ``make_table`` builds (optax style), so changing it means
building new functions, never silently re-interpreting a state.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple

import jax

from funcreplay.core import rate_limiters as rl
from funcreplay.core import selectors as sel
from funcreplay.core import storage as storage_lib
from funcreplay.core.columns import LENGTH_DTYPE, Column, Ragged
from funcreplay.core.signature import Signature, as_signature

_RESERVED_COLUMNS = ("key", "version", "times_sampled", "priority", "occupied", "slot")


@dataclasses.dataclass(frozen=True, init=False)
class TableSpec:
  """Static description of a replay table.

  Attributes:
    capacity: number of slots ``C`` (1 <= C < 2**30).
    signature: one item, as a ``Signature`` (built from a pytree of
      ``jax.ShapeDtypeStruct`` or from an example item).
    sampler: a selector from ``funcreplay.core.selectors`` (default ``Uniform()``).
    remover: which item makes room when the table is full (default ``Fifo()``).
    max_times_sampled: an item is removed after this many samples (0: never).
    max_staleness: items with ``current_version - item_version >
      max_staleness`` are not sampled (None: no staleness limit).
    rate_limiter: a ``funcreplay.core.rate_limiters.RateLimiter`` (default
      ``MinSize(1)``); pure predicates ``can_insert``/``can_sample`` use it and
      the host ``Table`` blocks on it.
    metadata: names of user int32 columns per slot (e.g. ``("task", "status")``); a
      ``Column`` instead of a name declares a vocabulary or a float32 column
      (``funcreplay.core.columns``). ``metadata`` holds the names, ``columns`` the
      ``Column`` of every name (plain names: ``Column(name)``).
    ragged: ``(leaf index, Ragged)`` for every ``Ragged`` leaf of the signature given
      (in ``signature``, such a leaf is its int32 length; the host ``Table`` keeps the
      values). Empty without ragged leaves.
    default_priority: priority of items inserted without one; None means the
      largest priority seen so far (1.0 on a fresh table), as in PER.
    storage: how ``state.data`` holds the items: ``"rows"`` (every leaf of an item
      packed into one row of uint32 words: one write per insert, one gather per
      sample) or ``"columns"`` (one array per leaf). The constructor's None picks
      ``"rows"`` when every leaf is 4 bytes wide and there are two or more, else
      ``"columns"`` (``funcreplay.core.storage``). A layout only: batches and
      checkpoints are the same either way.
    holes: whether an item may leave the table other than from its oldest end: the
      ``Fifo`` ring overwriting it, or (Reverb's queue, ``fr.queue(..., holes=False)``)
      an unmasked sample of the ``Fifo`` sampler using it up (``max_times_sampled``).
      ``False`` is a static promise that nothing else removes an item (``delete``,
      ``evict_stale``, a grouped take, a remover other than the ring; with a reuse limit,
      any masked sample, which could use up an item that is not the oldest), so the
      stored items are always the last ``size`` slots written, in ring order; the
      uniform sample then maps a position to its slot, and the Fifo /
      Lifo sample its ``i``-th item, by ring arithmetic instead of descending the
      occupancy tree (BUILD.md findings 23 and 30: ~30% of an in-scan uniform step).
      Needs the ``Fifo()`` ring remover, and ``max_times_sampled`` only with the
      ``Fifo()`` sampler and no ``max_staleness`` (a Fifo sample uses items up oldest
      first: reuse counts never grow from the oldest item to the newest); ``delete``,
      ``evict_stale`` and those removals raise when traced, and a checkpoint restores
      into such a spec only if its items are a ring window (with those counts). Default
      ``True`` (every operation allowed). A flashbax buffer is a table of this kind.
    position_index: keep ``TableState.position_index`` (int32[2, C + 1], 8 bytes a slot), an
      O(1) map from a position among the stored items to its slot, so that the uniform
      sample finds its slots with one gather instead of descending the occupancy tree
      in a table that may have holes (``funcreplay.core.position_index``; BUILD.md
      finding 36). Needs the ``Uniform()`` sampler and ``holes=True`` (without holes
      the ring arithmetic is O(1) already). Its inserts write two more words a row,
      its removals swap the last items into the holes; the native CPU kernels keep it
      too. Default False.
  """

  capacity: int
  signature: Signature
  sampler: Any
  remover: Any
  max_times_sampled: int
  max_staleness: Optional[int]
  rate_limiter: rl.RateLimiter
  metadata: Tuple[str, ...]
  default_priority: Optional[float]
  columns: Tuple[Column, ...]
  ragged: Tuple[Tuple[int, Ragged], ...]
  storage: str
  holes: bool
  position_index: bool

  def __init__(self, capacity: int, signature: Any, sampler: Any = None, remover: Any = None,
               max_times_sampled: int = 0, max_staleness: Optional[int] = None,
               rate_limiter: Optional[rl.RateLimiter] = None, metadata=(),
               default_priority: Optional[float] = None, storage: Optional[str] = None,
               holes: bool = True, position_index: bool = False):
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity < 2**30:
      raise ValueError(f"TableSpec.capacity must be an int in [1, 2**30), got {capacity!r}.")
    sampler = sel.Uniform() if sampler is None else sampler
    remover = sel.Fifo() if remover is None else remover
    if not isinstance(sampler, sel.SAMPLERS):
      raise TypeError(
          f"TableSpec.sampler must be one of {[c.__name__ for c in sel.SAMPLERS]} "
          f"(an instance, e.g. fr.Uniform()), got {sampler!r}.")
    if not isinstance(remover, sel.REMOVERS):
      raise TypeError(
          f"TableSpec.remover must be one of {[c.__name__ for c in sel.REMOVERS]} "
          f"(an instance, e.g. fr.Fifo()), got {remover!r}.")
    if isinstance(max_times_sampled, bool) or not isinstance(max_times_sampled, int) \
        or max_times_sampled < 0:
      raise ValueError(f"TableSpec.max_times_sampled must be an int >= 0 (0 = unlimited), "
                       f"got {max_times_sampled!r}.")
    if max_staleness is not None and (isinstance(max_staleness, bool)
                                      or not isinstance(max_staleness, int) or max_staleness < 0):
      raise ValueError("TableSpec.max_staleness must be None or an int >= 0, "
                       f"got {max_staleness!r}.")
    rate_limiter = rl.MinSize(1) if rate_limiter is None else rate_limiter
    if not isinstance(rate_limiter, rl.RateLimiter):
      raise TypeError(f"TableSpec.rate_limiter must be a RateLimiter (e.g. fr.MinSize(1)), "
                      f"got {rate_limiter!r}.")
    if isinstance(metadata, (str, Column)):
      metadata = (metadata,)
    given = tuple(metadata)
    metadata = tuple(c.name if isinstance(c, Column) else c for c in given)
    for name in metadata:
      if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"TableSpec.metadata: column names must be identifiers, got {name!r}.")
      if name in _RESERVED_COLUMNS:
        raise ValueError(f"TableSpec.metadata: {name!r} is a built-in column; pick another name.")
    if len(set(metadata)) != len(metadata):
      raise ValueError(f"TableSpec.metadata has duplicate column names: {metadata}.")
    columns = tuple(c if isinstance(c, Column) else Column(c) for c in given)
    if default_priority is not None and (not math.isfinite(default_priority)
                                         or default_priority < 0):
      raise ValueError(f"TableSpec.default_priority must be None or finite >= 0, "
                       f"got {default_priority!r}.")
    if not isinstance(holes, bool):
      raise TypeError(f"TableSpec.holes must be a bool, got {holes!r}.")
    if not holes and not sel.is_ring(remover):
      raise ValueError(f"TableSpec(holes=False) needs the Fifo() ring remover (a table without "
                       f"holes loses items only to the ring), got remover={remover!r}.")
    if not holes and max_times_sampled and not (type(sampler) is sel.Fifo
                                                and max_staleness is None):
      raise ValueError(
          "TableSpec(holes=False) can have max_times_sampled only with the Fifo() sampler and "
          "no max_staleness (its unmasked samples use items up oldest first, so the items "
          "stay the last ones written; any other sampler's used-up item leaves a hole), got "
          f"sampler={sampler!r}, max_staleness={max_staleness!r}, "
          f"max_times_sampled={max_times_sampled}.")
    if not isinstance(position_index, bool):
      raise TypeError(f"TableSpec.position_index must be a bool, got {position_index!r}.")
    if position_index and not (isinstance(sampler, sel.Uniform) and holes):
      raise ValueError(
          "TableSpec(position_index=True) serves the Uniform() sampler of a table with holes "
          f"(holes=True); got sampler={sampler!r}, holes={holes} (a table without holes "
          "maps positions to slots by ring arithmetic already).")
    signature, ragged = _split_ragged(signature)
    sig = as_signature(signature)
    storage = storage_lib.resolve(sig, storage, bool(ragged))
    for k, v in dict(capacity=capacity, signature=sig, sampler=sampler, remover=remover,
                     max_times_sampled=max_times_sampled, max_staleness=max_staleness,
                     rate_limiter=rate_limiter, metadata=metadata,
                     default_priority=None if default_priority is None else float(default_priority),
                     columns=columns, ragged=ragged, storage=storage, holes=holes,
                     position_index=position_index).items():
      object.__setattr__(self, k, v)

  def replace(self, **changes) -> "TableSpec":
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    fields.update(signature=self.item_tree if self.ragged else self.signature,
                  metadata=self.columns)
    del fields["columns"], fields["ragged"]
    if "signature" in changes and "storage" not in changes \
        and self.storage == storage_lib.resolve(self.signature, None, bool(self.ragged)):
      fields["storage"] = None  # picked for the old signature: pick again for the new one
    fields.update(changes)
    return TableSpec(**fields)

  def column(self, name: str) -> Column:
    """The ``Column`` declared as ``name`` (ValueError naming the declared ones)."""
    i = self.metadata.index(name) if name in self.metadata else -1
    if i >= 0:
      return self.columns[i]
    raise ValueError(f"unknown metadata column {name!r}; the spec declares {list(self.metadata)}.")

  @property
  def item_tree(self):
    """The signature as given: ``signature.tree`` with the ``Ragged`` leaves put back."""
    leaves = list(self.signature.leaves)
    for i, r in self.ragged:
      leaves[i] = r
    return jax.tree_util.tree_unflatten(self.signature.treedef, leaves)

  @property
  def tree_size(self) -> int:
    """Number of leaves ``P`` of the device trees (next power of two >= capacity)."""
    return 1 << max(0, (self.capacity - 1).bit_length())

  @property
  def needs_remover_tree(self) -> bool:
    return (isinstance(self.remover, (sel.Lifo, sel.MinHeap, sel.MaxHeap))
            or (isinstance(self.remover, sel.Fifo) and self.remover.fill_holes))

  @property
  def touch_stamps(self) -> bool:
    """True when the state keeps ``TableState.touched`` (a ``MinHeap`` / ``MaxHeap``
    sampler or remover: Reverb breaks their ties by the least recent insert or
    priority update)."""
    heaps = (sel.MinHeap, sel.MaxHeap)
    return isinstance(self.sampler, heaps) or isinstance(self.remover, heaps)

  @property
  def packed_rows(self) -> bool:
    """True when ``state.data`` is one ``uint32[C, R]`` array of packed rows (static)."""
    return self.storage == "rows"

  @property
  def prioritized(self) -> bool:
    return isinstance(self.sampler, sel.Prioritized)


def _split_ragged(signature):
  """``(signature with every Ragged leaf replaced by its int32 length, ((index, Ragged), ...))``."""
  if isinstance(signature, Signature):
    return signature, ()
  leaves, treedef = jax.tree_util.tree_flatten(signature,
                                               is_leaf=lambda x: isinstance(x, Ragged))
  ragged = tuple((i, x) for i, x in enumerate(leaves) if isinstance(x, Ragged))
  if not ragged:
    return signature, ()
  dense = [jax.ShapeDtypeStruct((), LENGTH_DTYPE) if isinstance(x, Ragged) else x
           for x in leaves]
  return jax.tree_util.tree_unflatten(treedef, dense), ragged


def queue(capacity: int, signature: Any, **kwargs) -> TableSpec:
  """Reverb's ``Table.queue``: FIFO sampler/remover, each item sampled once.

  ``holes=False`` (passed through ``kwargs``) promises that items leave only by being
  taken oldest first or overwritten: no ``delete``, no masked sample. Its sample then
  finds the oldest items by ring arithmetic instead of the occupancy tree (~20% faster a
  step on the CPU, 19 GPU kernels instead of 23; ``TableSpec.holes``)."""
  return TableSpec(capacity, signature, sampler=sel.Fifo(), remover=sel.Fifo(),
                   max_times_sampled=1, rate_limiter=rl.Queue(capacity), **kwargs)


def stack(capacity: int, signature: Any, **kwargs) -> TableSpec:
  """Reverb's ``Table.stack``: LIFO sampler/remover, each item sampled once."""
  return TableSpec(capacity, signature, sampler=sel.Lifo(), remover=sel.Lifo(),
                   max_times_sampled=1, rate_limiter=rl.Stack(capacity), **kwargs)
