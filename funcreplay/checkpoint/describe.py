"""``info(path)``: a checkpoint's manifest summary, without reading its arrays."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from funcreplay.checkpoint import format as fmt
from funcreplay.checkpoint import swap
from funcreplay.checkpoint.core import resolve


@dataclasses.dataclass(frozen=True)
class CheckpointInfo:
  """Manifest summary of a checkpoint (``info(path)``); reads no arrays."""

  path: str
  spec: Dict[str, Any]
  num_shards: Optional[int]
  funcreplay_version: str
  created_unix: float
  nbytes: int
  files: List[str]
  extra: Any


def info(path) -> CheckpointInfo:
  """Read only the manifest of a checkpoint (or the newest one in a directory); a read
  racing ``save(overwrite=True)`` is read again, as in ``restore`` (``swap.read_stable``)."""
  return swap.read_stable(path, resolve, lambda: _info_once(resolve(path)))


def _info_once(path) -> CheckpointInfo:
  m = fmt.read_manifest(path)
  return CheckpointInfo(path=path, spec=m.get("spec"), num_shards=m.get("num_shards"),
                        funcreplay_version=m.get("funcreplay_version"),
                        created_unix=m.get("created_unix"),
                        nbytes=sum(int(e.get("nbytes", 0)) for e in m["arrays"]),
                        files=[e.get("file") for e in m["arrays"]], extra=m.get("extra"))
