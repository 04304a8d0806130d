"""``PeriodicCheckpointer``: checkpoints of a host ``Table`` from a background thread."""

from __future__ import annotations

import os
import threading
import time
from typing import List, Optional

from funcreplay.checkpoint import host as host_lib
from funcreplay.host.guard import TableClosedError

_POLL_S = 0.05  # how often the inserts trigger is checked


class PeriodicCheckpointer:
  """Save ``table`` to ``directory/ckpt-<step>`` every ``every_s`` seconds and/or inserts.

  The thread calls ``save_table``: samplers and inserters wait only while the
  state is copied under the table's lock, never while files are written.
  Steps continue after the newest checkpoint already in ``directory``, and
  only the newest ``keep_last`` are kept.

  Args:
    table: a ``funcreplay.Table``.
    directory: where the numbered checkpoints go (created if missing).
    every_s: save when this many seconds passed since the last save.
    every_inserts: save when this many items were inserted since the last
      save (polled every 50 ms).
    keep_last: checkpoints to keep (>= 1).
    fsync: passed to ``save_table`` (False: safe against process crashes
      only, not power loss).
    payloads: passed to ``save_table`` (a table holding payloads: ``"pickle"`` or
      ``"drop"``; the default refuses, and the thread stops with that error).

  An error in the thread (disk full, ...) stops it; ``close()``, ``save_now()``
  and ``check()`` re-raise it. A closed table ends the thread quietly.
  Use as a context manager, or call ``close()``.

  Example::

    with PeriodicCheckpointer(table, "/ckpt/replay", every_s=600) as ckpt:
      train(table)
    table2 = fr.Table.restore("/ckpt/replay")       # newest checkpoint
  """

  def __init__(self, table, directory, *, every_s: Optional[float] = None,
               every_inserts: Optional[int] = None, keep_last: int = 3, fsync: bool = True,
               payloads: str = "refuse"):
    if every_s is None and every_inserts is None:
      raise ValueError("PeriodicCheckpointer: pass every_s= and/or every_inserts=.")
    if every_s is not None and (isinstance(every_s, bool) or not isinstance(every_s, (int, float))
                                or not every_s > 0):
      raise ValueError(f"PeriodicCheckpointer: every_s must be a number > 0, got {every_s!r}.")
    if every_inserts is not None and (isinstance(every_inserts, bool)
                                      or not isinstance(every_inserts, int) or every_inserts < 1):
      raise ValueError(f"PeriodicCheckpointer: every_inserts must be an int >= 1, "
                       f"got {every_inserts!r}.")
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
      raise ValueError(f"PeriodicCheckpointer: keep_last must be an int >= 1, got {keep_last!r}.")
    self._table = table
    self._payloads = payloads
    self._dir = os.fspath(directory)
    os.makedirs(self._dir, exist_ok=True)
    self._every_s = every_s
    self._every_inserts = every_inserts
    self._keep_last = keep_last
    self._fsync = bool(fsync)
    self._lock = threading.Lock()  # one save at a time (thread vs save_now)
    self._stop = threading.Event()
    self._error: Optional[BaseException] = None
    self.saved: List[str] = []
    self._last_time = time.monotonic()
    self._last_inserts = self._inserts()
    self._thread = threading.Thread(target=self._run, name="funcreplay-checkpointer",
                                    daemon=True)
    self._thread.start()

  def _inserts(self) -> int:
    return int(self._table.stats().to_dict()["inserts"])

  def _due(self) -> bool:
    if self._every_s is not None and time.monotonic() - self._last_time >= self._every_s:
      return True
    if self._every_inserts is None:
      return False
    inserts = self._inserts()
    if inserts < self._last_inserts:  # the table loaded an older checkpoint: count from it
      with self._lock:
        self._last_inserts = min(self._last_inserts, inserts)
    return inserts - self._last_inserts >= self._every_inserts

  def _save(self) -> str:
    with self._lock:
      inserts = self._inserts()
      # One past the newest checkpoint there now (not a step counted from the start: a
      # manual save into the directory took the next one, and this save's FileExistsError
      # stopped the checkpointer for good; found by a review).
      path = host_lib.save_table(self._table, self._dir, keep_last=self._keep_last,
                                 fsync=self._fsync, payloads=self._payloads)
      self._last_time = time.monotonic()
      self._last_inserts = inserts
      self.saved.append(path)
      return path

  def _run(self):
    wait = _POLL_S if self._every_inserts is not None else min(self._every_s, _POLL_S * 4)
    try:
      while not self._stop.wait(wait):
        if self._due():
          self._save()
    except TableClosedError:
      return
    except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
      self._error = e

  def check(self) -> None:
    """Re-raise an error raised in the background thread, if any."""
    if self._error is not None:
      raise self._error  # the original type (e.g. OSError for a full disk)

  def save_now(self) -> str:
    """Save a checkpoint now (in the caller's thread); returns its path."""
    self.check()
    return self._save()

  @property
  def running(self) -> bool:
    return self._thread.is_alive()

  def close(self, *, final_save: bool = False, timeout: Optional[float] = 60.0) -> None:
    """Stop the thread (waits for a save in progress); optionally save once more.

    Raises the background thread's error, if one occurred.
    """
    self._stop.set()
    self._thread.join(timeout)
    if self._thread.is_alive():
      raise TimeoutError(f"PeriodicCheckpointer.close: the save in progress did not finish "
                         f"within {timeout} s.")
    self.check()
    if final_save:
      self._save()

  def __enter__(self) -> "PeriodicCheckpointer":
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is None:
      self.close()
    else:  # do not mask the exception already propagating
      self._stop.set()
      self._thread.join(60.0)
