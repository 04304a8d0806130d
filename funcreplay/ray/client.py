"""``connect`` and ``RemoteTable``: a host ``Table`` served by a named Ray actor.

Every call is a Ray actor call bounded by a timeout: the table's own (``insert``
/ ``sample`` with ``timeout=``, passed to the actor, which waits on the table's
condition as a local caller would) plus ``RPC_SLACK_S`` for the transfer,
``SAVE_TIMEOUT_S`` for saves, or ``rpc_timeout`` for the other calls (``run``
included; each takes ``timeout=``). Errors come back as
the table raised them (same type, same message: ``ValueError`` naming the leaf,
``TimeoutError`` naming the rate limiter, ``TableClosedError``), with a note
saying they were raised in the actor; an actor that is gone gives
``TableUnavailableError`` instead of a hang.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Callable, Optional

from funcreplay.checkpoint.spec_codec import spec_from_json, spec_to_json
from funcreplay.core.spec import TableSpec
from funcreplay.host import validation
from funcreplay.ray import server
from funcreplay.ray.calls import (
  KILL_WAIT_S,
  RPC_SLACK_S,
  RPC_TIMEOUT_S,
  SAVE_TIMEOUT_S,
  as_sample,
  require_ray,
  wait_dead,
  wait_reply,
)
from funcreplay.ray.errors import TableUnavailableError
from funcreplay.ray.prefetch import Prefetcher
from funcreplay.ray.writer import RemoteWriter


def connect(name: str, spec: Optional[TableSpec] = None, *, namespace: Optional[str] = None,
            checkpoint_dir: Optional[str] = None, checkpoint_every_s: Optional[float] = None,
            checkpoint_every_inserts: Optional[int] = None,
            checkpoint_keep_last: Optional[int] = None,
            seed: int = 0, rpc_timeout: float = RPC_TIMEOUT_S,
            **actor_options) -> "RemoteTable":
  """A ``RemoteTable`` for the replay actor ``name`` (created if ``spec`` is given and it is
  not there yet; ``ReplayBufferInterface``-style get-or-create).

  Args:
    name: the actor's name (unique in its namespace).
    spec: the ``TableSpec`` to create it with; None: attach to an existing actor
      (``LookupError`` if there is none). If the actor exists, its spec must equal
      ``spec`` (``ValueError`` listing both otherwise). Ragged leaves are refused (``ValueError``:
      not served yet, see ``server.check_servable``).
    namespace: Ray namespace of the actor (None: the current job's). Processes of other
      jobs (another driver, another machine) find the actor only under a namespace they
      name too.
    checkpoint_dir: directory of numbered checkpoints: on start (and on every restart
      after a crash, ``max_restarts=``) the actor restores the newest one there.
    checkpoint_every_s / checkpoint_every_inserts: run a ``PeriodicCheckpointer`` into
      ``checkpoint_dir``; ``checkpoint_keep_last`` checkpoints are kept (None: 3). These
      apply when the actor is created; given for an actor that exists with others, they
      are named in a ``RuntimeWarning`` (the actor's hold).
    seed: the table's PRNG seed (a restored table continues its saved key).
    rpc_timeout: seconds to wait for replies to calls that do not wait on the table.
    **actor_options: Ray actor options (``num_cpus``, ``num_gpus``, ``resources``,
      ``max_restarts``, ``lifetime="detached"``, ``scheduling_strategy``, ...).

  Starts a local Ray cluster when Ray is not initialized (``ray.init()``'s default).
  """
  ray = require_ray()
  if not isinstance(name, str) or not name:
    raise ValueError(f"funcreplay.ray.connect: name must be a non-empty string, got {name!r}.")
  rpc_timeout = validation.check_timeout(rpc_timeout)
  if not ray.is_initialized():
    ray.init(namespace=namespace)
  where = f"namespace {namespace!r}" if namespace is not None else "the current namespace"
  if spec is None:
    for what, v in (("checkpoint_dir", checkpoint_dir), ("checkpoint_every_s", checkpoint_every_s),
                    ("checkpoint_every_inserts", checkpoint_every_inserts)):
      if v is not None:
        raise ValueError(f"funcreplay.ray.connect: {what}= only applies when creating the actor "
                         "(pass spec= too).")
    if actor_options:
      raise ValueError(f"funcreplay.ray.connect: actor options {sorted(actor_options)} only "
                       "apply when creating the actor (pass spec= too).")
    try:
      handle = ray.get_actor(name, namespace=namespace)
    except ValueError:
      raise LookupError(f"funcreplay.ray.connect: no replay actor named {name!r} in {where}; "
                        "pass spec= to create it (or the namespace it was created in).") from None
  else:
    if not isinstance(spec, TableSpec):
      raise TypeError(f"funcreplay.ray.connect: spec must be a TableSpec, got "
                      f"{type(spec).__name__}.")
    server.check_servable(spec, "funcreplay.ray.connect")
    _check_checkpoint_options(checkpoint_dir, checkpoint_every_s, checkpoint_every_inserts,
                              checkpoint_keep_last)
    opts = dict(name=name, namespace=namespace, get_if_exists=True)
    opts.update(actor_options)
    token = uuid.uuid4().hex  # the actor records it: was it made by this call?
    handle = server.actor_class().options(**opts).remote(
        spec_to_json(spec), name, checkpoint_dir=checkpoint_dir,
        checkpoint_every_s=checkpoint_every_s,
        checkpoint_every_inserts=checkpoint_every_inserts,
        checkpoint_keep_last=3 if checkpoint_keep_last is None else checkpoint_keep_last,
        seed=seed, token=token)
  if not hasattr(handle, "info"):
    raise ValueError(f"funcreplay.ray.connect: the Ray actor named {name!r} in {where} is not "
                     "a funcreplay replay actor; use another name.")
  info = wait_reply(handle.info.remote(), rpc_timeout, "funcreplay.ray.connect", name)
  if spec is not None and spec_to_json(spec) != info["spec_json"]:
    raise ValueError(f"funcreplay.ray.connect: a replay actor named {name!r} already exists in "
                     f"{where} with another spec.\n  theirs: {spec_from_json(info['spec_json'])}"
                     f"\n  yours:  {spec}\n"
                     "Attach with spec=None, or use another name.")
  if spec is not None and info.get("creation", {}).get("token") != token:
    _warn_ignored_options(name, info, dict(
        checkpoint_dir=checkpoint_dir, checkpoint_every_s=checkpoint_every_s,
        checkpoint_every_inserts=checkpoint_every_inserts,
        checkpoint_keep_last=checkpoint_keep_last), seed, actor_options)
  return RemoteTable(handle, name, namespace, info, rpc_timeout)


def _check_checkpoint_options(directory, every_s, every_inserts, keep_last) -> None:
  """Refused here, not ignored: periodic saves without a directory (nothing was ever
  saved) and values ``PeriodicCheckpointer`` refuses (0 saved nothing; others failed the
  actor's constructor, which read as an unavailable actor)."""
  what = "funcreplay.ray.connect"
  if (every_s is not None or every_inserts is not None) and not directory:
    raise ValueError(f"{what}: checkpoint_every_s / checkpoint_every_inserts need "
                     "checkpoint_dir= (where the actor saves).")
  if every_s is not None and (isinstance(every_s, bool) or not isinstance(every_s, (int, float))
                              or not 0 < every_s < math.inf):
    raise ValueError(f"{what}: checkpoint_every_s must be a number of seconds > 0, got "
                     f"{every_s!r}.")
  for arg, v in (("checkpoint_every_inserts", every_inserts), ("checkpoint_keep_last", keep_last)):
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
      raise ValueError(f"{what}: {arg} must be an int >= 1, got {v!r}.")


def _warn_ignored_options(name: str, info: dict, given: dict, seed: int,
                          actor_options: dict) -> None:
  """Get-or-create found the actor made already: the options it was made with hold, and a
  caller's other ones (checkpoint options given, a seed or actor options) would go unused
  without a word."""
  import warnings
  theirs = info.get("checkpoint_options", {})
  differ = {k: v for k, v in given.items() if v is not None and theirs.get(k) != v}
  made_seed = info.get("creation", {}).get("seed")
  if actor_options or (made_seed is not None and made_seed != seed):
    warnings.warn(f"funcreplay.ray.connect: the replay actor {name!r} exists already; "
                  + (f"its seed {made_seed} holds, not yours ({seed}); " if made_seed != seed
                     else "")
                  + (f"your actor options {sorted(actor_options)} are not applied; "
                     if actor_options else "")
                  + "they apply when the actor is created.", RuntimeWarning, stacklevel=3)
  if differ:
    warnings.warn(f"funcreplay.ray.connect: the replay actor {name!r} exists already; its "
                  f"checkpoint options {theirs} hold, yours {differ} are not applied (they "
                  "apply when the actor is created).", RuntimeWarning, stacklevel=3)


class RemoteTable:
  """A client of the replay actor: ``Table``'s methods across processes and machines.

  Picklable: pass it to Ray tasks / actors (producers, learners); it travels as the
  actor handle. Thread-safe. Samples come back with numpy leaves (read-only views
  of the reply); ``writer()`` is the batching producer client, ``prefetch()`` the
  learner's iterator (``funcreplay.torch.RemoteTorchSampler`` for torch batches) and
  ``run(fn)`` runs ``fn(table)`` in the actor's process (a colocated learner).
  """

  def __init__(self, handle, name: str, namespace: Optional[str], info: dict,
               rpc_timeout: Optional[float] = RPC_TIMEOUT_S):
    self._actor = handle
    self.name = name
    self.namespace = namespace
    self.spec: TableSpec = spec_from_json(info["spec_json"])
    self.info = info
    self._rpc_timeout = rpc_timeout
    self._closed = False  # set by close(): this handle's later calls fail fast

  def __reduce__(self):
    return (RemoteTable, (self._actor, self.name, self.namespace, self.info, self._rpc_timeout))

  def __repr__(self) -> str:
    return (f"RemoteTable({self.name!r}, namespace={self.namespace!r}, "
            f"capacity={self.spec.capacity}, actor pid {self.info.get('pid')})")

  @property
  def actor(self):
    """The Ray actor handle."""
    return self._actor

  # -- calls ------------------------------------------------------------------------------
  def _call(self, method: str, *args, timeout: Optional[float] = "rpc", what: str = "",
            **kwargs) -> Any:
    ref = self.submit(method, *args, **kwargs)
    return wait_reply(ref, self._rpc_timeout if timeout == "rpc" else timeout,
                      what or f"RemoteTable.{method}", self.name)

  def submit(self, method: str, *args, **kwargs):
    """Submit actor method ``method`` (a ``TableServer`` method); its Ray ``ObjectRef``."""
    if self._closed:
      raise TableUnavailableError(f"RemoteTable.{method}: the replay actor {self.name!r} is gone "
                                  "(this handle closed it); connect() with a spec to make a new "
                                  "one.")
    try:
      return getattr(self._actor, method).remote(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (a dead handle may fail at submission)
      raise TableUnavailableError(f"RemoteTable.{method}: cannot reach the replay actor "
                                  f"{self.name!r}: {e}") from e

  @staticmethod
  def _blocking(timeout):
    """(the table's timeout, the caller's deadline, how long to wait for the reply)."""
    timeout = validation.check_timeout(timeout)
    if timeout is None:
      return None, None, None
    return timeout, time.time() + timeout, timeout + RPC_SLACK_S

  # -- Table's methods --------------------------------------------------------------------
  def insert(self, items, *, version=None, priority=None, metadata=None,
             timeout: Optional[float] = None) -> None:
    """``Table.insert`` in the actor (same arguments, errors and rate-limiter waits)."""
    t, deadline, wait = self._blocking(timeout)
    self._call("insert", items, version, priority, metadata, t, deadline, timeout=wait,
               what="Table.insert")

  def sample(self, batch_size: int, *, version: Optional[int] = None, where=None,
             timeout: Optional[float] = None, replace: bool = False,
             min_valid: Optional[int] = None):
    """``Table.sample`` in the actor; an ``fr.Sample`` of numpy arrays (read-only)."""
    return as_sample(self.sample_packed(batch_size, version=version, where=where,
                                        timeout=timeout, replace=replace, min_valid=min_valid))

  def sample_packed(self, batch_size: int, *, version=None, where=None,
                    timeout: Optional[float] = None, replace: bool = False, min_valid=None):
    """The batch as it travels: a ``PackedSample`` over one numpy buffer (or a ``Sample``
    of numpy arrays for items that cannot be packed)."""
    return wait_reply(self.sample_async(batch_size, version=version, where=where,
                                        timeout=timeout, replace=replace, min_valid=min_valid),
                      self._blocking(timeout)[2], "Table.sample", self.name)

  def sample_async(self, batch_size: int, *, version=None, where=None,
                   timeout: Optional[float] = None, replace: bool = False, min_valid=None,
                   deadline: bool = True, tag: Optional[str] = None):
    """Submit a sample; returns the Ray ``ObjectRef`` of its ``sample_packed`` result.
    ``tag``: cancellable by ``cancel(tag)`` until it samples (then it returns None)."""
    t, dl, _ = self._blocking(timeout)
    return self.submit("sample", batch_size, version, where, t, dl if deadline else None,
                        replace, min_valid, tag)

  def cancel(self, tag: str) -> None:
    """The sample calls submitted with ``tag`` that have not sampled yet take nothing
    (``Prefetcher.close``)."""
    self._call("cancel", tag, what="RemoteTable.cancel")

  def update_priorities(self, slots, keys, priorities) -> None:
    self._call("update_priorities", slots, keys, priorities, what="Table.update_priorities")

  def set_version(self, version: int) -> None:
    self._call("set_version", version, what="Table.set_version")

  update_model_version = set_version  # MineStudio's name

  @property
  def version(self) -> int:
    """The table's current policy version (one call)."""
    return self._call("info")["version"]

  def count(self, where=None, version: Optional[int] = None) -> int:
    return self._call("count", where, version, what="Table.count")

  @property
  def size(self) -> int:
    return self._call("size", what="Table.size")

  def __len__(self) -> int:
    return self.size

  def stats(self) -> dict:
    """``Table.stats().to_dict()``: size, counters (evictions by cause, ...), means."""
    return self._call("stats", what="Table.stats")

  def evict_stale(self, version: Optional[int] = None) -> int:
    return self._call("evict_stale", version, what="Table.evict_stale")

  def delete(self, slots, keys) -> None:
    self._call("delete", slots, keys, what="Table.delete")

  def save(self, path, *, timeout: Optional[float] = SAVE_TIMEOUT_S) -> str:
    """``Table.save(path)`` in the actor's process (``path`` on the actor's machine).

    ``timeout``: seconds to wait for the reply (``SAVE_TIMEOUT_S`` by default; None:
    forever); past it ``TimeoutError`` (the save may still finish in the actor)."""
    return self._call("save", path, timeout=validation.check_timeout(timeout), what="Table.save")

  def checkpoint_now(self, *, timeout: Optional[float] = SAVE_TIMEOUT_S) -> str:
    """A numbered checkpoint into the actor's ``checkpoint_dir`` now (what a restart restores);
    ``timeout`` as in ``save``."""
    return self._call("checkpoint_now", timeout=validation.check_timeout(timeout),
                      what="RemoteTable.checkpoint_now")

  def ping(self, timeout: Optional[float] = "rpc") -> dict:
    """The actor's ``info`` dict (pid, restarted, restored_from, version, size)."""
    info = self._call("info", timeout=timeout)
    self.info = info
    return info

  # -- clients ----------------------------------------------------------------------------
  def writer(self, **kwargs):
    """A batching producer client (``funcreplay.ray.RemoteWriter``; context manager)."""
    return RemoteWriter(self, **kwargs)

  def prefetch(self, batch_size: int, **kwargs):
    """An iterator keeping ``k`` samples in flight (``funcreplay.ray.Prefetcher``)."""
    return Prefetcher(self, batch_size, **kwargs)

  def run(self, fn: Callable[..., Any], *args, timeout: Optional[float] = "rpc", **kwargs):
    """``fn(table, *args, **kwargs)`` in the actor's process, with the host ``Table``
    itself: a colocated learner samples with no copy and no object store (e.g.
    ``funcreplay.torch.TorchSampler(table, ...)`` inside ``fn``). Returns its result.

    ``timeout``: seconds to wait for the result (default: ``rpc_timeout``; None: forever,
    for a long colocated training loop); past it ``TimeoutError`` (``fn`` keeps running in
    the actor: a timeout cannot stop it)."""
    wait = self._rpc_timeout if timeout == "rpc" else validation.check_timeout(timeout)
    return wait_reply(self.run_async(fn, *args, **kwargs), wait, "RemoteTable.run", self.name)

  def run_async(self, fn: Callable[..., Any], *args, **kwargs):
    """``run`` without waiting: the Ray ``ObjectRef`` of the result."""
    if not callable(fn):
      raise TypeError(f"RemoteTable.run: fn must be callable, got {type(fn).__name__}.")
    return self.submit("run", fn, args, kwargs)

  def close(self, *, final_save: bool = False, kill: bool = True,
            timeout: Optional[float] = "rpc") -> None:
    """Shut the service down: close the table (waiting calls end with
    ``TableClosedError``), optionally save a last checkpoint, then kill the actor (no
    restart) and wait (up to ``KILL_WAIT_S``) until Ray reports it dead, so that later
    calls, on this handle or any other, raise ``TableUnavailableError``. Idempotent."""
    ray = require_ray()
    if self._closed:
      return
    if final_save and not self.info.get("checkpoint_options", {}).get("checkpoint_dir"):
      # Refused before anything closes (the actor refuses it too, the table left open).
      raise ValueError(f"RemoteTable.close(final_save=True): the replay actor {self.name!r} "
                       "has no checkpoint_dir, so there is nowhere to save; nothing was closed. "
                       "Close with final_save=False, or save() to a directory first.")
    try:
      self._call("close", final_save, timeout=timeout, what="RemoteTable.close")
    except TableUnavailableError:
      pass  # already gone
    finally:
      if kill:
        self._closed = True
        try:
          ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: BLE001 (already dead)
          pass
        wait_dead(self._actor, KILL_WAIT_S)
