"""Rollout-group queries of the host ``Table``: ``count_by``, ``is_ready``,
``take_batch``, ``peek``, ``expire_stale`` and eviction receipts.

``RolloutMixin`` is a mixin of ``Table`` (``funcreplay.host.table``). Each call is one
jitted program over the whole table (``funcreplay.core.ops.grouped``): every requested
value of the column is served by the same pass, not one pass per value.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Optional

import jax
import numpy as np

from funcreplay.core import ops
from funcreplay.core import selectors as sel
from funcreplay.host.rollout import columns as col_lib
from funcreplay.host.rollout.batch import HostSample, check_format
from funcreplay.host.rollout.programs import rollout_ops
from funcreplay.host.validation import bucket, check_int, check_timeout

MIN_GROUPS = 4  # requested values are padded to a power of two >= this (fewer compilations)


@dataclasses.dataclass(frozen=True)
class Receipt:
  """What ``evict_stale(receipt=True)`` / ``expire_stale(receipt=True)`` touched (n items).

  Attributes:
    keys: uint32[n]; slots: int32[n] (free again after an eviction); versions: int32[n].
    metadata: column -> numpy [n] values (strings for a vocabulary, float32 for floats).
    payload: tuple of the items' payloads (None without payloads); after an eviction the
      table no longer holds them: the receipt is the last reference it hands out.
  """

  keys: np.ndarray
  slots: np.ndarray
  versions: np.ndarray
  metadata: dict
  payload: Optional[tuple] = None

  def __len__(self) -> int:
    return int(self.keys.shape[0])


class RolloutMixin:
  """``Table``'s grouped queries (see the module docstring)."""

  @property
  def keeps_payloads(self) -> bool:
    """True if the table keeps one payload per item (``Table(..., payloads=True)``)."""
    return self._sidecars is not None and self._sidecars.has_payloads

  def ragged_memory(self) -> dict:
    """Per ``Ragged`` leaf: bytes held by its arena and the live values' bytes."""
    with self._cond:
      self._check_open("ragged_memory")
      return {} if self._sidecars is None else self._sidecars.memory()

  # -- argument handling ------------------------------------------------------------
  def _groups(self, column, values, what):
    """``(column, encoded int32[K'] padded values, K, original values)``."""
    spec = self.spec
    if not isinstance(column, str) or column not in spec.metadata:
      raise ValueError(f"{what}: unknown column {column!r}; the spec declares "
                       f"{list(spec.metadata)}.")
    col = spec.column(column)
    values = list(values)
    if not values:
      raise ValueError(f"{what}: no values of column {column!r} requested.")
    codes = col_lib.encode(col, values, f"{what} {column!r} values").reshape(-1)
    if len(set(codes.tolist())) != len(codes):
      raise ValueError(f"{what}: duplicate values of column {column!r} in {values}.")
    k = len(codes)
    kp = max(MIN_GROUPS, bucket(k, 2**30))
    padded = np.concatenate([codes, np.full(kp - k, codes[0], np.int32)]).astype(np.int32)
    return column, padded, k, [col_lib.value_key(col, v) for v in values]

  def _query_version(self, version, what):
    return np.int32(check_int(self._version if version is None else version, f"{what} version"))

  # -- queries ----------------------------------------------------------------------
  def count_by(self, column: str, values, *, where=None, version: Optional[int] = None,
               include_stale: bool = False) -> dict:
    """``{value: eligible items whose column equals it}`` for every value, in one pass.

    Eligible as for ``sample``: occupied, fresh at ``version`` (default: the table's;
    ``include_stale=True`` drops the staleness mask), matching ``where``."""
    self._check_open("count_by")
    column, padded, k, keys = self._groups(column, values, "Table.count_by")
    mask, cols = self._where(where, "Table.count_by")
    v = self._query_version(version, "Table.count_by")
    ro = rollout_ops(self.spec)
    with self._cond:
      self._check_open("count_by")
      got = np.asarray(self._reading(ro.count_by(self._state, v, mask, cols, padded,
                                                 column=column, stale_ok=bool(include_stale))))
    return {key: int(n) for key, n in zip(keys, got[:k], strict=True)}

  def is_ready(self, counts: Mapping[Any, int], *, column: str = "task", where=None,
               version: Optional[int] = None, include_stale: bool = False) -> bool:
    """True when every ``value: n`` of ``counts`` has at least ``n`` eligible items
    (xtuner's ``is_ready``); one pass for all values."""
    counts = self._counts(counts, "Table.is_ready")
    have = self.count_by(column, list(counts), where=where, version=version,
                         include_stale=include_stale)
    return all(have[key] >= n for key, n in zip(have, counts.values(), strict=True))

  def _counts(self, counts, what) -> dict:
    if not isinstance(counts, Mapping) or not counts:
      raise TypeError(f"{what}: counts must be a non-empty dict value -> n, got {counts!r}.")
    return {key: check_int(n, f"{what} counts[{key!r}]", 0, 2**31 - 1)
            for key, n in counts.items()}

  def take_batch(self, counts: Mapping[Any, int], *, column: str = "task", where=None,
                 timeout: Optional[float] = None, version: Optional[int] = None,
                 include_stale: bool = False, ragged: str = "padded",
                 consume: bool = True) -> dict:
    """Take (read and delete) ``n`` items per value of ``column``: xtuner's ``take_batch``.

    Waits until every value has ``n`` eligible items (``timeout`` seconds; None: forever),
    then takes all of them in one program, in the sampler's order (``StalestFirst``:
    lowest version first, ties by insertion; ``Uniform``: a random subset;
    ``Prioritized``: a weighted draw without replacement). Taken items are deleted
    (counted as ``deletes``); their payloads are handed over in the samples.
    ``consume=False`` samples them instead (one call for every value still): reuse
    counts go up, the ``samples`` and staleness counters move, and items reaching
    ``max_times_sampled`` are freed (reuse <= N). Neither consults the rate limiter.

    Returns:
      ``{value: HostSample}`` with ``n`` valid rows each (numpy arrays; ``metadata`` and
      ``payload`` filled; ragged leaves as ``RaggedBatch`` in ``ragged`` format).

    Raises:
      TimeoutError naming the values short of items (nothing taken); ValueError /
      TypeError on bad input (table unchanged).
    """
    what = "Table.take_batch"
    self._check_open("take_batch")
    if consume or self.spec.max_times_sampled:  # a grouped take is a masked draw: under a
      # reuse limit it may use up an item that is not the oldest
      ops.require_holes(self.spec, what)
    counts = self._counts(counts, what)
    column, padded, k, keys = self._groups(column, list(counts), what)
    check_format(ragged, what)
    timeout = check_timeout(timeout)
    mask, cols = self._where(where, what)
    v = self._query_version(version, what)
    want = np.zeros(padded.shape, np.int32)
    want[:k] = list(counts.values())
    total = int(want.sum())
    if total > self.spec.capacity:
      raise ValueError(f"{what}: {total} items requested, over the capacity "
                       f"{self.spec.capacity}.")
    b = max(1, bucket(max(total, 1), 2**30))
    ro = rollout_ops(self.spec)
    ordered = sel.is_ordered(self.spec.sampler)
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while True:
        self._check_open("take_batch")
        if version is None:  # the table's version now, as ``Table.sample``'s wait
          v = self._query_version(None, what)
        # Only the random samplers draw: a deterministic order needs no key (and a split
        # is a dispatch of its own).
        rng, sub = (self._rng, None) if ordered else jax.random.split(self._rng)
        program = ro.take if consume else ro.sample
        self._state, out, group, available, meta, ok = program(
            self._state, sub, v, mask, cols, padded, want, column=column, batch_size=b,
            stale_ok=bool(include_stale))
        if bool(ok):
          self._rng = rng
          result = self._host_rows(out, meta, ragged, sync=True)
          self._cond.notify_all()
          break
        if not self._wait(deadline):
          avail = np.asarray(available)[:k]
          short = {key: f"{int(a)}/{n}" for key, a, n in zip(keys, avail, want[:k])
                   if a < n}
          raise TimeoutError(
              f"{what} timed out after {timeout} s: too few eligible items for {column}="
              f"{short} (have/need; nothing was taken). Insert more (fresh) items, ask for "
              "fewer, or pass a larger timeout.")
    group = np.asarray(group)
    return {key: result.rows(group == g) for g, key in enumerate(keys)}

  def peek(self, n: int, *, where=None, version: Optional[int] = None,
           include_stale: bool = False, ragged: str = "padded") -> HostSample:
    """Read up to ``n`` eligible items without sampling them: no counter, reuse count,
    PRNG key or rate limiter changes. Order: the sampler's for the deterministic
    samplers, oldest first for ``Uniform`` / ``Prioritized``. Rows beyond the eligible
    items have ``valid=False``."""
    what = "Table.peek"
    self._check_open("peek")
    n = check_int(n, f"{what} n", 1, self.spec.capacity)
    check_format(ragged, what)
    mask, cols = self._where(where, what)
    v = self._query_version(version, what)
    b = bucket(n, 2**30)
    want = np.array([n], np.int32)
    with self._cond:
      self._check_open("peek")
      out, _, _, meta, _ = rollout_ops(self.spec).peek(
          self._state, None, v, mask, cols, np.zeros(1, np.int32), want, column=None,
          batch_size=b, stale_ok=bool(include_stale))
      result = self._host_rows(out, meta, ragged, sync=False)
    return result.rows(np.arange(b) < n)

  # -- expiry -------------------------------------------------------------------------
  def expire_stale(self, version: Optional[int] = None, *, column: str = "status",
                   value: Any = "expired", receipt: bool = False):
    """Mark every item too stale for ``version`` by setting ``column`` to ``value``
    (xtuner's status flip to EXPIRED) instead of removing it; items already marked are
    left alone. Returns how many were marked, or a ``Receipt`` of them (metadata as
    after the flip). Marked items
    stay stale: ``take_batch(..., where={column: value}, include_stale=True)`` takes
    them (e.g. to re-queue their prompts)."""
    what = "Table.expire_stale"
    self._check_open("expire_stale")
    if self.spec.max_staleness is None:
      raise ValueError(f"{what}: the table has no max_staleness; set TableSpec.max_staleness.")
    if not isinstance(column, str) or column not in self.spec.metadata:
      raise ValueError(f"{what}: unknown column {column!r}; the spec declares "
                       f"{list(self.spec.metadata)}.")
    code = np.int32(col_lib.encode(self.spec.column(column), value, f"{what} value"))
    v = self._query_version(version, what)
    ro = rollout_ops(self.spec)
    with self._cond:
      self._check_open("expire_stale")
      self._state, marked = ro.expire(self._state, v, code, column=column)
      marked = np.asarray(marked)
      self._cond.notify_all()
      return self._receipt(marked) if receipt else int(marked.sum())

  def _stale_receipt(self, v):
    """The receipt of the items ``evict_stale(v)`` is about to remove. Lock held."""
    mask, *_ = rollout_ops(self.spec).stale(self._state, v)
    return self._receipt(np.asarray(mask))

  def _receipt(self, mask: np.ndarray) -> Receipt:
    """A ``Receipt`` of the slots in ``mask`` (read now, before any removal). Lock held."""
    slots = np.nonzero(mask)[0].astype(np.int32)
    st = self._state
    meta = {c.name: col_lib.decode(c, np.asarray(st.metadata[c.name])[slots])
            for c in self.spec.columns}
    payload = None
    if self._sidecars is not None and self._sidecars.has_payloads:
      payload = tuple(self._sidecars.payload[slots].tolist())
    return Receipt(keys=np.asarray(st.key)[slots], slots=slots,
                   versions=np.asarray(st.version)[slots], metadata=meta, payload=payload)

  # -- rows to the host -------------------------------------------------------------
  def _host_rows(self, out, meta, ragged: str, *, sync: bool) -> "_Rows":
    """Numpy rows of a jitted take / peek, with metadata decoded and sidecars read
    (before ``sync`` frees the taken items' sidecars). Lock held."""
    out = jax.tree_util.tree_map(np.asarray, out)
    slots = out.info.slot
    decoded = {c.name: col_lib.decode(c, np.asarray(meta[c.name])) for c in self.spec.columns}
    data, payload = out.data, None
    if self._sidecars is not None:
      data, payload = sidecar_rows(self.spec, self._sidecars, out.data, slots, ragged)
      if sync:
        self._sidecars.sync(self._state)
    return _Rows(HostSample(data=data, valid=out.valid, info=out.info,
                            num_eligible=out.num_eligible, payload=payload, metadata=decoded))


def sidecar_rows(spec, sidecars, data, slots, ragged: str):
  """``(data with each Ragged leaf a RaggedBatch, payload tuple or None)`` for ``slots``."""
  batches, payload = sidecars.rows(np.asarray(slots), ragged)
  leaves = spec.signature.treedef.flatten_up_to(data)
  for (i, _), rb in zip(spec.ragged, batches, strict=True):
    leaves[i] = rb
  return jax.tree_util.tree_unflatten(spec.signature.treedef, leaves), payload


class _Rows:
  """A host batch that can be cut into the rows of each group."""

  def __init__(self, sample: HostSample):
    self.sample = sample

  def rows(self, sel: np.ndarray) -> HostSample:
    s = self.sample

    def cut(x):
      if hasattr(x, "_fields") and hasattr(x, "offsets"):  # RaggedBatch
        return _cut_ragged(x, sel)
      return x[sel]

    data = jax.tree_util.tree_map(cut, s.data, is_leaf=lambda x: hasattr(x, "offsets"))
    idx = np.nonzero(sel)[0]
    return HostSample(
        data=data, valid=s.valid[sel], info=jax.tree_util.tree_map(lambda x: x[sel], s.info),
        num_eligible=s.num_eligible,
        payload=None if s.payload is None else tuple(s.payload[i] for i in idx),
        metadata=None if s.metadata is None else {c: v[sel] for c, v in s.metadata.items()})


def _cut_ragged(rb, sel):
  idx = np.nonzero(sel)[0]
  lengths = rb.lengths[idx]
  offsets = np.zeros((idx.size + 1,), np.int64)
  np.cumsum(lengths, out=offsets[1:])
  if rb.packed:
    values = (np.concatenate([rb.values[rb.offsets[i]:rb.offsets[i + 1]] for i in idx])
              if idx.size else rb.values[:0])
  else:
    values = rb.values[idx]
  return type(rb)(values, lengths, offsets)
