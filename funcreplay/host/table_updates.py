"""Keyed updates, removals and queries on the host ``Table``.

``UpdatesMixin`` is a mixin of ``Table`` (``funcreplay.host.table``):
``update_priorities``, ``delete``, ``set_metadata``, ``evict_stale``,
``count``, ``stats``, the snapshots a checkpoint takes, and the validation
of slots / keys / ``where`` they share.
"""

from __future__ import annotations

import functools
from typing import Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from funcreplay.core import ops
from funcreplay.core.state import TableState
from funcreplay.host.rollout import columns as col_lib
from funcreplay.host.validation import Where
from funcreplay.host.validation import as_array as _as_array
from funcreplay.host.validation import bucket as _bucket
from funcreplay.host.validation import check_int as _check_int
from funcreplay.host.validation import has_denormal as _has_denormal
from funcreplay.host.validation import int_rows as _int_rows
from funcreplay.host.validation import pad as _pad
from funcreplay.host.validation import priority_rows as _priority_rows


class UpdatesMixin:
  """``Table``'s keyed updates, removals and queries."""

  # -- other mutations --------------------------------------------------------------
  def update_priorities(self, slots, keys, priorities) -> None:
    """Set priorities of items still in ``slots`` with ``keys`` (others are ignored).

    Args:
      slots: int[K] slots (e.g. ``sample.info.slot``; -1 rows, the invalid
        rows of a sample, are ignored).
      keys: int[K] item keys (``sample.info.key``), in [0, 2**32).
      priorities: float[K] or a scalar, finite and >= 0 (checked on rows
        with slot >= 0). Duplicate slots: the last one wins.

    Accepts numpy, JAX, or anything with ``__array__``. A table that samples
    in place (``samples_in_place``) updates in place too, with the same
    kernel and without a jitted call (unless a priority is denormal, or the
    sampler's exponent is 0.5 or a whole number >= 2), and synchronously: it first
    waits for the table's pending jitted work.
    """
    self._check_open("update_priorities")
    s, k = self._slots_keys(slots, keys, "Table.update_priorities")
    if s is None:
      return
    p = _priority_rows(priorities, len(s), "Table.update_priorities priorities", check=s >= 0)
    with self._cond:
      direct = self._direct_sampler()
      # In place, like a direct sample (funcreplay.host.direct); a denormal priority
      # goes through XLA, whose treatment of one the direct path does not reproduce.
      if direct is not None and not _has_denormal(p, s >= 0):
        self._check_open("update_priorities")
        self._settle(direct)
        direct.update_priorities(s, k, p)
        self._cond.notify_all()
        return
    n = _bucket(len(s), 2**30)
    s, k, p = _pad(s, n, -1), _pad(k, n, 0), _pad(p, n, 0.0)
    self._mutate("update_priorities", self._ops.update_priorities, s, k, p)

  def delete(self, slots, keys) -> None:
    """Remove the items at ``slots`` that still hold ``keys`` (int[K] each; -1 slots ignored)."""
    self._check_open("delete")
    ops.require_holes(self.spec, "Table.delete")
    s, k = self._slots_keys(slots, keys, "Table.delete")
    if s is None:
      return
    n = _bucket(len(s), 2**30)
    self._mutate("delete", self._ops.delete, _pad(s, n, -1), _pad(k, n, 0))

  def set_metadata(self, slots, keys, column: str, values) -> None:
    """Set metadata ``column`` (int or int[K]) of items still at ``slots`` with ``keys``."""
    self._check_open("set_metadata")
    if not isinstance(column, str) or column not in self.spec.metadata:
      raise ValueError(f"Table.set_metadata: unknown column {column!r}; the spec declares "
                       f"{list(self.spec.metadata)}.")
    s, k = self._slots_keys(slots, keys, "Table.set_metadata")
    if s is None:
      return
    v = col_lib.rows(self.spec.column(column), values, len(s),
                     f"Table.set_metadata values[{column!r}]")
    n = _bucket(len(s), 2**30)
    fn = functools.partial(self._ops.set_metadata, column=column)
    self._mutate("set_metadata", fn, _pad(s, n, -1), _pad(k, n, 0), _pad(v, n))

  def evict_stale(self, version: Optional[int] = None, *, receipt: bool = False):
    """Free every item too stale for ``version`` (default ``self.version``); returns how
    many, or with ``receipt=True`` a ``Receipt`` (keys, slots, versions, metadata and
    payloads of the removed items, e.g. to re-queue their prompts)."""
    self._check_open("evict_stale")
    if self.spec.max_staleness is None:
      raise ValueError("Table.evict_stale: the table has no max_staleness; set "
                       "TableSpec.max_staleness.")
    ops.require_holes(self.spec, "Table.evict_stale")
    v = np.int32(_check_int(self._version if version is None else version,
                            "Table.evict_stale version"))
    with self._cond:
      self._check_open("evict_stale")
      got = self._stale_receipt(v) if receipt else None  # read before the items go
      self._state, n = self._ops.evict_stale(self._state, v)
      if self._sidecars is not None:
        self._sidecars.sync(self._state)
      self._cond.notify_all()
      return got if receipt else int(n)

  # -- queries --------------------------------------------------------------------
  def count(self, where: Where = None, version: Optional[int] = None) -> int:
    """Number of eligible items at ``version`` (default ``self.version``) matching ``where``."""
    self._check_open("count")
    v = np.int32(_check_int(self._version if version is None else version, "Table.count version"))
    mask, cols = self._where(where, "Table.count")
    with self._cond:
      self._check_open("count")
      return int(self._ops.count(self._state, v, mask, cols))

  def stats(self) -> "ops.Stats":
    """``fr.Stats`` of fresh arrays (``.to_dict()`` gives Python numbers)."""
    with self._cond:
      self._check_open("stats")
      return self._reading(self._ops.stats(self._state))

  def snapshot(self) -> TableState:
    """A consistent copy of the state, taken under the lock (for checkpoints)."""
    with self._cond:
      self._check_open("snapshot")
      return self._reading(self._ops.copy(self._state))

  def checkpoint_state(self) -> tuple:
    """``(snapshot(), host_state())`` taken under one hold of the lock.

    No insert or sample can run between the two reads, so a checkpoint's PRNG
    key always matches its state.
    """
    with self._cond:
      self._check_open("checkpoint_state")
      host = dict(version=self._version, rng=np.array(self._rng, dtype=np.uint32))
      if self._sidecars is not None:  # ragged values / payloads, from the same instant
        host["sidecars"] = self._sidecars.snapshot()
      return self._reading(self._ops.copy(self._state)), host

  def rng_key(self) -> jax.Array:
    """The host PRNG key (uint32[2]) the next sample will split."""
    with self._cond:
      return jnp.array(self._rng, copy=True)

  def host_state(self) -> dict:
    """Host extras for a checkpoint: ``dict(version=int, rng=np.uint32[2])``."""
    with self._cond:
      return dict(version=self._version, rng=np.array(self._rng, dtype=np.uint32))

  def _slots_keys(self, slots, keys, what):
    """Validated (int32[K] slots, uint32[K] keys), or (None, None) when K == 0."""
    s = _as_array(slots, f"{what} slots")
    k = _as_array(keys, f"{what} keys")
    for name, a in (("slots", s), ("keys", k)):
      if a.dtype.kind not in "iu" and a.size:  # [] is float64 in numpy
        raise TypeError(f"{what}: {name} must be integers, got dtype {a.dtype.name}.")
      if a.ndim != 1:
        raise ValueError(f"{what}: {name} must be 1-D [K], got shape {list(a.shape)}.")
    if s.shape != k.shape:
      raise ValueError(f"{what}: slots {list(s.shape)} and keys {list(k.shape)} differ in length.")
    if s.size == 0:
      return None, None
    c = self.spec.capacity
    if s.min() < -1 or s.max() >= c:
      bad = s[(s < -1) | (s >= c)][0]
      raise ValueError(f"{what}: slot {bad} out of range [0, {c}) (-1 marks an invalid row "
                       "and is ignored).")
    if k.min() < 0 or k.max() >= 2**32:
      raise ValueError(f"{what}: keys must lie in [0, 2**32), got range [{k.min()}, {k.max()}].")
    return s.astype(np.int32), k.astype(np.uint32)

  def _where(self, where, what):
    """``(mask, cols)`` for the jitted ops from a ``where`` argument, or ``(None, None)``.

    ``mask``: bool[C] (all True for a dict); ``cols``: every metadata column
    -> (int32[K] allowed values, bool[] active); K is a power-of-two bucket
    >= 4 (padded by repeating a value, membership unchanged).
    """
    if where is None:
      return None, None
    spec = self.spec
    cols = {c: (np.zeros(4, np.int32), np.bool_(False)) for c in spec.metadata}
    if isinstance(where, Mapping):
      for col, vals in where.items():
        if col not in spec.metadata:
          raise ValueError(f"{what}: unknown where column {col!r}; the spec declares "
                           f"{list(spec.metadata)}.")
        column = spec.column(col)
        if not column.plain:  # strings of a vocab, floats: their stored int32 words
          vals = col_lib.encode(column, vals, f"{what} where[{col!r}]")
        a = _as_array(vals, f"{what} where[{col!r}]")
        if a.size == 0:
          raise ValueError(f"{what}: where[{col!r}] must be an int or a non-empty sequence "
                           "of ints, got an empty sequence.")
        if a.dtype.kind not in "iu":
          raise TypeError(f"{what}: where[{col!r}] must be an int or a sequence of ints, got "
                          f"dtype {a.dtype.name}.")
        if a.ndim > 1:
          raise ValueError(f"{what}: where[{col!r}] must be an int or a 1-D sequence of ints, "
                           f"got shape {list(a.shape)}.")
        a = _int_rows(a.reshape(-1), a.size, f"{what} where[{col!r}]")
        n = max(4, _bucket(a.size, 2**30))
        cols[col] = (np.concatenate([a, np.full(n - a.size, a[0], np.int32)]), np.bool_(True))
      return np.ones(spec.capacity, bool), cols
    m = where if isinstance(where, jax.Array) else _as_array(where, f"{what} where")
    if m.dtype != np.bool_:
      raise TypeError(f"{what}: where must be a bool[{spec.capacity}] mask or a dict "
                      f"column -> values, got dtype {np.dtype(m.dtype).name}.")
    if m.shape != (spec.capacity,):
      raise ValueError(f"{what}: where mask must have shape [{spec.capacity}] (one per slot), "
                       f"got {list(m.shape)}.")
    return m, cols
