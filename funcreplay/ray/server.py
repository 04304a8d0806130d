"""The replay actor: one host ``Table`` (and its checkpointer) served to other processes.

``TableServer`` is a plain class; ``actor_class()`` turns it into a Ray actor class on
first use (so ``import funcreplay.ray`` works, and costs nothing, without Ray). The
actor is *threaded*, with one Ray concurrency group per kind of call
(``CONCURRENCY_GROUPS``), because the host ``Table`` already does the waiting:

* ``insert`` (one thread): inserts, the writers' batches included, run one at a
  time in arrival order, so a producer's batches go in in the order it shipped
  them; one blocked by the rate limiter blocks the others, as locally;
* ``sample`` (several threads): a sample waiting for items or for the rate
  limiter waits on the table's condition without blocking inserts or queries;
* ``control``: priorities, versions, counts, stats, checkpoints -- never queued
  behind a blocked insert or sample;
* ``run``: functions run in the actor's process with the ``Table`` itself (a
  colocated learner: no copies, no object store).

Calls that may block carry the caller's *deadline* (wall clock), so a call that
waited in the actor's queue past its caller's timeout fails there without
touching the table instead of inserting or sampling after the caller gave up.

Restarts: with ``checkpoint_dir`` the actor restores the newest checkpoint there
when it starts (a Ray restart after a crash, ``max_restarts``, runs ``__init__``
again), and a ``PeriodicCheckpointer`` keeps saving into it.
"""

from __future__ import annotations

import functools
import os
import time
import types
import warnings
from typing import Any, Callable, Optional

import jax
import numpy as np

import funcreplay.checkpoint  # noqa: F401  (registers Table.save / restore / load)
from funcreplay.checkpoint import layout as ckpt_layout
from funcreplay.checkpoint.periodic import PeriodicCheckpointer
from funcreplay.checkpoint.spec_codec import spec_from_json, spec_to_json
from funcreplay.core import packing
from funcreplay.host.table import Table
from funcreplay.ray.cancel import Cancellations

# Threads per Ray concurrency group (see the module doc). One insert thread keeps each
# producer's batches in order; samplers get several so that blocked learners (and
# prefetched samples) never starve each other; control calls never wait behind either.
# A writer's row without an explicit version (the table's version when it goes in): outside
# int32, so no real version collides with it.
NO_VERSION = -(2**40)
# How far past the caller's deadline a call that waited in the queue may still wait on the
# table: half the client's reply margin (client.RPC_SLACK_S = 30 s), so the reply still
# arrives before the caller stops waiting for it.
QUEUE_MARGIN_S = 15.0
CONCURRENCY_GROUPS = {"insert": 1, "sample": 8, "control": 4, "run": 2}
METHOD_GROUPS = {
    "insert": "insert", "insert_batch": "insert",
    "sample": "sample",
    "info": "control", "update_priorities": "control", "set_version": "control",
    "count": "control", "stats": "control", "size": "control", "save": "control",
    "checkpoint_now": "control", "evict_stale": "control", "delete": "control",
    "close": "control", "cancel": "control",
    "run": "run",
}


def remaining(deadline: Optional[float], timeout: Optional[float], what: str) -> Optional[float]:
  """The table timeout for a call with the caller's wall-clock ``deadline`` and ``timeout``.

  The table gets the caller's own ``timeout`` (so its errors read as they do locally), cut
  only where the queue wait would make the reply miss the caller's ``RPC_SLACK_S`` margin.
  A call that reaches the actor after its deadline still tries once, as a local call blocked
  on the table's lock does (``timeout=0``, or one shorter than the call's transit, always
  failed here): ``TimeoutError`` only if it waited in the queue ``QUEUE_MARGIN_S`` past the
  deadline, when its reply could miss the caller's wait.
  """
  if deadline is None:
    return timeout
  left = deadline - time.time() + QUEUE_MARGIN_S
  if left < 0:
    raise TimeoutError(f"{what}: the call waited {-left + QUEUE_MARGIN_S + (timeout or 0.0):.3f}"
                       " s in the replay actor's queue (behind other blocked calls), past its "
                       "timeout, before it ran; the table was not touched. Pass a larger timeout.")
  return timeout if timeout is None else min(timeout, left)


def check_servable(spec, what: str) -> None:
  """Refuse a spec the replay actor cannot serve, up front (``ValueError``).

  Ragged leaves (``fr.Ragged``) live in the host ``Table``'s arenas, beside the state:
  ``sample`` ships a batch as one packed buffer of fixed-shape arrays, which cannot carry
  them (``Table.sample_packed`` refuses such tables), and the rollout API (``take_batch``,
  ``is_ready``, ``count_by``, ``peek``) is not served. Better said at ``connect`` than at the
  first sample. (Payloads, ``Table(payloads=True)``, cannot be asked for through ``connect``.)
  """
  if spec.ragged:
    leaves = ", ".join(spec.signature.names[i] for i, _ in spec.ragged)
    raise ValueError(
        f"{what}: the spec has ragged leaves ({leaves}), which the replay actor does not serve "
        "yet: samples travel as one packed buffer of fixed-shape arrays, and take_batch / "
        "is_ready / count_by / peek are not served. Use a host funcreplay.Table in one process "
        "for ragged rollouts, or store them padded in a fixed-shape leaf (plus a length leaf).")


class TableServer:
  """The body of the replay actor (see the module doc); methods mirror ``Table``'s."""

  def __init__(self, spec_json: str, name: str, *, checkpoint_dir: Optional[str] = None,
               checkpoint_every_s: Optional[float] = None,
               checkpoint_every_inserts: Optional[int] = None, checkpoint_keep_last: int = 3,
               seed: int = 0, token: Optional[str] = None):
    # The spec travels as its checkpoint JSON (TableSpec objects do not pickle).
    spec = spec_from_json(spec_json)
    check_servable(spec, f"the replay actor {name!r}")
    self._name = name
    # Who created this actor (connect's one-off token) and with which seed: a later
    # get-or-create that finds it names the options it cannot apply (client.connect).
    self._creation = dict(token=token, seed=seed)
    self._restored_from = None
    latest = ckpt_layout.latest(checkpoint_dir) if checkpoint_dir and \
        os.path.isdir(checkpoint_dir) else None
    if latest is not None:
      self._table = Table.restore(checkpoint_dir, spec=spec)  # the newest; spec checked
      self._restored_from = latest
    else:
      self._table = Table(spec, seed=seed)
    self._ckpt = None
    self._ckpt_dir = checkpoint_dir
    self._keep_last = checkpoint_keep_last
    # What connect() compares a later caller's checkpoint options with (info()).
    self._ckpt_options = dict(checkpoint_dir=checkpoint_dir, checkpoint_every_s=checkpoint_every_s,
                              checkpoint_every_inserts=checkpoint_every_inserts,
                              checkpoint_keep_last=checkpoint_keep_last)
    if checkpoint_dir and (checkpoint_every_s is not None or checkpoint_every_inserts is not None):
      self._ckpt = PeriodicCheckpointer(self._table, checkpoint_dir, every_s=checkpoint_every_s,
                                        every_inserts=checkpoint_every_inserts,
                                        keep_last=checkpoint_keep_last)
    self._spec_json = spec_to_json(self._table.spec)
    self._started = time.time()
    self._cancellations = Cancellations()  # of closed Prefetchers' sample calls

  # -- inserts (group "insert") -----------------------------------------------------------
  def insert(self, items, version=None, priority=None, metadata=None, timeout=None,
             deadline=None) -> int:
    """``Table.insert``; returns the number of items inserted."""
    t = remaining(deadline, timeout, "Table.insert")
    try:
      self._table.insert(items, version=version, priority=priority, metadata=metadata,
                         timeout=t)
    finally:
      self._cancellations.wake()
    return len(jax.tree_util.tree_leaves(items)[0])

  def insert_batch(self, leaves, version, priority, metadata) -> int:
    """A writer's batch: stacked leaves ``[n, ...]``; ``version`` int64[n] with ``NO_VERSION`` for
    "the table's version at insertion" (or None: all); ``priority`` float32[n] with NaN for
    "the default priority" (or None: all); ``metadata`` column -> int32[n], float32[n] for a
    float column (or None).

    Waits as long as the rate limiter forbids the inserts (back-pressure: the writer
    bounds its unacknowledged batches); ``close()`` ends the wait with
    ``TableClosedError``, whose ``inserted`` says how many rows went in.
    """
    try:
      return self._insert_batch(leaves, version, priority, metadata)
    finally:
      self._cancellations.wake()

  def _insert_batch(self, leaves, version, priority, metadata) -> int:
    table = self._table
    n = int(leaves[0].shape[0])
    if version is not None:
      version = np.where(version == NO_VERSION, table.version, version).astype(np.int32)
    items = jax.tree_util.tree_unflatten(table.spec.signature.treedef, list(leaves))
    if priority is None or not np.isnan(priority).any():
      self._insert_rows(items, version, priority, metadata, 0, n, n)
      return n
    # Rows with and without explicit priorities: the default priority applies per
    # call (Table.insert), so each run goes in separately, in order.
    has = ~np.isnan(priority)
    start = 0
    for i in range(1, n + 1):
      if i == n or has[i] != has[start]:
        self._insert_rows(items, version, priority if has[start] else None, metadata, start, i,
                          n)
        start = i
    return n

  def _insert_rows(self, items, version, priority, metadata, a, b, n):
    if (a, b) != (0, n):
      items = jax.tree_util.tree_map(lambda x: x[a:b], items)
      version = None if version is None else version[a:b]
      priority = None if priority is None else priority[a:b]
      metadata = None if metadata is None else {k: v[a:b] for k, v in metadata.items()}
    try:
      self._table.insert(items, version=version, priority=priority, metadata=metadata)
    except Exception as e:  # noqa: BLE001 (re-raised with the rows of the batch that went in)
      e.inserted = a + getattr(e, "inserted", 0)
      raise

  # -- sampling (group "sample") ----------------------------------------------------------
  def sample(self, batch_size, version=None, where=None, timeout=None, deadline=None,
             replace=False, min_valid=None, tag=None):
    """A ``PackedSample`` over a numpy buffer (one array through the object store), or a
    ``Sample`` of numpy arrays where the items cannot be packed. ``tag``: a ``Prefetcher``'s
    (``cancel``): None, nothing sampled, once that one is closed (``ray/cancel.py``)."""
    t = remaining(deadline, timeout, "Table.sample")
    if tag is None:
      return self._sample(batch_size, version, where, t, replace, min_valid)
    return self._cancellations.run(tag, lambda t0: self._sample(
        batch_size, version, where, t0, replace, min_valid), t)

  def cancel(self, tag: str) -> None:
    """The sample calls of ``tag`` (a closed ``Prefetcher``'s) take nothing from now on."""
    self._cancellations.cancel(tag)

  def _sample(self, batch_size, version, where, t, replace, min_valid):
    table = self._table
    if packing.packable(table.spec.signature) is None:
      # The reply buffer, written in place where the table allows it, for a batch the table
      # can take (up to the capacity): any other size is the table's to check first (it
      # allocated gigabytes for a batch_size of 2**31 before the table refused it).
      fits = isinstance(batch_size, int) and not isinstance(batch_size, bool) \
          and 1 <= batch_size <= table.spec.capacity
      out = np.empty(packing.layout(table.spec.signature, batch_size).nbytes, np.uint8) \
          if fits else None
      try:
        smp = table.sample_packed(batch_size, version=version, where=where, timeout=t,
                                  replace=replace, min_valid=min_valid, out=out)
      except Exception as e:  # noqa: BLE001 (re-raised as Table.sample's own error)
        # The caller called sample: its errors name Table.sample, as locally.
        e.args = tuple(a.replace("Table.sample_packed", "Table.sample") if isinstance(a, str)
                       else a for a in e.args)
        raise
      return packing.PackedSample(np.asarray(smp.buffer) if out is None else out, smp.layout)
    smp = table.sample(batch_size, version=version, where=where, timeout=t, replace=replace,
                       min_valid=min_valid)
    return jax.tree_util.tree_map(np.asarray, smp)

  # -- control (group "control") ----------------------------------------------------------
  def info(self) -> dict:
    import ray  # in the actor's process, Ray is there
    ctx = ray.get_runtime_context()
    with warnings.catch_warnings():  # Ray 2.60 warns about its own use of a deprecated API
      warnings.simplefilter("ignore", DeprecationWarning)
      restarted = bool(ctx.was_current_actor_reconstructed)
    return dict(name=self._name, spec_json=self._spec_json,
                pid=os.getpid(), node_id=ctx.get_node_id(), restarted=restarted,
                restored_from=self._restored_from, version=self._table.version,
                size=self._table.size, started=self._started,
                checkpoint_options=dict(self._ckpt_options), creation=dict(self._creation))

  def update_priorities(self, slots, keys, priorities) -> None:
    self._table.update_priorities(slots, keys, priorities)
    self._cancellations.wake()

  def set_version(self, version) -> None:
    self._table.set_version(version)
    self._cancellations.wake()

  def count(self, where=None, version=None) -> int:
    return self._table.count(where, version)

  def size(self) -> int:
    return self._table.size

  def stats(self) -> dict:
    return self._table.stats().to_dict()

  def evict_stale(self, version=None) -> int:
    return self._table.evict_stale(version)

  def delete(self, slots, keys) -> None:
    self._table.delete(slots, keys)

  def save(self, path) -> str:
    return self._table.save(path)

  def checkpoint_now(self) -> str:
    """Save a numbered checkpoint into ``checkpoint_dir`` now (what a restart restores)."""
    if self._ckpt is not None:
      return self._ckpt.save_now()
    if not self._ckpt_dir:
      raise ValueError(f"checkpoint_now: the replay actor {self._name!r} has no checkpoint_dir; "
                       "pass checkpoint_dir= to funcreplay.ray.connect when creating it.")
    from funcreplay.checkpoint.host import save_table
    return save_table(self._table, self._ckpt_dir, keep_last=self._keep_last)

  def close(self, final_save: bool = False) -> None:
    """Stop the checkpointer (saving once more if asked) and close the table: every waiting
    call ends with ``TableClosedError``. ``final_save`` without a ``checkpoint_dir`` is
    refused, the table left open (it returned as if saved)."""
    if final_save and self._ckpt is None and not self._ckpt_dir:
      raise ValueError(f"close(final_save=True): the replay actor {self._name!r} has no "
                       "checkpoint_dir, so there is nowhere to save; the table stays open. "
                       "Close with final_save=False, or save() to a directory first.")
    try:
      if self._ckpt is not None:
        self._ckpt.close(final_save=final_save)
      elif final_save and self._ckpt_dir:
        self.checkpoint_now()
    finally:
      self._table.close()

  # -- colocated code (group "run") -------------------------------------------------------
  def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``fn(table, *args, **kwargs)`` in the actor's process, with the ``Table`` itself."""
    return fn(self._table, *args, **kwargs)


def _copy_function(fn):
  """A copy of ``fn`` (same code, defaults, signature) that Ray may annotate."""
  new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                           fn.__closure__)
  new.__kwdefaults__ = fn.__kwdefaults__
  new.__doc__, new.__qualname__, new.__module__ = fn.__doc__, fn.__qualname__, fn.__module__
  return new


@functools.lru_cache(maxsize=None)
def actor_class():
  """The Ray actor class around ``TableServer`` (built once per process)."""
  import ray
  attrs = {name: ray.method(concurrency_group=group)(_copy_function(getattr(TableServer, name)))
           for name, group in METHOD_GROUPS.items()}
  cls = type("FuncreplayTable", (TableServer,), attrs)
  return ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(cls)
