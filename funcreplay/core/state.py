"""``TableState`` (the buffer as a value) and the ``Sample`` it hands out.

Both are frozen dataclasses registered as pytrees: they flow through
``jax.jit``, ``lax.scan`` and ``vmap`` and can be donated. Static
configuration is *not* stored here; it lives in the ``TableSpec``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

import jax
import jax.numpy as jnp

from funcreplay.core import counters as ctr
from funcreplay.core import item_info as info_words
from funcreplay.core import position_index, staleness, storage
from funcreplay.core.ledger import COUNTER_SLOTS as _COUNTER_SLOTS
from funcreplay.core.ledger import COUNTERS, LEDGER_FIELDS, ledger_fields, pack_ledger
from funcreplay.core.ledger import SLOTS as _SLOTS
from funcreplay.core.ledger import checked as _checked
from funcreplay.core.ledger import ledger_word as _ledger_word
from funcreplay.core.spec import TableSpec


def register_dataclass(cls):
  """Register a frozen dataclass as a pytree whose every field is a leaf (no static fields)."""
  fields = [f.name for f in dataclasses.fields(cls)]
  return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@register_dataclass
@dataclasses.dataclass(frozen=True)
class TableState:
  """The whole table as a pytree of preallocated arrays (C = capacity, P = tree size).

  Attributes:
    data: the items as ``spec.storage`` lays them out: ``uint32[C, R]`` packed rows
      (``"rows"``) or the item pytree with a leading ``[C]`` axis on every leaf
      (``"columns"``); ``funcreplay.core.storage``.
    occupied: bool[C].
    item_info: uint32[C, 4], each slot's key, version, times sampled and
      priority (its float32 bits), read through the properties ``key``
      (uint32[C], the item's unique id: its insertion index modulo 2**32),
      ``version`` (int32[C], the policy version that produced it),
      ``times_sampled`` (int32[C]) and ``priority`` (float32[C], used by
      prioritized and heap selectors). One row per slot, so an insert writes
      the four with one update and a sample reads them with one gather
      (``funcreplay.core.item_info``).
    metadata: dict name -> int32[C] user columns.
    occ_tree: int32[2P] occupancy count tree (size = ``occ_tree[1]``); its
      otherwise unused node 0 counts the occupied items of zero sampling
      weight under a ``Prioritized`` sampler (not eligible; 0 otherwise).
    weight_tree: float32[2P] tree of ``priority**alpha`` (prioritized
      sampler only; shape [0] otherwise).
    remover_tree: int32[2P] arg-best tree of the next victim (Lifo / heap
      removers only; shape [0] otherwise).
    touched: uint32[C + 1] (``spec.touch_stamps``: a heap sampler or remover;
      shape [0] otherwise): ``touched[C]`` is a clock advanced by every
      inserted row and every priority update, ``touched[s]`` its value at the
      last insert or priority update of the item in slot ``s``. Heap
      selectors break priority ties by this stamp's age (least recently
      inserted or updated first, as Reverb), wrap-safe like keys
      (``core.ordering.touch_age``).
    version_hist: int32[V] histogram of the newest versions, and
    version_bounds: int32[3] ``[newest version, older items, their lowest
      version]``: the index that counts fresh items without an O(C) pass
      (``funcreplay.core.staleness``; shape [0] without ``max_staleness``).
    position_index: int32[2, C + 1] (``spec.position_index``; int32[2, 0] otherwise):
      ``[0, :C]`` the occupied slots by position (the first ``size`` entries),
      ``[1, :C]`` each slot's position (-1 when free), ``[0, C]`` their count: the
      uniform sample's O(1) map from a position to a slot
      (``funcreplay.core.position_index``).
    ledger: uint32[L] the table's scalars and counters in one array (see
      ``LEDGER_FIELDS``), read through the properties ``write_pos``,
      ``next_key``, ``max_priority``, ``limiter_diff`` and ``counters`` and
      written through ``replace(write_pos=..., counters=...)``. One leaf
      instead of thirteen: every jitted call pays about 1 us of dispatch per
      donated leaf (BUILD.md, "The ledger").
  """

  data: Any
  occupied: jnp.ndarray
  item_info: jnp.ndarray
  metadata: Dict[str, jnp.ndarray]
  occ_tree: jnp.ndarray
  weight_tree: jnp.ndarray
  remover_tree: jnp.ndarray
  touched: jnp.ndarray
  version_hist: jnp.ndarray
  version_bounds: jnp.ndarray
  position_index: jnp.ndarray
  ledger: jnp.ndarray

  def replace(self, **changes) -> "TableState":
    """A copy with ``changes``; ``LEDGER_FIELDS`` are repacked into ``ledger``, and
    whole columns of ``item_info.FIELDS`` into ``item_info`` (O(C) each: the
    operations write B rows with ``item_info.put`` / ``put_field`` instead)."""
    packed = {name: changes.pop(name) for name in LEDGER_FIELDS if name in changes}
    if packed:
      if "ledger" in changes:
        raise TypeError(f"replace: pass either ledger or {sorted(packed)}, not both.")
      changes["ledger"] = pack_ledger(**{**ledger_fields(self), **packed})
    columns = {name: changes.pop(name) for name in info_words.FIELDS if name in changes}
    if columns:
      if "item_info" in changes:
        raise TypeError(f"replace: pass either item_info or {sorted(columns)}, not both.")
      words = self.item_info
      for name, values in columns.items():
        words = info_words.set_column(words, name, values)
      changes["item_info"] = words
    return dataclasses.replace(self, **changes)

  @property
  def key(self):
    """uint32[C] each slot's item key (its insertion index modulo 2**32)."""
    return info_words.column(self.item_info, "key")

  @property
  def version(self):
    """int32[C] the policy version that produced each slot's item."""
    return info_words.column(self.item_info, "version")

  @property
  def times_sampled(self):
    """int32[C] how often each slot's item was sampled."""
    return info_words.column(self.item_info, "times_sampled")

  @property
  def priority(self):
    """float32[C] each slot's priority."""
    return info_words.column(self.item_info, "priority")

  @property
  def write_pos(self):
    """int32[] ring position of the Fifo remover."""
    return _ledger_word(self.ledger, _SLOTS["write_pos"], jnp.int32)

  @property
  def next_key(self):
    """uint32[] key of the next inserted item."""
    return _ledger_word(self.ledger, _SLOTS["next_key"], jnp.uint32)

  @property
  def max_priority(self):
    """float32[] largest priority ever set (the default priority)."""
    return _ledger_word(self.ledger, _SLOTS["max_priority"], jnp.float32)

  @property
  def limiter_diff(self):
    """int32[] ``p * inserts - q * samples`` for the rate limiter."""
    return _ledger_word(self.ledger, _SLOTS["limiter_diff"], jnp.int32)

  @property
  def counters(self) -> Dict[str, jnp.ndarray]:
    """name -> uint32[2] two-word counter (see ``COUNTERS``)."""
    lg = _checked(self.ledger)
    return {name: lg[..., i:i + 2] for name, i in _COUNTER_SLOTS.items()}

  @property
  def size(self) -> jnp.ndarray:
    """Number of occupied slots, int32[]."""
    return self.occ_tree[1]


@register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleInfo:
  """Per-row metadata of a sample (B = batch size). Invalid rows hold slot -1.

  Attributes:
    slot: int32[B] slot the row came from.
    key: uint32[B] the item's key (pass it back to update_priorities/delete).
    probability: float32[B] probability that a single draw from the eligible
      items picks this item (Reverb's ``SampleInfo.probability``).
    priority: float32[B] the item's priority when sampled.
    times_sampled: int32[B] times sampled, this sample included.
    version: int32[B] policy version that produced the item.
  """

  slot: jnp.ndarray
  key: jnp.ndarray
  probability: jnp.ndarray
  priority: jnp.ndarray
  times_sampled: jnp.ndarray
  version: jnp.ndarray


@register_dataclass
@dataclasses.dataclass(frozen=True)
class Sample:
  """A batch from ``sample``.

  Attributes:
    data: item pytree with leading ``[B]`` axis; rows with ``valid=False``
      are zeros and must be ignored.
    valid: bool[B]; False where fewer than B eligible items existed.
    info: ``SampleInfo``.
    num_eligible: int32[] eligible items when sampled (N in importance weights;
      under a ``Prioritized`` sampler only items with priority > 0 count).
  """

  data: Any
  valid: jnp.ndarray
  info: SampleInfo
  num_eligible: jnp.ndarray


def state_counters():
  """Names of the table counters kept in ``TableState.counters``."""
  return COUNTERS


def empty_counters() -> Dict[str, jnp.ndarray]:
  return {name: ctr.zero() for name in COUNTERS}


def init_state(spec: TableSpec) -> TableState:
  """A fresh, empty ``TableState`` for ``spec`` (every buffer preallocated)."""
  c, p = spec.capacity, spec.tree_size
  version_hist, version_bounds = staleness.empty(spec)
  state = TableState(
      data=storage.empty(spec.signature, spec.packed_rows, (c,)),
      occupied=jnp.zeros((c,), bool),
      item_info=info_words.empty(c),
      metadata={name: jnp.zeros((c,), jnp.int32) for name in spec.metadata},
      occ_tree=jnp.zeros((2 * p,), jnp.int32),
      weight_tree=jnp.zeros((2 * p if spec.prioritized else 0,), jnp.float32),
      remover_tree=jnp.full((2 * p if spec.needs_remover_tree else 0,), -1, jnp.int32),
      touched=jnp.zeros((c + 1 if spec.touch_stamps else 0,), jnp.uint32),
      version_hist=version_hist,
      version_bounds=version_bounds,
      position_index=position_index.empty(spec),
      ledger=pack_ledger(write_pos=jnp.zeros((), jnp.int32), next_key=jnp.zeros((), jnp.uint32),
                         max_priority=jnp.ones((), jnp.float32),
                         limiter_diff=jnp.zeros((), jnp.int32), counters=empty_counters()),
  )
  return state


