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
import numpy as np
from jax import lax

from funcreplay import counters as ctr
from funcreplay import signature as sig_lib
from funcreplay import staleness
from funcreplay.spec import TableSpec

COUNTERS = (
    "inserts",            # items inserted (mask=True rows)
    "samples",            # valid rows handed out by sample
    "deletes",            # items removed by delete()
    "evicted_capacity",   # items overwritten/removed by the remover
    "evicted_stale",      # items removed by evict_stale()
    "evicted_reuse",      # items removed on reaching max_times_sampled
    "removed_reuse_sum",  # sum of times_sampled over every removed item
    "sampled_staleness_sum",  # sum of (version - item version) over sampled rows
    "invalid_priorities",  # negative / NaN / inf priorities clamped to 0
)


# The ledger: the table's scalars and counters packed into one uint32 array.
# Words 0-3 hold the bit patterns of ``LEDGER_SCALARS`` (each in the dtype
# given below); then each of ``COUNTERS`` takes two words ``[hi, lo]``.
LEDGER_SCALARS = (
    ("write_pos", jnp.int32),
    ("next_key", jnp.uint32),
    ("max_priority", jnp.float32),
    ("limiter_diff", jnp.int32),
)
LEDGER_FIELDS = tuple(name for name, _ in LEDGER_SCALARS) + ("counters",)
_SLOTS = {name: i for i, (name, _) in enumerate(LEDGER_SCALARS)}
_COUNTER_SLOTS = {name: len(LEDGER_SCALARS) + 2 * i for i, name in enumerate(COUNTERS)}
LEDGER_SIZE = len(LEDGER_SCALARS) + 2 * len(COUNTERS)


def _is_host(x) -> bool:
  return isinstance(x, (np.ndarray, np.generic, int, float))


def _checked(ledger):
  if np.shape(ledger)[-1:] != (LEDGER_SIZE,):
    raise ValueError(f"state.ledger has shape {list(np.shape(ledger))}; a TableState's ledger "
                     f"holds {LEDGER_SIZE} uint32 words on its last axis (see "
                     "funcreplay.state.LEDGER_FIELDS).")
  return ledger


def _ledger_word(ledger, i: int, dtype):
  """Word ``i`` of ``ledger`` (any leading dims) reinterpreted as ``dtype``."""
  word = _checked(ledger)[..., i]
  if isinstance(ledger, np.ndarray):
    return np.asarray(word).view(np.dtype(dtype))
  return lax.bitcast_convert_type(word, dtype)


def _as_word(x, dtype):
  """``x`` converted to ``dtype``, its bits as uint32 (same leading dims)."""
  if _is_host(x):
    return np.asarray(np.asarray(x).astype(np.dtype(dtype))).view(np.uint32)
  return lax.bitcast_convert_type(jnp.asarray(x).astype(dtype), jnp.uint32)


def pack_ledger(*, write_pos, next_key, max_priority, limiter_diff, counters):
  """The ``ledger`` (uint32[..., LEDGER_SIZE]) holding these scalars and counters.

  Numpy in, numpy out (host states stay on the host); anything else gives a
  ``jax.Array``. Leading dims (a sharded or vmapped state) broadcast.
  """
  if set(counters) != set(COUNTERS):
    raise ValueError(f"counters must hold exactly {list(COUNTERS)}; missing "
                     f"{sorted(set(COUNTERS) - set(counters))}, unexpected "
                     f"{sorted(set(counters) - set(COUNTERS))}.")
  scalars = dict(write_pos=write_pos, next_key=next_key, max_priority=max_priority,
                 limiter_diff=limiter_diff)
  words = [_as_word(scalars[name], dtype)[..., None] for name, dtype in LEDGER_SCALARS]
  words += [_as_word(counters[name], jnp.uint32) for name in COUNTERS]
  xp = np if all(isinstance(w, np.ndarray) for w in words) else jnp
  lead = np.broadcast_shapes(*(np.shape(w)[:-1] for w in words))
  return xp.concatenate([xp.broadcast_to(w, lead + np.shape(w)[-1:]) for w in words], axis=-1)


def ledger_words() -> tuple:
  """First word of each ledger entry: the scalars in ``LEDGER_SCALARS`` order, then
  the counters in ``COUNTERS`` order (the native kernels' ``LedgerEntry``)."""
  return tuple(_SLOTS[name] for name, _ in LEDGER_SCALARS) + tuple(
      _COUNTER_SLOTS[name] for name in COUNTERS)


def ledger_fields(state) -> Dict[str, Any]:
  """The ledger's contents by name: ``pack_ledger(**ledger_fields(state))``."""
  return {name: getattr(state, name) for name in LEDGER_FIELDS}


def _register(cls):
  fields = [f.name for f in dataclasses.fields(cls)]
  return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_register
@dataclasses.dataclass(frozen=True)
class TableState:
  """The whole table as a pytree of preallocated arrays (C = capacity, P = tree size).

  Attributes:
    data: the item pytree with a leading ``[C]`` axis on every leaf.
    occupied: bool[C].
    key: uint32[C], the item's unique id (its insertion index modulo 2**32).
    version: int32[C], the policy version that produced the item.
    times_sampled: int32[C].
    priority: float32[C] (used by prioritized and heap selectors).
    metadata: dict name -> int32[C] user columns.
    occ_tree: int32[2P] occupancy count tree (size = ``occ_tree[1]``); its
      otherwise unused node 0 counts the occupied items of zero sampling
      weight under a ``Prioritized`` sampler (not eligible; 0 otherwise).
    weight_tree: float32[2P] tree of ``priority**alpha`` (prioritized
      sampler only; shape [0] otherwise).
    remover_tree: int32[2P] arg-best tree of the next victim (Lifo / heap
      removers only; shape [0] otherwise).
    version_hist: int32[V] histogram of the newest versions, and
    version_bounds: int32[3] ``[newest version, older items, their lowest
      version]``: the index that counts fresh items without an O(C) pass
      (``funcreplay.staleness``; shape [0] without ``max_staleness``).
    ledger: uint32[L] the table's scalars and counters in one array (see
      ``LEDGER_FIELDS``), read through the properties ``write_pos``,
      ``next_key``, ``max_priority``, ``limiter_diff`` and ``counters`` and
      written through ``replace(write_pos=..., counters=...)``. One leaf
      instead of thirteen: every jitted call pays about 1 us of dispatch per
      donated leaf (BUILD.md, "The ledger").
  """

  data: Any
  occupied: jnp.ndarray
  key: jnp.ndarray
  version: jnp.ndarray
  times_sampled: jnp.ndarray
  priority: jnp.ndarray
  metadata: Dict[str, jnp.ndarray]
  occ_tree: jnp.ndarray
  weight_tree: jnp.ndarray
  remover_tree: jnp.ndarray
  version_hist: jnp.ndarray
  version_bounds: jnp.ndarray
  ledger: jnp.ndarray

  def replace(self, **changes) -> "TableState":
    """A copy with ``changes``; ``LEDGER_FIELDS`` are repacked into ``ledger``."""
    packed = {name: changes.pop(name) for name in LEDGER_FIELDS if name in changes}
    if packed:
      if "ledger" in changes:
        raise TypeError(f"replace: pass either ledger or {sorted(packed)}, not both.")
      changes["ledger"] = pack_ledger(**{**ledger_fields(self), **packed})
    return dataclasses.replace(self, **changes)

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


@_register
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


@_register
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
      data=sig_lib.zeros(spec.signature, (c,)),
      occupied=jnp.zeros((c,), bool),
      key=jnp.zeros((c,), jnp.uint32),
      version=jnp.zeros((c,), jnp.int32),
      times_sampled=jnp.zeros((c,), jnp.int32),
      priority=jnp.zeros((c,), jnp.float32),
      metadata={name: jnp.zeros((c,), jnp.int32) for name in spec.metadata},
      occ_tree=jnp.zeros((2 * p,), jnp.int32),
      weight_tree=jnp.zeros((2 * p if spec.prioritized else 0,), jnp.float32),
      remover_tree=jnp.full((2 * p if spec.needs_remover_tree else 0,), -1, jnp.int32),
      version_hist=version_hist,
      version_bounds=version_bounds,
      ledger=pack_ledger(write_pos=jnp.zeros((), jnp.int32), next_key=jnp.zeros((), jnp.uint32),
                         max_priority=jnp.ones((), jnp.float32),
                         limiter_diff=jnp.zeros((), jnp.int32), counters=empty_counters()),
  )
  return state


@_register
@dataclasses.dataclass(frozen=True)
class StateRecord:
  """A ``TableState`` with the ledger unpacked: every scalar and counter its own leaf.

  The checkpoint format stores this layout (one named array per leaf:
  ``.write_pos``, ``.counters['inserts']``, ...), so checkpoints do not
  depend on how the ledger packs its words. Fields as in ``TableState``;
  ``write_pos``, ``next_key``, ``max_priority``, ``limiter_diff`` and
  ``counters`` as its properties describe.
  """

  data: Any
  occupied: Any
  key: Any
  version: Any
  times_sampled: Any
  priority: Any
  metadata: Dict[str, Any]
  occ_tree: Any
  weight_tree: Any
  remover_tree: Any
  version_hist: Any
  version_bounds: Any
  write_pos: Any
  next_key: Any
  max_priority: Any
  limiter_diff: Any
  counters: Dict[str, Any]


_COLUMN_FIELDS = tuple(f.name for f in dataclasses.fields(TableState) if f.name != "ledger")


def to_record(state: TableState) -> StateRecord:
  """``state`` with its ledger unpacked (numpy in, numpy out)."""
  return StateRecord(**{name: getattr(state, name) for name in _COLUMN_FIELDS},
                     **ledger_fields(state))


def from_record(record: StateRecord) -> TableState:
  """The ``TableState`` of a ``StateRecord`` (the inverse of ``to_record``)."""
  return TableState(**{name: getattr(record, name) for name in _COLUMN_FIELDS},
                    ledger=pack_ledger(**{name: getattr(record, name) for name in LEDGER_FIELDS}))

