"""Step storage: the signature's leaves, or all of them packed into one row of words.

When every leaf of the step signature is 4 bytes wide (float32 / int32 /
uint32) and there are at least two, a step is stored as one row of
``R = sum(leaf sizes)`` uint32 words: ``state.data`` is then a single
``uint32[E, T, R]`` array (``packed(spec)``), written by one scatter per
``add`` and read by one gather per ``sample`` (``B * L`` rows of ``R``
words), then split and bitcast back to the leaves. XLA:CPU pays per gathered
element and per gather: one gather of ``2048 x 19`` words instead of four,
one per leaf, was about 20% faster here (``experiments/bench_trajectory.py``'s
step). Other signatures keep one array per leaf. The same layout as item tables'
``storage="rows"`` (``funcreplay.core.storage``, which does the work).
"""

from __future__ import annotations

from funcreplay.core import storage
from funcreplay.core.trajectory.spec import TrajectorySpec


def packed(spec: TrajectorySpec) -> bool:
  """True when steps are stored as rows of uint32 words (static)."""
  return storage.packable(spec.signature) is None


def width(spec: TrajectorySpec) -> int:
  """``R``: words per packed step."""
  return storage.width(spec.signature)


def empty(spec: TrajectorySpec, lead):
  """Zero storage with leading axes ``lead``."""
  return storage.empty(spec.signature, packed(spec), lead)


def pack(spec: TrajectorySpec, tree, nlead: int):
  """``tree`` (leaves ``[*lead, *leaf_shape]``) as storage: the tree itself, or uint32
  ``[*lead, R]`` words (``packed``)."""
  return storage.pack(spec.signature, packed(spec), tree, nlead)


def unpack(spec: TrajectorySpec, data, nlead: int):
  """Storage (leading axes ``nlead``) back to the step pytree."""
  return storage.unpack(spec.signature, packed(spec), data, nlead)
