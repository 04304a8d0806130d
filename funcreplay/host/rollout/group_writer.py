"""``GroupWriter``: rollout groups assembled from responses that arrive one by one.

In GRPO-style training one table item is a *group*: G responses to one prompt. The
responses come from different inference workers, in any order and interleaved with
other groups. ``GroupWriter.add(group_id, response)`` (thread-safe, from any producer)
collects them; a group is inserted as one item when its G-th response arrives, or,
past ``timeout_s`` since its first response, with the responses it has, a ``mask``
and the ``partial`` status (a background thread checks deadlines every
``poll_s``). A response for a group already inserted is *late*: it is refused
(``add`` returns False) and counted, never dropped silently. A group whose insert
raises is counted as ``failed`` and the error reaches the caller (``add`` / ``flush``
raise it; a timed-out group's, from the background thread, is raised once, by the next
``add`` / ``flush`` / ``close``, after which the writer goes on).

The default assembly (``assemble_group``) maps response leaves to group leaves by
name, over a dict signature: a ``Ragged`` group leaf concatenates the responses'
1-D values (with ``<name>_lengths`` int32[G], if declared, saying where each ends); a
dense group leaf ``[G, ...]`` stacks them (zeros for missing responses); ``mask``
bool[G], if declared, marks the responses present. Pass ``assemble=`` for anything
else (a function ``(responses: list of G entries, None where missing) -> item``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from typing import Any, Callable, Dict, Hashable, Optional

import numpy as np

from funcreplay.core import numerics
from funcreplay.core.columns import Ragged
from funcreplay.host.validation import check_timeout

RECENT = 65_536  # completed group ids remembered to recognise late responses


@dataclasses.dataclass
class GroupStats:
  """Counters of a ``GroupWriter``."""

  responses: int = 0
  complete: int = 0       # groups inserted with all G responses
  partial: int = 0        # groups inserted at their timeout, masked
  failed: int = 0         # groups whose insert raised (the caller got the error): not stored
  late: int = 0           # responses refused: their group was already inserted (or failed)
  pending: int = 0        # groups not stored yet: collecting, or being inserted
  dropped: int = 0        # groups discarded incomplete by ``close(flush=False)``
  # Every group begun is in exactly one of complete, partial, failed, pending, dropped.


def assemble_group(spec, group_size: int):
  """The default assembly for ``spec`` (a dict signature; see the module docstring)."""
  tree = spec.item_tree
  if not isinstance(tree, dict):
    raise TypeError("GroupWriter: the default assembly needs a dict signature; pass "
                    "assemble=fn(responses) -> item.")
  for name, leaf in tree.items():
    if isinstance(leaf, Ragged) or name == "mask" or (
        name.endswith("_lengths") and isinstance(tree.get(name[:-8]), Ragged)):
      continue
    if not hasattr(leaf, "shape") or not leaf.shape or leaf.shape[0] != group_size:
      raise ValueError(f"GroupWriter: group leaf {name!r} must be Ragged or have a leading "
                       f"axis of the group size {group_size}, got {leaf}.")

  def assemble(responses):
    """The group's item from its (checked, ``check_response``) responses, None for absent."""
    item = {}
    present = [r is not None for r in responses]
    for name, leaf in tree.items():
      if name == "mask":
        item[name] = np.asarray([present], bool)
      elif isinstance(leaf, Ragged):
        rows = [np.asarray(r[name], leaf.dtype) for r in responses if r is not None]
        item[name] = [np.concatenate(rows) if rows else np.zeros((0,), leaf.dtype)]
      elif name.endswith("_lengths") and isinstance(tree.get(name[:-8]), Ragged):
        item[name] = np.asarray([[0 if r is None else len(r[name[:-8]]) for r in responses]],
                                leaf.dtype)
      else:
        out = np.zeros((1, *leaf.shape), leaf.dtype)
        for i, r in enumerate(responses):
          if r is not None:
            out[0, i] = r[name]
        item[name] = out
    return item

  return assemble


# Input dtype kinds each leaf kind takes (numpy dtype.kind): a response converts only
# where no value changes (as Table.insert's rule for Python scalars).
_KINDS = {"b": "b", "i": "iu", "u": "iu", "f": "iuf", "c": "iufc"}


def _lossless(value, dtype, what: str) -> np.ndarray:
  """``value`` as an array of ``dtype`` if no value changes; else a clear error."""
  a = np.asarray(value)
  d = np.dtype(dtype)
  if a.dtype == d or (a.size == 0 and a.dtype != object):  # ([] is float64: no value)
    return a.astype(d, copy=False)
  if a.dtype == object or a.dtype.kind not in _KINDS[d.kind]:
    raise TypeError(f"{what}: expected {d.name} values, got {a.dtype.name}: converting would "
                    f"change them. Cast it first (e.g. np.asarray(x, np.{d.name})).")
  with np.errstate(over="ignore", invalid="ignore"):
    b = a.astype(d)
  if d.kind in "iu":
    bad = numerics.beyond(a, d)
    if bad:
      info = np.iinfo(d)
      raise ValueError(f"{what}: values in [{bad[0]}, {bad[1]}] do not fit "
                       f"{d.name} ([{info.min}, {info.max}]).")
  elif a.dtype.kind in "iu" and np.any(b.astype(a.dtype) != a):
    raise ValueError(f"{what}: integers beyond {d.name}'s exact range would change.")
  elif np.any(np.isfinite(a) & ~np.isfinite(b)):
    raise ValueError(f"{what}: finite values beyond {d.name}'s range would become inf.")
  return b


def check_response(spec):
  """``fn(response) -> response``: the default assembly's check of one response (a dict
  with each group leaf's value for one member), its values converted losslessly to the
  leaf dtypes; raises naming the leaf. ``GroupWriter.add`` runs it before taking the
  response, so a bad one is refused where it is added."""
  tree = spec.item_tree

  def check(response):
    if not isinstance(response, dict):
      raise TypeError(f"GroupWriter.add: a response is a dict of leaf values, got "
                      f"{type(response).__name__}.")
    out = dict(response)
    for name, leaf in tree.items():
      if name == "mask" or (name.endswith("_lengths") and isinstance(tree.get(name[:-8]),
                                                                      Ragged)):
        continue
      if name not in response:
        raise ValueError(f"GroupWriter.add: the response has no leaf {name!r} (it has "
                         f"{sorted(response)}).")
      what = f"GroupWriter.add: leaf {name!r}"
      want = (None,) if isinstance(leaf, Ragged) else tuple(leaf.shape[1:])
      v = _lossless(response[name], leaf.dtype, what)
      if (v.ndim != 1) if isinstance(leaf, Ragged) else (v.shape != want):
        shape = "[n] (one member's values)" if isinstance(leaf, Ragged) else list(want)
        raise ValueError(f"{what}: expected shape {shape}, got {list(v.shape)}.")
      out[name] = v
    return out

  return check


class _Group:
  __slots__ = ("responses", "n", "deadline", "version", "metadata", "payloads")

  def __init__(self, g, deadline, metadata):
    self.responses = [None] * g
    self.n = 0
    self.deadline = deadline
    self.version = None
    self.metadata = metadata
    self.payloads = [None] * g


class GroupWriter:
  """Collect responses by group id from many producers; insert each group once.

  Args:
    table: the ``fr.Table`` (or anything with its ``insert`` and ``spec``).
    group_size: G responses per group.
    timeout_s: insert a group this long after its first response even if incomplete
      (None: wait for all G; ``flush()`` inserts the incomplete ones).
    status_column / complete / partial: the metadata column and values marking complete
      and timed-out groups (None: no status column).
    assemble: ``fn(responses) -> item`` (a batch of one); default ``assemble_group``.
    poll_s: how often the background thread checks deadlines.
    insert_timeout: passed to ``table.insert`` (rate limiters).
  """

  def __init__(self, table, group_size: int, *, timeout_s: Optional[float] = None,
               status_column: Optional[str] = "status", complete: Any = "completed",
               partial: Any = "aborted", assemble: Optional[Callable] = None,
               poll_s: float = 0.05, insert_timeout: Optional[float] = 60.0):
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
      raise ValueError(f"GroupWriter: group_size must be an int >= 1, got {group_size!r}.")
    if timeout_s is not None and not timeout_s > 0:
      raise ValueError(f"GroupWriter: timeout_s must be None or > 0, got {timeout_s!r}.")
    # Checked here, not first by the insert of the first group to complete (which raised,
    # and that group was lost); a poll of 0 s made the deadline thread spin a core.
    try:
      insert_timeout = check_timeout(insert_timeout)
    except ValueError:
      raise ValueError(f"GroupWriter: insert_timeout must be None (wait forever) or a number "
                       f"of seconds >= 0, got {insert_timeout!r}.") from None
    if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) \
        or not 0 < poll_s < math.inf:
      raise ValueError(f"GroupWriter: poll_s must be a finite number of seconds > 0, got "
                       f"{poll_s!r}.")
    if status_column is not None and status_column not in table.spec.metadata:
      raise ValueError(f"GroupWriter: status_column {status_column!r} is not a metadata column "
                       f"of the table ({list(table.spec.metadata)}); pass status_column=None.")
    self._table = table
    self._g = group_size
    self._timeout = timeout_s
    self._status = status_column
    self._values = (complete, partial)
    self._assemble = assemble or assemble_group(table.spec, group_size)
    # The default assembly's responses are checked where added; a custom one's item is
    # checked by the table's insert.
    self._check = None if assemble else check_response(table.spec)
    self._payloads = bool(getattr(table, "keeps_payloads", False))
    self._insert_timeout = insert_timeout
    self._groups: Dict[Hashable, _Group] = {}
    self._recent: collections.OrderedDict = collections.OrderedDict()
    self._stats = GroupStats()
    self._inserting = 0  # groups taken out of _groups whose insert has not ended
    self._lock = threading.Lock()
    # Notified when an insert ends (``_inserting`` falls): close() waits for those in flight.
    self._inserted = threading.Condition(self._lock)
    self._error: Optional[BaseException] = None
    self._closed = threading.Event()
    self._thread = None
    if timeout_s is not None:
      self._poll = float(poll_s)
      self._thread = threading.Thread(target=self._reap, name="funcreplay-group-writer",
                                      daemon=True)
      self._thread.start()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def add(self, group_id: Hashable, response: Any, *, version: Optional[int] = None,
          metadata: Optional[dict] = None, payload: Any = None) -> bool:
    """Add one response (a dict of one response's leaves) to group ``group_id``.

    ``version``: the policy version that produced it (the group gets its responses'
    lowest: the stalest); ``metadata``: the group's columns (the first response's
    count); ``payload``: kept per response, the group's payload is their list (tables
    with ``payloads=True``). Returns False for a late response (its group was already
    inserted; counted in ``stats().late``). The call that completes a group inserts it;
    if that insert (or the assembly) raises, the error propagates from this call and the
    group is counted in ``stats().failed``.
    """
    self._raise_pending()
    if payload is not None and not self._payloads:
      raise ValueError("GroupWriter.add: a payload needs a table that keeps them, "
                       "fr.Table(spec, payloads=True); this one would drop it.")
    if self._check is not None:
      response = self._check(response)
    with self._lock:
      # Under the lock, which close() takes to set the flag: a group begun here is then
      # always seen by close()'s flush (checked before the lock, one could be left behind).
      if self._closed.is_set():
        raise RuntimeError("GroupWriter.add: the writer is closed.")
      if group_id in self._recent:
        self._stats.late += 1
        return False
      grp = self._groups.get(group_id)
      if grp is None:
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        grp = self._groups[group_id] = _Group(self._g, deadline, dict(metadata or {}))
      i = grp.n
      grp.responses[i], grp.payloads[i] = response, payload
      grp.n += 1
      if version is not None:
        grp.version = version if grp.version is None else min(grp.version, version)
      self._stats.responses += 1
      done = grp.n == self._g
      if done:
        self._finish_locked(group_id)
    if done:
      self._insert(grp, complete=True)
    return True

  def flush(self) -> int:
    """Insert every incomplete group now (masked, ``partial``); returns how many.

    Every group is tried; if inserts raise, the others still go in, the failures are
    counted (``stats().failed``) and the first error is raised after the last insert.
    Else a failed insert of the deadline thread not yet reported is raised here."""
    with self._lock:
      ids = list(self._groups)
      groups = [self._finish_locked(g) for g in ids]
    error = self._insert_all(groups)
    if error is not None:
      raise error
    self._raise_pending()
    return len(groups)

  def close(self, flush: bool = True) -> None:
    """Stop the deadline thread; insert (``flush=True``) or drop (counted in
    ``stats().dropped``) the incomplete groups.

    Returns once every group's insert has ended, those that other threads' ``add`` calls
    began included (each waits at most ``insert_timeout``; a ``TimeoutError`` says how
    many are still running after it)."""
    with self._lock:  # see add
      if self._closed.is_set():
        return
      self._closed.set()
    if self._thread is not None:
      self._thread.join(timeout=10.0)
    if flush:
      self.flush()
    else:  # counted, not left as pending forever
      with self._lock:
        self._stats.dropped += len(self._groups)
        self._groups.clear()
    limit = None if self._insert_timeout is None else self._insert_timeout + 1.0
    with self._inserted:
      if not self._inserted.wait_for(lambda: self._inserting == 0, timeout=limit):
        raise TimeoutError(f"GroupWriter.close: {self._inserting} group inserts begun by "
                           f"other threads still running after {limit} s.")
    self._raise_pending()

  def stats(self) -> GroupStats:
    with self._lock:
      return dataclasses.replace(self._stats, pending=len(self._groups) + self._inserting)

  # -- internals ------------------------------------------------------------------------
  def _finish_locked(self, group_id) -> _Group:
    grp = self._groups.pop(group_id)
    self._inserting += 1  # still pending until its insert ends (``_insert``)
    self._recent[group_id] = None
    if len(self._recent) > RECENT:
      self._recent.popitem(last=False)
    return grp

  def _insert(self, grp: _Group, *, complete: bool) -> None:
    try:
      item = self._assemble(grp.responses)
      meta = dict(grp.metadata)
      if self._status is not None:
        meta[self._status] = self._values[0 if complete else 1]
      kwargs = dict(version=grp.version, metadata=meta, timeout=self._insert_timeout)
      if self._payloads:
        kwargs["payload"] = [list(grp.payloads[:grp.n])]
      self._table.insert(item, **kwargs)
    except BaseException:
      # The group has left ``_groups`` (its id is in ``_recent``): count it, so that
      # complete + partial + failed + pending accounts for every group begun.
      with self._lock:
        self._inserting -= 1
        self._stats.failed += 1
        self._inserted.notify_all()
      raise
    with self._lock:
      self._inserting -= 1
      self._inserted.notify_all()
      if complete:
        self._stats.complete += 1
      else:
        self._stats.partial += 1

  def _insert_all(self, groups) -> Optional[BaseException]:
    """Insert the finished incomplete ``groups``, each tried; the first error, if any."""
    error = None
    for grp in groups:
      try:
        self._insert(grp, complete=False)
      except BaseException as e:  # noqa: BLE001 (counted in _insert; returned to raise)
        error = error or e
    return error

  def _reap(self) -> None:
    while not self._closed.wait(self._poll):
      now = time.monotonic()
      with self._lock:
        ids = [g for g, grp in self._groups.items() if grp.deadline <= now]
        groups = [self._finish_locked(g) for g in ids]
      error = self._insert_all(groups)
      if error is not None:
        # Raised once, by the next add / flush / close; the thread goes on, so that no
        # group stays pending past its deadline (each failure is counted in stats().failed).
        with self._lock:
          self._error = self._error or error

  def _raise_pending(self) -> None:
    """Raise the deadline thread's first unreported insert error, once (then it is
    reported: later calls proceed)."""
    with self._lock:
      error, self._error = self._error, None
    if error is not None:
      raise RuntimeError(f"GroupWriter: inserting a timed-out group failed: {error!r}") \
          from error
