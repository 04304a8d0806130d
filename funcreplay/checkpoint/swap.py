"""Overwriting a checkpoint without a moment where ``path`` has none.

On Linux ``save(path, overwrite=True)`` swaps the complete new copy
(``.tmp-<name>-<pid>-<hex>``) with ``path`` in one atomic step,
``renameat2(RENAME_EXCHANGE)`` (``exchange``; glibc >= 2.28, ext4 / xfs /
btrfs / tmpfs), then deletes the old copy it left under the temporary name: at
every instant ``path`` is the old or the new checkpoint, whole. A kill before
the deletion leaves a stale ``.tmp-`` beside a complete ``path``, which the
next save there deletes.

Where that call is missing or the file system refuses it (EINVAL, EXDEV...),
there is no portable atomic swap of two non-empty directories, so the
overwrite takes two renames: the old checkpoint goes to
``.trash-<name>-<pid>-<hex>``, then the complete new one
(``.tmp-<name>-<pid>-<hex>``, its manifest written last) to ``<name>``. A
process killed between the two leaves no ``<name>``, but both complete copies
side by side. ``interrupted(path)`` recognises that pair, and ``resolve``
(hence every ``restore``) reads the new copy from it (its manifest exists, so
every file was written before it). The next save to ``path`` deletes the
leftovers of saves whose process is gone (``clean_stale``). So
``restore(path)`` after any kill returns a complete
checkpoint, the old or the new one, never an error.

A restore running *while* another thread or process overwrites the same path
reads files by name from a directory that is swapped under it: a file may
vanish (two renames), or belong to the new checkpoint while the manifest it
holds is the old one's (either way). ``read_stable`` therefore fingerprints
the checkpoint (the directory ``resolve`` picks and its manifest's bytes)
before and after each read, and reads again while it changed: a read that
failed or mixed two checkpoints is never returned, and a failure on an
unchanged checkpoint is raised as it is.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
from typing import Callable, List, Optional, Tuple, TypeVar

from funcreplay.checkpoint.errors import CheckpointError

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
MANIFEST = "manifest.json"
_OWNER_RE = re.compile(r"-(\d+)-[0-9a-f]{8}$")  # the "-<pid>-<hex>" tail of both prefixes
# Reads of a checkpoint that changed under them are repeated this often: each
# repeat needs another complete save to land during the read, so a few suffice
# unless the path is overwritten back to back faster than it can be read.
STABLE_READ_ATTEMPTS = 8
T = TypeVar("T")
_AT_FDCWD = -100  # <fcntl.h>: paths relative to the working directory
_RENAME_NOREPLACE = 1  # <linux/fs.h>: fail with EEXIST where the target exists
_RENAME_EXCHANGE = 2  # <linux/fs.h>: swap the two paths atomically
# errnos meaning "this kernel / file system cannot exchange": use the two renames
_NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV)


def _find_renameat2():
  """libc's ``renameat2`` (Python's os has no binding), or None off Linux / on old glibc."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    fn = ctypes.CDLL(None, use_errno=True).renameat2
  except (OSError, AttributeError):
    return None
  fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  fn.restype = ctypes.c_int
  return fn


RENAMEAT2 = _find_renameat2()  # tests set it to None to exercise the two-rename fallback


def exchange(a: str, b: str) -> bool:
  """Swap the existing paths ``a`` and ``b`` in one atomic step; False where unsupported.

  Raises ``OSError`` for any other failure (nothing was swapped).
  """
  if RENAMEAT2 is None:
    return False
  if RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  err = ctypes.get_errno()
  if err in _NO_EXCHANGE:
    return False
  raise OSError(err, os.strerror(err), a, None, b)


def place(a: str, b: str) -> None:
  """Rename ``a`` to ``b``, which must not exist: ``FileExistsError`` if it does (a
  concurrent save made it after the caller checked). ``renameat2(RENAME_NOREPLACE)`` where
  the system has it (atomic); else ``os.rename``, which refuses a non-empty directory at
  ``b`` (a checkpoint) too. (A plain rename, or the exchange of ``overwrite``, let two
  saves with ``overwrite=False`` both succeed, the second replacing the first.)"""
  if RENAMEAT2 is not None:
    if RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_NOREPLACE) == 0:
      return
    err = ctypes.get_errno()
    if err == errno.EEXIST:
      raise FileExistsError(err, os.strerror(err), b)
    if err not in _NO_EXCHANGE:
      raise OSError(err, os.strerror(err), a, None, b)
  try:
    os.rename(a, b)
  except OSError as e:
    if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
      raise FileExistsError(e.errno, os.strerror(e.errno), b) from None
    raise


def pid_alive(pid: int) -> bool:
  """Whether process ``pid`` exists (a save by it may still be running)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OSError):
    return True
  return True


def _siblings(path: str) -> List[Tuple[str, int, str]]:
  """``[(prefix, pid, full path)]`` of the temporary / trash directories of ``path``."""
  parent, base = os.path.split(os.path.abspath(os.fspath(path)))
  try:
    names = os.listdir(parent)
  except OSError:
    return []
  out = []
  for name in sorted(names):
    for prefix in (TMP_PREFIX, TRASH_PREFIX):
      rest = name[len(prefix):] if name.startswith(prefix) else None
      m = _OWNER_RE.search(rest) if rest is not None else None
      if m and rest[:m.start()] == base:
        out.append((prefix, int(m.group(1)), os.path.join(parent, name)))
  return out


def interrupted(path) -> Optional[str]:
  """The new checkpoint an overwrite of ``path`` killed between its renames left, or None.

  None whenever ``path`` itself exists. The new copy is the ``.tmp-`` holding
  a manifest whose save had already moved the old one to ``.trash-`` (same
  pid): the manifest is written last, so it is complete. A ``.trash-`` alone
  is never used: ``layout.prune`` also renames to ``.trash-`` before
  deleting, so one may be half-deleted.
  """
  path = os.fspath(path)
  if os.path.exists(path):
    return None
  sib = _siblings(path)
  swapping = {pid for prefix, pid, _ in sib if prefix == TRASH_PREFIX}
  for prefix, pid, p in sib:
    if prefix == TMP_PREFIX and pid in swapping and os.path.isfile(os.path.join(p, MANIFEST)):
      return p
  return None


def clean_stale(path) -> None:
  """Delete the temporaries and trash of ``path`` left by saves whose process is gone."""
  for _, pid, p in _siblings(path):
    if pid != os.getpid() and not pid_alive(pid):
      shutil.rmtree(p, ignore_errors=True)


def fingerprint(path, resolve: Callable[[str], str]) -> Optional[Tuple[str, bytes]]:
  """``(directory resolve(path) picks, its manifest's bytes)``, or None if unreadable now."""
  try:
    where = resolve(path)
    with open(os.path.join(where, MANIFEST), "rb") as f:
      return where, f.read()
  except (OSError, ValueError):  # mid-swap, or no checkpoint: the read itself will say
    return None


def read_stable(path, resolve: Callable[[str], str], read: Callable[[], T]) -> T:
  """``read()``, repeated while the checkpoint at ``path`` changed during it (module doc).

  Raises what the last ``read`` raised if the checkpoint did not change during
  it; ``CheckpointError`` if it changed during each of ``STABLE_READ_ATTEMPTS`` reads.
  """
  for _ in range(STABLE_READ_ATTEMPTS):
    before = fingerprint(path, resolve)
    try:
      out = read()
    except (OSError, ValueError):  # CheckpointError is a ValueError
      if fingerprint(path, resolve) == before:  # unchanged (or absent throughout): real
        raise
      continue
    if fingerprint(path, resolve) == before:
      return out
  raise CheckpointError(f"{os.fspath(path)!r} was overwritten during each of "
                        f"{STABLE_READ_ATTEMPTS} attempts to read it; restore it when saves to "
                        "it pause.")
