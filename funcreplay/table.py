"""``Table``: the thread-safe host object around one ``TableState``.

The pure core (``fr.make_table``) is a value plus functions. Environments,
actor threads and learners on the host want a *service* instead: many threads
insert, a learner samples, the rate limiter paces them. ``Table`` provides
that in-process, without a server:

* every mutation is one jitted call with the state donated (no full-buffer
  copies), compiled once per static shape: insert batches are padded to a
  power-of-two bucket with a row mask, so a producer with varying batch sizes
  causes at most ``log2(capacity) + 1`` compilations;
* one lock (a ``threading.Condition``) guards the state; a call the rate
  limiter forbids waits on the condition and is retried after every
  mutation, with a timeout (``TimeoutError``); ``close()`` wakes every waiter
  with ``TableClosedError``;
* every input is validated on the host *before* the state is touched, so a
  bad call raises ``ValueError`` / ``TypeError`` and leaves the table exactly
  as it was.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from typing import Any, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from funcreplay import inplace, ops, packing, sampling
from funcreplay import native as native_lib
from funcreplay.native import direct as direct_lib
from funcreplay import selectors as sel
from funcreplay import signature as sig_lib
from funcreplay import state as state_lib
from funcreplay.spec import TableSpec
from funcreplay.state import Sample, TableState

_I32 = np.iinfo(np.int32)

Where = Union[None, np.ndarray, jax.Array, Mapping[str, Union[int, Sequence[int]]]]


class TableClosedError(RuntimeError):
  """Raised by every call on a closed ``Table`` and by calls woken by ``close()``."""


# --- jitted operations, cached per spec (specs are hashable) -----------------

def _copy_tree(tree):
  # jnp.copy is an explicit copy: the outputs never alias the (donated) state.
  return jax.tree_util.tree_map(jnp.copy, tree)


def _where_mask(state: TableState, where, where_cols):
  """bool[C] from a slot mask and {column: (int32[K] allowed values, active bool[])}.

  ``where`` is None when the caller gave no ``where`` at all; otherwise every
  column is present (inactive ones match everything), so any ``where`` of a
  spec compiles to one variant per value bucket.
  """
  if where is None:
    return None
  mask = where
  for col, (vals, active) in where_cols.items():
    mask = mask & (~active | jnp.any(state.metadata[col][:, None] == vals[None, :], axis=1))
  return mask


class _Ops:
  """The jitted operations of one spec (shared by every ``Table`` of that spec)."""

  def __init__(self, spec: TableSpec, native: bool):
    self.spec = spec
    self.native = native
    limiter = spec.rate_limiter
    uniform_remover = isinstance(spec.remover, sel.Uniform)

    def insert(state, rng, items, version, priority, has_priority, metadata, start, n_real):
      bk = version.shape[0]
      # Largest k <= n_real - start the limiter admits now (can_insert is
      # monotone in n), so the batch goes in item by item as in Reverb.
      ns = jnp.arange(1, bk + 1, dtype=jnp.int32)
      allowed = jnp.broadcast_to(limiter.can_insert(state.size, state.limiter_diff, ns), (bk,))
      k = jnp.sum(allowed & (ns <= n_real - start), dtype=jnp.int32)
      idx = jnp.arange(bk, dtype=jnp.int32)
      mask = (idx >= start) & (idx < start + k)
      new_rng, sub = jax.random.split(rng)
      # Always pass explicit priorities (one compiled variant per bucket): the
      # default is what ops.insert would use for priority=None.
      default = state.max_priority if spec.default_priority is None else spec.default_priority
      priority = jnp.where(has_priority, priority, default)
      state = ops.insert(spec, state, items, version=version, priority=priority, mask=mask,
                         metadata=metadata, rng=sub if uniform_remover else None,
                         native=native)
      rng = jnp.where(k > 0, new_rng, rng) if uniform_remover else rng
      return state, rng, k

    def sample(state, rng, version, where, where_cols, min_valid, *, batch_size, replace,
               packed):
      mask = _where_mask(state, where, where_cols)
      # Single reads of the tree root: XLA re-fuses a cheap read into every
      # use, and a use not ordered before the in-place sample costs a tree copy.
      cnt, size = inplace.once((ops.count(spec, state, mask, version), state.size))
      n_valid = jnp.where(cnt > 0, batch_size, 0) if replace else jnp.minimum(cnt, batch_size)
      limiter_ok = limiter.can_sample(size, state.limiter_diff, n_valid)
      ok = limiter_ok & (cnt >= min_valid)
      # The key advances only on a successful sample: how often a waiter
      # retried (timing) never changes the random stream.
      state, out, rng = sampling.sample(spec, state, rng, batch_size=batch_size,
                                        version=version, where=mask, replace=replace,
                                        enabled=ok, native=native, split_key=True,
                                        packed=packed)
      # One int32[3] for the host (one transfer): ok, limiter_ok, eligible count.
      flags = jnp.stack([ok.astype(jnp.int32), limiter_ok.astype(jnp.int32), cnt])
      return state, rng, out, flags

    def count(state, version, where, where_cols):
      return ops.count(spec, state, _where_mask(state, where, where_cols), version)

    def evict_stale(state, version):
      before = state.size
      state = ops.evict_stale(spec, state, version)
      return state, before - state.size

    def delete(state, slots, keys):
      return ops.delete(spec, state, slots, keys)

    def update_priorities(state, slots, keys, priorities):
      return ops.update_priorities(spec, state, slots, keys, priorities, native=native)

    def set_metadata(state, slots, keys, values, *, column):
      return ops.set_metadata(spec, state, slots, keys, column, values)

    donate = dict(donate_argnums=0)
    self.init = jax.jit(functools.partial(state_lib.init_state, spec))
    self.insert = jax.jit(insert, **donate)
    self.sample = jax.jit(sample, static_argnames=("batch_size", "replace", "packed"),
                          **donate)
    self.count = jax.jit(count)
    self.evict_stale = jax.jit(evict_stale, **donate)
    self.delete = jax.jit(delete, **donate)
    self.update_priorities = jax.jit(update_priorities, **donate)
    self.set_metadata = jax.jit(set_metadata, static_argnames=("column",), **donate)
    self.stats = jax.jit(lambda s: _copy_tree(ops.stats(spec, s)))
    self.copy = jax.jit(_copy_tree)


def _ops_for(spec: TableSpec) -> _Ops:
  return _cached_ops(spec, native_lib.default())


@functools.lru_cache(maxsize=64)
def _cached_ops(spec: TableSpec, native: bool) -> _Ops:
  return _Ops(spec, native)


# --- host-side validation helpers ---------------------------------------------

def _bucket(n: int, cap: int) -> int:
  """Smallest power of two >= n, capped at ``cap`` (n <= cap)."""
  return min(1 << max(0, (n - 1).bit_length()), cap)


def _as_array(x, what: str) -> np.ndarray:
  """numpy view of a numpy / JAX / torch (anything with ``__array__``) array or a list."""
  try:
    a = np.asarray(x)
  except Exception as e:  # noqa: BLE001 (re-raised with context)
    raise TypeError(f"{what}: cannot convert {type(x).__name__} to an array ({e}).") from None
  if a.dtype == object:
    raise TypeError(f"{what}: expected numbers, got {type(x).__name__} of Python objects.")
  return a


def _int_rows(x, n: int, what: str, lo: int = _I32.min, hi: int = _I32.max) -> np.ndarray:
  """int32[n] from a scalar or an ``[n]`` integer array; range-checked."""
  a = _as_array(x, what)
  if a.dtype.kind not in "iu":
    raise TypeError(f"{what}: expected integers, got dtype {a.dtype.name}.")
  if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != n):
    raise ValueError(f"{what}: expected a scalar or shape [{n}], got {list(a.shape)}.")
  if a.size and (a.min() < lo or a.max() > hi):
    raise ValueError(f"{what}: values must lie in [{lo}, {hi}], got range "
                     f"[{a.min()}, {a.max()}].")
  return np.broadcast_to(a.astype(np.int64), (n,)).astype(np.int32)


def _priority_rows(x, n: int, what: str, check: Optional[np.ndarray] = None) -> np.ndarray:
  """float32[n] priorities; NaN / inf / negative (where ``check``) -> ValueError."""
  a = _as_array(x, what)
  if a.dtype.kind not in "fiu":
    raise TypeError(f"{what}: expected a float array, got dtype {a.dtype.name}.")
  if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != n):
    raise ValueError(f"{what}: expected a scalar or shape [{n}], got {list(a.shape)}.")
  with np.errstate(over="ignore", invalid="ignore"):
    p = np.broadcast_to(a.astype(np.float32), (n,))
  bad = ~np.isfinite(p) | (p < 0)
  if check is not None:
    bad &= check
  if bad.any():
    i = int(np.argmax(bad))
    raise ValueError(f"{what}: priorities must be finite and >= 0 (as float32); row {i} is "
                     f"{a.reshape(-1)[i if a.ndim else 0]!r} ({int(bad.sum())} bad rows). "
                     "Clip or fix them before calling.")
  return np.ascontiguousarray(p)


def _has_denormal(p: np.ndarray, rows: np.ndarray) -> bool:
  """True if a float32 ``p`` on ``rows`` is denormal (nonzero, below the smallest normal)."""
  a = np.abs(p[rows])
  return bool(np.any((a > 0) & (a < np.finfo(np.float32).tiny)))


def _pad(a: np.ndarray, n: int, fill=0) -> np.ndarray:
  if a.shape[0] == n:
    return a
  out = np.full((n, *a.shape[1:]), fill, a.dtype)
  out[:a.shape[0]] = a
  return out


def _pad_leaf(x, n: int):
  """Pad a numpy or JAX leaf ``[B, ...]`` with zero rows to ``[n, ...]``."""
  b = x.shape[0]
  if b == n:
    return x
  if isinstance(x, jax.Array):
    return jnp.concatenate([x, jnp.zeros((n - b, *x.shape[1:]), x.dtype)])
  return _pad(np.asarray(x), n)


def _describe_limiter(spec: TableSpec) -> str:
  lim = spec.rate_limiter
  if math.isinf(lim.max_diff) and math.isinf(lim.min_diff):
    return f"MinSize({lim.min_size_to_sample})"
  if (lim.samples_per_insert == 1.0 and lim.min_size_to_sample == 1 and lim.min_diff == 0.0):
    name = "Stack" if isinstance(spec.sampler, sel.Lifo) else "Queue"
    return f"{name}({int(lim.max_diff)})"
  return (f"SampleToInsertRatio(samples_per_insert={lim.samples_per_insert}, "
          f"min_size_to_sample={lim.min_size_to_sample}, window=[{lim.min_diff}, "
          f"{lim.max_diff}])")


# --- the table ------------------------------------------------------------------

class Table:
  """A thread-safe, rate-limited replay table on the host (Reverb-like, in process).

  Owns one ``TableState`` (C = ``spec.capacity`` slots). ``insert`` and
  ``sample`` may be called from many threads; each mutation is a single
  jitted call with the state donated, made while holding the table's lock.
  Calls the rate limiter forbids (``spec.rate_limiter``: ``MinSize``,
  ``SampleToInsertRatio``, ``Queue``, ``Stack``) block until another thread's
  call makes them possible, or raise ``TimeoutError`` after ``timeout``
  seconds (``None``: wait forever, ``0``: try once). ``close()`` wakes every
  waiter with ``TableClosedError``; every later call raises it.

  Inputs are validated on the host before the state is touched: a bad call
  raises ``ValueError`` / ``TypeError`` naming the problem and leaves the
  table unchanged.

  Randomness: one host PRNG key (seeded by ``seed``) is split by every
  successful ``sample`` (and every insert with a ``Uniform`` remover), so the
  same sequence of calls on tables with the same seed gives the same samples.

  Checkpoints: ``save(path)`` quiesces the table only for the snapshot: it
  takes the lock just long enough to copy the state (``snapshot()``), then
  writes without holding it, so inserters and samplers continue meanwhile.

  Example::

    table = Table(fr.TableSpec(100_000, example_item, rate_limiter=fr.MinSize(1000)))
    table.insert(batch, version=actor_version)          # from actor threads
    smp = table.sample(256, timeout=10.0)               # learner thread
    table.update_priorities(smp.info.slot, smp.info.key, new_priorities)
  """

  def __init__(self, spec: TableSpec, *, seed: int = 0, version: int = 0):
    if not isinstance(spec, TableSpec):
      raise TypeError(f"Table expects a TableSpec, got {type(spec).__name__}.")
    self._init(spec, None, jax.random.PRNGKey(_check_int(seed, "seed", 0, 2**32 - 1)), version)

  def _init(self, spec, state, rng, version):
    self.spec = spec
    self._ops = _ops_for(spec)
    self._state = self._ops.init() if state is None else state
    self._rng = rng
    self._version = _check_int(version, "version")
    self._cond = threading.Condition()
    self._closed = False
    # MinSize-style limiters (no upper window) never block inserts: the insert
    # needs no device->host sync and stays asynchronous.
    self._insert_never_blocks = math.isinf(spec.rate_limiter.max_diff)
    # Device copies of the last version / min_valid passed to sample: a host
    # scalar argument is a transfer per call (~5 us each on CPU).
    self._scalars = {}
    self._uniform_remover = isinstance(spec.remover, sel.Uniform)
    # Sampling in place into a caller's buffer (sample_packed(out=...)): a
    # direct_lib.DirectSampler once checked (False: not possible here).
    self._direct = None

  # -- construction from a state (restore) ----------------------------------------
  @classmethod
  def from_state(cls, spec: TableSpec, state: TableState, *, seed: int = 0, version: int = 0,
                 rng=None) -> "Table":
    """A ``Table`` owning a *copy* of ``state`` (used by checkpoint restore).

    Args:
      spec: the spec ``state`` was built for.
      state: a ``TableState`` whose structure, shapes and dtypes match ``spec``.
      seed: seeds the host PRNG key when ``rng`` is None.
      version: the current policy version.
      rng: the host PRNG key to continue from (``uint32[2]``, e.g.
        ``host_state()["rng"]``).
    """
    if not isinstance(spec, TableSpec):
      raise TypeError(f"Table.from_state expects a TableSpec, got {type(spec).__name__}.")
    if not isinstance(state, TableState):
      raise TypeError(f"Table.from_state expects a TableState, got {type(state).__name__}.")
    want = jax.eval_shape(functools.partial(state_lib.init_state, spec))
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(state)
    if want_def != got_def:
      raise ValueError(f"Table.from_state: the state's structure does not match the spec.\n"
                       f"  expected: {want_def}\n  got:      {got_def}")
    for (path, w), (_, g) in zip(want_leaves, got_leaves, strict=True):
      if tuple(np.shape(g)) != tuple(w.shape) or np.dtype(g.dtype) != np.dtype(w.dtype):
        raise ValueError(f"Table.from_state: state{jax.tree_util.keystr(path)} is "
                         f"{np.dtype(g.dtype).name}{list(np.shape(g))}, the spec needs "
                         f"{np.dtype(w.dtype).name}{list(w.shape)}.")
    if rng is None:
      rng = jax.random.PRNGKey(_check_int(seed, "seed", 0, 2**32 - 1))
    else:
      r = _as_array(rng, "rng")
      if r.shape != (2,) or r.dtype != np.uint32:
        raise ValueError(f"Table.from_state: rng must be a uint32[2] key, got "
                         f"{r.dtype.name}{list(r.shape)}.")
      rng = jnp.asarray(r)
    ops_ = _ops_for(spec)
    table = cls.__new__(cls)
    table._init(spec, ops_.copy(jax.tree_util.tree_map(jnp.asarray, state)), rng, version)
    return table

  # -- properties -------------------------------------------------------------
  @property
  def version(self) -> int:
    """Current policy version (used as the default item version and for staleness)."""
    return self._version

  def set_version(self, version: int) -> None:
    """Set the current policy version (a learner bumps it after each update)."""
    v = _check_int(version, "version")
    with self._cond:
      self._check_open("set_version")
      self._version = v
      self._cond.notify_all()

  @property
  def closed(self) -> bool:
    return self._closed

  @property
  def size(self) -> int:
    """Number of items in the table."""
    with self._cond:
      self._check_open("size")
      return int(self._state.size)

  def __len__(self) -> int:
    return self.size

  def __repr__(self) -> str:
    state = "closed" if self._closed else f"version={self._version}"
    return (f"Table(capacity={self.spec.capacity}, sampler={type(self.spec.sampler).__name__}, "
            f"rate_limiter={_describe_limiter(self.spec)}, {state})")

  def __enter__(self) -> "Table":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- insert -------------------------------------------------------------------
  def insert(self, items: Any, *, version: Optional[Union[int, Any]] = None, priority=None,
             metadata: Optional[Mapping[str, Any]] = None,
             timeout: Optional[float] = None) -> None:
    """Insert a batch of ``B`` items (``1 <= B <= capacity``).

    Args:
      items: pytree matching ``spec.signature`` with a leading ``[B]`` axis on
        every leaf (numpy or JAX arrays of exactly the signature's dtypes).
      version: int or int[B]: policy version of each item (default: ``self.version``).
      priority: float or float[B], finite and >= 0 (default: the spec's
        default priority, or the largest seen so far).
      metadata: dict ``column -> int or int[B]`` over ``spec.metadata``
        (missing columns get 0).
      timeout: seconds to wait while the rate limiter forbids inserting.

    Items are admitted one at a time, as in Reverb: when the limiter allows
    only part of the batch, that part is inserted and the call waits for the
    rest. On ``TimeoutError`` (or ``TableClosedError`` while waiting) the
    error's ``inserted`` attribute says how many leading items went in.

    Raises:
      ValueError / TypeError on invalid input (table unchanged);
      TimeoutError; TableClosedError.
    """
    self._check_open("insert")
    timeout = _check_timeout(timeout)
    spec = self.spec
    try:
      leaves, b = sig_lib.check_items(spec.signature, items)
    except (ValueError, TypeError) as e:
      raise type(e)(f"Table.insert: {e}") from None
    if b == 0:
      raise ValueError("Table.insert: empty batch (B = 0); pass at least one item.")
    if b > spec.capacity:
      raise ValueError(f"Table.insert: batch of {b} items exceeds the table capacity "
                       f"{spec.capacity}; split the batch or grow the table.")
    bk = _bucket(b, spec.capacity)
    ver = _pad(_int_rows(self._version if version is None else version, b,
                         "Table.insert version"), bk)
    has_prio = np.bool_(priority is not None)
    prio = _pad(_priority_rows(0.0 if priority is None else priority, b, "Table.insert priority"),
                bk)
    metadata = check_metadata_columns({} if metadata is None else metadata, spec.metadata,
                                      "Table.insert")
    meta = {k: _pad(_int_rows(metadata.get(k, 0), b, f"Table.insert metadata[{k!r}]"), bk)
            for k in spec.metadata}
    padded = jax.tree_util.tree_unflatten(spec.signature.treedef,
                                          [_pad_leaf(x, bk) for x in leaves])
    # Host arrays go to the jitted call as they are: its C++ path transfers
    # them in ~2 us each, where a jax.device_put of the tuple costs ~70 us.
    args = (padded, ver, prio, has_prio, meta)
    n_real = np.int32(b)
    inserted = 0
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      while True:
        self._check_open("insert", inserted=inserted)
        self._state, rng, k = self._ops.insert(self._state, self._rng, *args,
                                               np.int32(inserted), n_real)
        if self._uniform_remover:  # only its victims are drawn with the key
          self._rng = rng
        if self._insert_never_blocks:
          self._cond.notify_all()
          return
        k = int(k)
        if k:
          inserted += k
          self._cond.notify_all()
          if inserted == b:
            return
        if not self._wait(deadline):
          err = TimeoutError(
              f"Table.insert timed out after {timeout} s with {inserted} of {b} items inserted: "
              f"the rate limiter {_describe_limiter(spec)} forbids more inserts until items "
              f"are sampled (table size {int(self._state.size)}). Sample from the table, "
              "pass a larger timeout, or loosen the rate limiter.")
          err.inserted = inserted
          raise err

  # -- sample ---------------------------------------------------------------------
  def sample(self, batch_size: int, *, version: Optional[int] = None, where: Where = None,
             timeout: Optional[float] = None, replace: bool = False,
             min_valid: Optional[int] = None) -> Sample:
    """Sample ``batch_size`` items, waiting until enough are available.

    Args:
      batch_size: B (<= capacity unless ``replace``).
      version: current policy version for the staleness mask and the
        staleness stats (default: ``self.version``).
      where: bool[C] mask over slots, or dict ``{column: int | sequence of
        ints}`` (items whose column equals the int / is in the sequence; all
        columns must match).
      timeout: seconds to wait (None: forever).
      replace: sample with replacement.
      min_valid: wait until at least this many eligible items exist (default
        ``batch_size``; 1 with ``replace=True``). With fewer than B eligible
        items the extra rows have ``valid=False``.

    Blocks while fewer than ``min_valid`` items are eligible (occupied, fresh
    enough, matching ``where``) or while the rate limiter forbids sampling the
    rows this call would return (``min(B, eligible)``; B with replacement).

    One call is one limiter decision for the whole batch (Reverb decides per
    item): ``min_size_to_sample`` and the ``SampleToInsertRatio`` window are
    checked once, before the draw, for all ``n`` rows together (the window
    must admit ``samples + n``), and then all ``n`` rows are sampled. Items
    reaching ``max_times_sampled`` are freed after the batch, so with
    ``max_times_sampled=1`` a batch of ``n`` distinct items leaves ``size -
    n`` items, possibly below ``min_size_to_sample``, where Reverb, sampling
    item by item, would have stopped at the minimum; with ``replace=True``
    an item may appear more often in one batch than its remaining allowance.

    Returns:
      ``fr.Sample`` of fresh JAX arrays: ``data`` (item pytree, leading [B]),
      ``valid`` bool[B], ``info`` (slot int32[B], key uint32[B], probability
      float32[B], priority, times_sampled, version), ``num_eligible`` int32[].
    """
    return self._sample("Table.sample", batch_size, version, where, timeout, replace, min_valid,
                        packed=False)

  def sample_packed(self, batch_size: int, *, version: Optional[int] = None,
                    where: Where = None, timeout: Optional[float] = None, replace: bool = False,
                    min_valid: Optional[int] = None, out=None) -> packing.PackedSample:
    """``sample``, returning the batch as one contiguous buffer (``fr.PackedSample``).

    Same arguments, semantics and random stream as ``sample`` (a table with
    the same seed and history hands out the same items either way). The
    fields lie in ``uint8[N]`` at the offsets of ``PackedSample.layout``,
    written by the sampling program itself: a consumer outside JAX takes the
    whole batch with one export (``funcreplay.torch`` does, then views each
    field), instead of one per array, which costs ~10 us each on a CPU.
    Items with sub-byte dtypes (int4, ...) cannot be packed (ValueError).

    ``out``: a writable, C-contiguous ``uint8[N]`` numpy array or CPU torch
    tensor (pinned or not; N = ``packing.layout(spec.signature,
    batch_size).nbytes``) to write the batch into; the result's ``buffer`` is
    then ``out`` itself. A CPU table using the
    native kernels writes it in place, without a jitted call (no dispatch,
    no XLA buffer to import: ``funcreplay.native.direct``), when ``where`` is
    None (and the sampler is not prioritized with ``max_staleness``); the
    draw, the state update and the key advance are those of the jitted path.
    Otherwise the jitted sample runs and its buffer is copied into ``out``.
    """
    view = None
    if out is not None:
      view = self._check_out(out, batch_size, "Table.sample_packed")
    return self._sample("Table.sample_packed", batch_size, version, where, timeout, replace,
                        min_valid, packed=True, out=view, out_owner=out)

  def _check_out(self, out, batch_size, what) -> np.ndarray:
    """A numpy view of ``out`` if it is a writable C-contiguous uint8 buffer of the packed
    size (a numpy array, or a CPU torch tensor, which ``numpy()`` views without a copy)."""
    if not isinstance(out, np.ndarray):
      if type(out).__module__.split(".")[0] != "torch" or not hasattr(out, "numpy"):
        raise TypeError(f"{what}: out must be a numpy array or a CPU torch tensor of uint8, "
                        f"got {type(out).__name__}.")
      if out.device.type != "cpu" or out.requires_grad:
        raise ValueError(f"{what}: a torch out must be a CPU tensor without requires_grad, got "
                         f"one on {out.device} (requires_grad={out.requires_grad}).")
      out = out.numpy()
    why = packing.packable(self.spec.signature)
    if why is not None:
      raise ValueError(f"{what}: cannot pack this table's items: {why}. Use Table.sample.")
    if isinstance(batch_size, (int, np.integer)) and not isinstance(batch_size, (bool, np.bool_)) \
        and batch_size >= 1:
      n = packing.layout(self.spec.signature, int(batch_size)).nbytes
      if out.dtype != np.uint8 or out.shape != (n,):
        raise ValueError(f"{what}: out must be uint8[{n}] for {int(batch_size)} rows of this "
                         f"table, got {out.dtype.name}{list(out.shape)}.")
    if not out.flags.c_contiguous or not out.flags.writeable:
      raise ValueError(f"{what}: out must be C-contiguous and writable.")
    return out

  @property
  def samples_in_place(self) -> bool:
    """True if ``sample_packed(..., out=buf)`` writes the batch straight into ``buf``
    without a jitted call (a CPU table on the native kernels; ``where=None``;
    ``funcreplay.native.direct``). Otherwise ``out`` receives a copy."""
    with self._cond:
      self._check_open("samples_in_place")
      return self._direct_sampler() is not None

  def _direct_sampler(self):
    """The table's ``DirectSampler``, or None where the direct path does not apply."""
    if self._direct is None:
      why = direct_lib.unsupported(self.spec, self._ops.native)
      if why is None and not direct_lib.on_cpu(self._state):
        why = "the table's state is not on the CPU"
      self._direct = False if why is not None else direct_lib.DirectSampler(
          self.spec, native_lib.ledger_attr(self.spec))
    return self._direct or None

  def _settle(self, direct) -> None:
    """Before a direct sample: no XLA program may still write the state (read-only ones
    finished in ``_reading``); the key is numpy. Lock held."""
    direct.bind(self._state)
    if not (isinstance(self._rng, np.ndarray) and self._rng.flags.writeable):
      self._rng = np.array(self._rng, dtype=np.uint32)

  def _reading(self, result):
    """The output of a read-only program on the state, finished before the lock is released
    when this table may sample in place: a direct sample writes the buffers that program
    reads, and only the program's outputs tell when it is done. Lock held."""
    if self._direct_sampler() is not None:
      jax.block_until_ready(result)
    return result

  def _sample(self, what, batch_size, version, where, timeout, replace, min_valid, *, packed,
              out=None, out_owner=None):
    self._check_open("sample")
    spec = self.spec
    timeout = _check_timeout(timeout)
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) \
        or batch_size < 1:
      raise ValueError(f"{what}: batch_size must be an int >= 1, got {batch_size!r}.")
    batch_size = int(batch_size)
    replace = bool(replace)
    if not replace and batch_size > spec.capacity:
      raise ValueError(f"{what}: batch_size {batch_size} exceeds the capacity "
                       f"{spec.capacity}; use replace=True or a smaller batch.")
    if replace and sel.is_ordered(spec.sampler):
      raise ValueError(f"{what}: replace=True is not supported by the deterministic "
                       f"{type(spec.sampler).__name__} sampler.")
    if min_valid is None:
      min_valid = 1 if replace else batch_size
    limit = min(batch_size, spec.capacity) if not replace else spec.capacity
    min_valid = _check_int(min_valid, f"{what} min_valid", 0, limit)
    ver_int = _check_int(self._version if version is None else version, f"{what} version")
    mask, cols = self._where(where, what)
    if packed:
      why = packing.packable(spec.signature)
      if why is not None:
        raise ValueError(f"{what}: cannot pack this table's items: {why}. Use Table.sample.")
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      direct = self._direct_sampler() if out is not None and where is None else None
      if direct is None:
        ver = self._device_int("version", ver_int)
      while True:
        self._check_open("sample")
        if direct is not None:
          self._settle(direct)
          ok, limiter_ok, cnt = direct.sample(
              self._rng, batch_size, replace, ver_int, min_valid,
              out.ctypes.data if out_owner is out else out_owner.data_ptr())
          result = packing.PackedSample(out_owner, direct.layout(batch_size))
        else:
          self._state, self._rng, result, flags = self._ops.sample(
              self._state, self._rng, ver, mask, cols, self._device_int("min_valid", min_valid),
              batch_size=batch_size, replace=replace, packed=packed)
          ok, limiter_ok, cnt = (int(x) for x in np.asarray(flags))
          if ok and out is not None:  # the jitted batch, copied into the caller's buffer
            np.copyto(out, np.asarray(result.buffer))
            result = packing.PackedSample(out_owner, result.layout)
        if ok:
          self._cond.notify_all()
          return result
        if not self._wait(deadline):
          why = []
          if not limiter_ok:
            why.append(f"the rate limiter {_describe_limiter(spec)} forbids sampling now "
                       f"(table size {int(self._state.size)}); insert more items")
          if cnt < min_valid:
            why.append(f"only {int(cnt)} eligible items (need min_valid={min_valid}"
                       + (f"; max_staleness={spec.max_staleness} at version {ver_int}"
                          if spec.max_staleness is not None else "")
                       + ("; restricted by where" if where is not None else "")
                       + "); insert more (fresh) items or lower min_valid")
          why = "; and ".join(why)
          raise TimeoutError(f"{what}({batch_size}) timed out after {timeout} s: {why}, "
                             "or pass a larger timeout.")

  def _device_int(self, name: str, value: int) -> jax.Array:
    """int32[] on the device for ``value``, reused while ``name`` keeps that value."""
    cached = self._scalars.get(name)  # (value, array); replaced whole, so thread-safe
    if cached is None or cached[0] != value:
      cached = (value, jax.device_put(np.int32(value)))
      self._scalars[name] = cached
    return cached[1]

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
      # In place, like a direct sample (funcreplay.native.direct); a denormal priority
      # goes through XLA, whose treatment of one the direct path does not reproduce.
      if direct is not None and direct.updates_in_place and not _has_denormal(p, s >= 0):
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
    v = _int_rows(values, len(s), f"Table.set_metadata values[{column!r}]")
    n = _bucket(len(s), 2**30)
    fn = functools.partial(self._ops.set_metadata, column=column)
    self._mutate("set_metadata", fn, _pad(s, n, -1), _pad(k, n, 0), _pad(v, n))

  def evict_stale(self, version: Optional[int] = None) -> int:
    """Free every item too stale for ``version`` (default ``self.version``); returns how many."""
    self._check_open("evict_stale")
    if self.spec.max_staleness is None:
      raise ValueError("Table.evict_stale: the table has no max_staleness; set "
                       "TableSpec.max_staleness.")
    v = np.int32(_check_int(self._version if version is None else version,
                            "Table.evict_stale version"))
    with self._cond:
      self._check_open("evict_stale")
      self._state, n = self._ops.evict_stale(self._state, v)
      self._cond.notify_all()
      return int(n)

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
      return self._reading(self._ops.copy(self._state)), dict(version=self._version,
                                               rng=np.array(self._rng, dtype=np.uint32))

  def rng_key(self) -> jax.Array:
    """The host PRNG key (uint32[2]) the next sample will split."""
    with self._cond:
      return jnp.array(self._rng, copy=True)

  def host_state(self) -> dict:
    """Host extras for a checkpoint: ``dict(version=int, rng=np.uint32[2])``."""
    with self._cond:
      return dict(version=self._version, rng=np.array(self._rng, dtype=np.uint32))

  # -- checkpoints / ingestion (other modules, imported lazily) ------------------------
  def save(self, path, **kwargs):
    """Save a checkpoint (``funcreplay.checkpoint.save_table``); holds the lock only to snapshot."""
    from funcreplay import checkpoint  # noqa: PLC0415 (lazy: optional module)
    return checkpoint.save_table(self, path, **kwargs)

  @classmethod
  def restore(cls, path, **kwargs) -> "Table":
    """Restore a table saved by ``save`` (``funcreplay.checkpoint.restore_table``)."""
    from funcreplay import checkpoint  # noqa: PLC0415
    return checkpoint.restore_table(path, **kwargs)

  def ingestor(self, **kwargs):
    """A background-thread ``funcreplay.ingest.Ingestor`` feeding this table (context manager)."""
    self._check_open("ingestor")
    from funcreplay.ingest import Ingestor  # noqa: PLC0415
    return Ingestor(self, **kwargs)

  # -- closing ------------------------------------------------------------------------
  def close(self) -> None:
    """Close the table: every waiter wakes with ``TableClosedError``; idempotent."""
    with self._cond:
      if self._closed:
        return
      self._closed = True
      self._state = None  # free the buffers; nothing may touch them any more
      if self._direct:
        self._direct.unbind()
      self._cond.notify_all()

  # -- internals ------------------------------------------------------------------------
  def _check_open(self, what: str, inserted: Optional[int] = None) -> None:
    if self._closed:
      err = TableClosedError(f"Table.{what}: the table is closed; create a new Table "
                             "(or restore a checkpoint) to continue.")
      if inserted is not None:
        err.inserted = inserted
      raise err

  def _wait(self, deadline: Optional[float]) -> bool:
    """Wait for a notification; False once ``deadline`` has passed. Lock held."""
    if deadline is None:
      self._cond.wait()
      return True
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      return False
    self._cond.wait(remaining)
    return True

  def _mutate(self, what, fn, *args) -> None:
    with self._cond:
      self._check_open(what)
      self._state = fn(self._state, *args)
      self._cond.notify_all()

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


def check_metadata_columns(metadata, columns, what: str) -> Mapping[str, Any]:
  """``metadata`` if it is a dict over (a subset of) ``columns``; else a clear error."""
  if not isinstance(metadata, Mapping):
    raise TypeError(f"{what}: metadata must be a dict column -> ints, got "
                    f"{type(metadata).__name__}.")
  unknown = sorted(set(metadata) - set(columns))
  if unknown:
    raise ValueError(f"{what}: unknown metadata columns {unknown}; the spec declares "
                     f"{list(columns)}.")
  return metadata


def _check_int(x, what: str, lo: int = _I32.min, hi: int = _I32.max) -> int:
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
    if isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0 and x.dtype.kind in "iu":
      x = int(x)
    else:
      raise TypeError(f"{what} must be an int, got {type(x).__name__} {x!r}.")
  if not lo <= int(x) <= hi:
    raise ValueError(f"{what} must lie in [{lo}, {hi}], got {int(x)}.")
  return int(x)


def _check_timeout(timeout) -> Optional[float]:
  if timeout is None:
    return None
  if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or math.isnan(timeout) \
      or timeout < 0:
    raise ValueError(f"timeout must be None (wait forever) or a number of seconds >= 0, "
                     f"got {timeout!r}.")
  return float(timeout)
