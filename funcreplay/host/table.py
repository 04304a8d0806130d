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

This module holds construction, ``insert`` and the checkpoint / ingestion entry points;
the rest of ``Table`` comes from its mixins: ``guard`` (the lock, waits, ``close``),
``table_sampling`` (``sample``, ``sample_packed``, the in-place sampler of ``direct``) and
``table_updates`` (keyed updates, removals, queries). ``programs`` holds the jitted
programs shared per spec, ``validation`` the input checks shared with the ``Ingestor``.
"""

from __future__ import annotations

import functools
import math
import threading
import time
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from funcreplay.core import selectors as sel
from funcreplay.core import state as state_lib
from funcreplay.core import storage
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState
from funcreplay.host import consistency
from funcreplay.host.guard import TableClosedError, TableGuard
from funcreplay.host.ingest import Ingestor
from funcreplay.host.programs import ops_for as _ops_for
from funcreplay.host.rollout import columns as col_lib
from funcreplay.host.rollout import inserts as rollout_inserts
from funcreplay.host.rollout.mixin import RolloutMixin
from funcreplay.host.rollout.sidecar import KEY_SPACE, Sidecars
from funcreplay.host.table_sampling import SamplingMixin
from funcreplay.host.table_updates import UpdatesMixin
from funcreplay.host.validation import as_array as _as_array
from funcreplay.host.validation import bucket as _bucket
from funcreplay.host.validation import check_int as _check_int
from funcreplay.host.validation import check_items, check_limiter_reachable, check_metadata_columns
from funcreplay.host.validation import check_timeout as _check_timeout
from funcreplay.host.validation import describe_limiter as _describe_limiter
from funcreplay.host.validation import int_rows as _int_rows
from funcreplay.host.validation import pad as _pad
from funcreplay.host.validation import pad_leaf as _pad_leaf
from funcreplay.host.validation import priority_rows as _priority_rows

__all__ = ["Table", "TableClosedError", "VersionAheadWarning", "check_metadata_columns",
           "register_checkpoint_io"]


class VersionAheadWarning(UserWarning):
  """Items were inserted with a version ahead of the table's (``Table.insert``).

  Kept, not refused: an actor may receive policy ``v + 1`` before the learner calls
  ``table.set_version(v + 1)``. Such items count as fresh (staleness < 0 is within any
  ``max_staleness``) until the table's version passes theirs; a persistent gap usually
  means ``set_version`` is never called. Warned once per table; filter it with
  ``warnings.simplefilter("ignore", fr.VersionAheadWarning)``, or make it an
  error with ``"error"``.
  """

# Checkpoint I/O lives in the layer above: funcreplay.checkpoint registers its save / restore
# / read_into here when imported (``fr.Table`` imports it first); the host never imports it.
CHECKPOINT_IO: Dict[str, Callable[..., Any]] = {}


def register_checkpoint_io(save_table: Callable[..., Any], restore_table: Callable[..., Any],
                           read_into: Callable[..., Any]) -> None:
  """Install the functions behind ``Table.save`` / ``restore`` / ``load`` (checkpoint layer)."""
  CHECKPOINT_IO.update(save=save_table, restore=restore_table, load=read_into)


def checkpoint_io(what: str) -> Callable[..., Any]:
  """The registered checkpoint function ``what`` ("save" / "restore" / "load"), or a clear error."""
  fn = CHECKPOINT_IO.get(what)
  if fn is None:
    raise RuntimeError(f"Table.{what} needs funcreplay.checkpoint: `import funcreplay.checkpoint` "
                       "(the public fr.Table does) before saving or restoring a table.")
  return fn


class Table(TableGuard, SamplingMixin, UpdatesMixin, RolloutMixin):
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

  Randomness: one host PRNG key (``seed``) is split by every successful ``sample``
  (and insert with a ``Uniform`` remover): the same calls on tables with the same seed
  give the same samples, with the native kernels or without (``native``: True / False,
  or None: ``FUNCREPLAY_NATIVE`` when the programs are built; they agree bit for bit).

  Checkpoints: ``save(path)`` copies the state under the lock, writes without it; ``load``.

  Ragged leaves, payloads (``payloads=True``), ``take_batch`` / ``is_ready`` / ``peek``:
  ``funcreplay.host.rollout`` (README "Rollout groups for LLM RL").

  Example::

    table = Table(fr.TableSpec(100_000, example_item, rate_limiter=fr.MinSize(1000)))
    table.insert(batch, version=actor_version)          # from actor threads
    smp = table.sample(256, timeout=10.0)               # learner thread
    table.update_priorities(smp.info.slot, smp.info.key, new_priorities)
  """

  def __init__(self, spec: TableSpec, *, seed: int = 0, version: int = 0,
               payloads: bool = False, native: Optional[bool] = None):
    if not isinstance(spec, TableSpec):
      raise TypeError(f"Table expects a TableSpec, got {type(spec).__name__}.")
    self._init(spec, None, jax.random.PRNGKey(_check_int(seed, "seed", 0, 2**32 - 1)), version,
               _ops_for(spec, native), payloads)

  def _init(self, spec, state, rng, version, ops_, payloads=False, sidecar_values=None):
    check_limiter_reachable(spec)
    self.spec = spec
    self._ops = ops_
    self._state = self._ops.init() if state is None else state
    self._rng = rng
    self._version = _check_int(version, "version")
    self._cond = threading.Condition()
    self._closed = False
    self._warned_ahead = False  # VersionAheadWarning given
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
    # Ragged values and payloads following the state's occupancy (None: neither).
    self._sidecars = Sidecars(spec, bool(payloads)) if spec.ragged or payloads else None
    if self._sidecars is not None:
      self._sidecars.reset(self._state, *(sidecar_values or (None, None)))

  # -- construction from a state (restore) ----------------------------------------
  @classmethod
  def from_state(cls, spec: TableSpec, state: TableState, *, seed: int = 0, version: int = 0,
                 rng=None, check: bool = True, payloads: bool = False,
                 sidecar_values=None, native: Optional[bool] = None) -> "Table":
    """A ``Table`` owning a *copy* of ``state`` (used by checkpoint restore).

    Args:
      spec: the spec ``state`` was built for.
      state: a ``TableState`` whose structure, shapes and dtypes match ``spec``.
      seed: seeds the host PRNG key when ``rng`` is None.
      version: the current policy version.
      rng: the host PRNG key to continue from (``uint32[2]``, e.g.
        ``host_state()["rng"]``).
      check: also check that the state is consistent, not just well-shaped:
        trees vs occupancy and priorities, counters vs size, keys vs
        ``next_key``, reuse counts, ring position, version index
        (``funcreplay.host.consistency``; O(C) on the host, ~numpy speed). A
        ``ValueError`` names the broken invariant. ``check=False`` trusts the
        caller: an inconsistent state then misbehaves silently (e.g. samples
        free slots).
      payloads, sidecar_values: keep payloads; ``(ragged values, payloads)`` of the
        occupied slots in slot order (``Sidecars.reset``; checkpoints pass them).
    """
    if not isinstance(spec, TableSpec):
      raise TypeError(f"Table.from_state expects a TableSpec, got {type(spec).__name__}.")
    if not isinstance(state, TableState):
      raise TypeError(f"Table.from_state expects a TableState, got {type(state).__name__}.")
    want = jax.eval_shape(functools.partial(state_lib.init_state, spec))
    want_leaves, want_def = jax.tree_util.tree_flatten_with_path(want)
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(state)
    if want_def != got_def:
      storage.check(spec, state.data, "Table.from_state")  # names the storage if that is it
      raise ValueError(f"Table.from_state: the state's structure does not match the spec.\n"
                       f"  expected: {want_def}\n  got:      {got_def}")
    for (path, w), (_, g) in zip(want_leaves, got_leaves, strict=True):
      if tuple(np.shape(g)) != tuple(w.shape) or np.dtype(g.dtype) != np.dtype(w.dtype):
        raise ValueError(f"Table.from_state: state{jax.tree_util.keystr(path)} is "
                         f"{np.dtype(g.dtype).name}{list(np.shape(g))}, the spec needs "
                         f"{np.dtype(w.dtype).name}{list(w.shape)}.")
    if check:
      consistency.check_state(spec, state)
    if rng is None:
      rng = jax.random.PRNGKey(_check_int(seed, "seed", 0, 2**32 - 1))
    else:
      r = _as_array(rng, "rng")
      if r.shape != (2,) or r.dtype != np.uint32:
        raise ValueError(f"Table.from_state: rng must be a uint32[2] key, got "
                         f"{r.dtype.name}{list(r.shape)}.")
      rng = jnp.asarray(r)
    ops_ = _ops_for(spec, native)
    table = cls.__new__(cls)
    table._init(spec, ops_.copy(jax.tree_util.tree_map(jnp.asarray, state)), rng, version,
                ops_, payloads, sidecar_values)
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

  # -- insert -------------------------------------------------------------------
  def insert(self, items: Any, *, version: Optional[Union[int, Any]] = None, priority=None,
             metadata: Optional[Mapping[str, Any]] = None,
             timeout: Optional[float] = None, payload=None) -> None:
    """Insert a batch of ``B`` items (``1 <= B <= capacity``).

    Args:
      items: pytree matching ``spec.signature`` with a leading ``[B]`` axis on
        every leaf (numpy or JAX arrays of exactly the signature's dtypes).
      version: int or int[B]: policy version of each item (default: ``self.version``).
        A version ahead of the table's is kept (it counts as fresh) with a
        ``VersionAheadWarning``, once per table: the learner's
        ``set_version`` may lag the actors' policy.
      priority: float or float[B], finite and >= 0 (default: the spec's
        default priority, or the largest seen so far).
      metadata: dict ``column -> value or [B] values`` over ``spec.metadata``
        (missing columns get 0: the vocab's first string, 0.0 for a float column).
      timeout: seconds to wait while the rate limiter forbids inserting.
      payload: a sequence of ``B`` Python objects (``Table(payloads=True)``).

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
    items, ragged_rows = rollout_inserts.split_ragged(spec, items, "Table.insert")
    leaves, b = check_items(spec.signature, items, batched=True, what="Table.insert")
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
    meta = {c.name: _pad(col_lib.rows(c, metadata.get(c.name, 0), b,
                                      f"Table.insert metadata[{c.name!r}]"), bk)
            for c in spec.columns}
    payload = rollout_inserts.check_payloads(
        payload, b, self._sidecars is not None and self._sidecars.has_payloads, "Table.insert")
    if version is not None and not self._warned_ahead and ver[:b].max() > self._version:
      self._warned_ahead = True
      warnings.warn(
          f"Table.insert: item version {int(ver[:b].max())} is ahead of the table's version "
          f"{self._version}; the items are kept and count as fresh until the table's version "
          "passes theirs. Call table.set_version(v) when the learner moves to policy v (warned "
          "once per table; see fr.VersionAheadWarning).", VersionAheadWarning, stacklevel=2)
    padded = jax.tree_util.tree_unflatten(spec.signature.treedef,
                                          [_pad_leaf(x, bk) for x in leaves])
    # Host arrays go to the jitted call as they are: its C++ path transfers
    # them in ~2 us each, where a jax.device_put of the tuple costs ~70 us.
    args = (padded, ver, prio, has_prio, meta)
    n_real = np.int32(b)
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      pending, sidecars = None, self._sidecars  # close() drops self._sidecars while we wait
      if sidecars is not None:
        self._check_open("insert")
        pending = sidecars.stage(ragged_rows, payload, b)
      try:
        self._insert_locked(spec, b, args, n_real, timeout, deadline, pending)
      finally:
        if pending is not None:
          sidecars.release(pending)

  def _insert_locked(self, spec, b, args, n_real, timeout, deadline, pending) -> None:
    inserted = 0  # the admission loop of insert (lock held; pending: staged sidecars)
    while True:
      self._check_open("insert", inserted=inserted)
      if pending is not None:  # rows [inserted, ...) get keys next_key, next_key + 1, ...
        pending.first_key = (int(self._state.next_key) - inserted) % KEY_SPACE
      self._state, rng, k = self._ops.insert(self._state, self._rng, *args,
                                             np.int32(inserted), n_real)
      if pending is not None:
        self._sidecars.sync(self._state, pending)
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

  # -- checkpoints / ingestion ---------------------------------------------------------
  def save(self, path, **kwargs):
    """Save a checkpoint (``funcreplay.checkpoint.save_table``); holds the lock only to snapshot."""
    return checkpoint_io("save")(self, path, **kwargs)

  @classmethod
  def restore(cls, path, **kwargs) -> "Table":
    """Restore a table saved by ``save`` (``funcreplay.checkpoint.restore_table``)."""
    return checkpoint_io("restore")(path, **kwargs)

  def load(self, path, *, verify: bool = True, check: bool = True,
           allow_pickle: bool = False) -> None:
    """Restore a checkpoint *into* this table (same spec): ingestors, samplers and
    threads holding this ``Table`` carry on with the loaded items, counters, PRNG key
    and version.

    The checkpoint is read and verified without the lock
    (``funcreplay.checkpoint.host.read_into``: a spec mismatch or a damaged file
    raises ``CheckpointError`` and leaves the table as it was); the state is then
    swapped in under the lock and every waiter is woken to re-check the rate
    limiter against the loaded state. A checkpoint of the pure layer (no host
    extras) keeps this table's PRNG key and version. ``verify`` / ``check``: as in
    ``Table.restore`` (CRC-32s; the state's consistency, see ``from_state``).
    """
    self._check_open("load")
    state, version, rng, sidecar = checkpoint_io("load")(self, path, verify=verify,
                                                         check=check, allow_pickle=allow_pickle)
    # The table's own copy, finished before the swap: a direct (in-place) sample may
    # read the buffers as soon as the lock is released.
    state = jax.block_until_ready(self._ops.copy(jax.tree_util.tree_map(jnp.asarray, state)))
    with self._cond:
      self._check_open("load")
      self._state = state
      if self._sidecars is not None:
        self._sidecars.reset(state, *(sidecar or (None, None)))
      if rng is not None:
        self._rng, self._version = jnp.asarray(rng), version
      self._cond.notify_all()

  def ingestor(self, **kwargs):
    """A background-thread ``funcreplay.Ingestor`` feeding this table (context manager)."""
    self._check_open("ingestor")
    return Ingestor(self, **kwargs)
