"""Validation of manifest fields that become live values (the host ``Table``'s extras).

A manifest that parses as JSON and passes its checksum can still hold values no
``Table`` accepts (written by another tool, or by a buggy writer before the
checksum existed). Each is refused here as a ``CheckpointError`` naming the
manifest field, before any array is read.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from funcreplay.checkpoint.errors import CheckpointError

_I32 = np.iinfo(np.int32)  # Table.version is an int32 (items store it in an int32 column)
_U32_END = 2**32


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def parse_host(host: Any, mpath: str) -> Optional[Dict[str, Any]]:
  """The manifest's ``host`` entry as ``{"version": int, "rng": np.uint32[2]}`` (or None).

  Args:
    host: the parsed JSON value (None for a pure-layer checkpoint).
    mpath: the manifest's path, for the error message.

  Raises:
    CheckpointError naming ``host``, ``host.version`` or ``host.rng``.
  """
  if host is None:
    return None
  if not isinstance(host, dict):
    raise CheckpointError(f"{mpath}: host must be an object {{version, rng}} or null, got "
                          f"{type(host).__name__}; the manifest is corrupted.")
  version, rng = host.get("version"), host.get("rng")
  if not _is_int(version) or not _I32.min <= version <= _I32.max:
    raise CheckpointError(f"{mpath}: host.version must be an int32 integer, got {version!r}; "
                          "the manifest is corrupted.")
  if (not isinstance(rng, list) or len(rng) != 2
      or not all(_is_int(w) and 0 <= w < _U32_END for w in rng)):
    raise CheckpointError(f"{mpath}: host.rng must be two integers in [0, 2**32) (a uint32[2] "
                          f"PRNG key), got {rng!r}; the manifest is corrupted.")
  return {"version": version, "rng": np.asarray(rng, np.uint32)}
