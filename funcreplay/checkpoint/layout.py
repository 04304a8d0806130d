"""A directory of numbered checkpoints: ``directory/ckpt-<step>``, keep-last-N, latest.

Only complete checkpoints ever carry the name ``ckpt-<step>`` (they are
renamed into place atomically, see ``format.write_dir``), so discovery is a
directory listing: temporary (``.tmp-*``) and half-deleted (``.trash-*``)
directories are skipped, and a ``ckpt-<step>`` without a manifest (copied by
hand, damaged) is skipped too. The one exception: an overwrite of
``ckpt-<step>`` killed between its two renames lists the new copy it left
(``swap.interrupted``).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from typing import List, Optional, Tuple

from funcreplay.checkpoint import format as fmt
from funcreplay.checkpoint import swap

PREFIX = "ckpt-"
_STEP_RE = re.compile(r"^ckpt-(\d+)$")


def step_path(directory: str, step: int) -> str:
  """``directory/ckpt-<step>`` (step zero-padded to 8 digits so names sort)."""
  if isinstance(step, bool) or not isinstance(step, int) or step < 0:
    raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}.")
  return os.path.join(os.fspath(directory), f"{PREFIX}{step:08d}")


def list_steps(directory: str) -> List[Tuple[int, str]]:
  """``[(step, path)]`` of complete checkpoints in ``directory``, oldest first."""
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    return []
  out = {}
  for name in os.listdir(directory):
    m = _STEP_RE.match(name)
    path = os.path.join(directory, name)
    if m and os.path.isfile(os.path.join(path, fmt.MANIFEST)):
      out[int(m.group(1))] = path
    elif name.startswith(fmt.TMP_PREFIX):  # an overwrite of ckpt-<step> killed mid-swap
      m = _STEP_RE.match(name[len(fmt.TMP_PREFIX):].rsplit("-", 2)[0])
      recovered = m and swap.interrupted(os.path.join(directory, m.group(0)))
      if recovered:
        out[int(m.group(1))] = recovered
  return sorted(out.items())


def latest(directory: str) -> Optional[str]:
  """Path of the newest complete checkpoint in ``directory``, or None."""
  steps = list_steps(directory)
  return steps[-1][1] if steps else None


def next_step(directory: str) -> int:
  """One more than the newest step in ``directory`` (0 if none)."""
  steps = list_steps(directory)
  return steps[-1][0] + 1 if steps else 0


def prune(directory: str, keep_last: int) -> List[str]:
  """Delete all but the newest ``keep_last`` checkpoints, and stale temporaries.

  A checkpoint is renamed to ``.trash-*`` (atomic) before it is deleted, so a
  crash half-way through a deletion never leaves a damaged ``ckpt-<step>``.
  Temporary directories of processes that no longer run (killed mid-save)
  are deleted as well. Returns the deleted checkpoint paths.
  """
  if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
    raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}.")
  directory = os.fspath(directory)
  steps = list_steps(directory)
  removed = []
  for _, path in steps[:-keep_last]:
    trash = os.path.join(directory, f"{fmt.TRASH_PREFIX}{os.path.basename(path)}-"
                                    f"{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
    removed.append(path)
  for name in os.listdir(directory):
    if name.startswith((fmt.TMP_PREFIX, fmt.TRASH_PREFIX)):
      m = re.search(r"-(\d+)-[0-9a-f]{8}$", name)
      if m and int(m.group(1)) != os.getpid() and not swap.pid_alive(int(m.group(1))):
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
  return removed
