"""Selectors: how items are sampled and which item is removed when full.

The vocabulary is Reverb's. A selector is a small frozen (hashable) dataclass
holding static configuration only; the device-side machinery lives in
``funcreplay.core.trees`` and ``funcreplay.core.sampling``.

=============  ==========================================  =======================
selector       as a sampler                                as a remover
=============  ==========================================  =======================
Uniform        uniform over eligible items                 a uniformly random item
Prioritized    P(i) = p_i**alpha / sum_j p_j**alpha        (not supported)
Fifo           oldest eligible items first                 ring: oldest-written slot
                                                           (fill_holes: oldest item)
Lifo           newest eligible items first                 the newest item
MinHeap        lowest priority first (ties: oldest first)  lowest priority
MaxHeap        highest priority first (ties: oldest first) highest priority
StalestFirst   lowest item version first (ties: oldest)    (not supported)
FreshestFirst  highest item version first (ties: oldest)   (not supported)
=============  ==========================================  =======================

A remover runs when a full table receives an item, and (as in Reverb) the
incoming item is a candidate too: ``Lifo`` evicts it at once, a heap remover
when its priority is the lowest / highest, ``Uniform`` with probability
``1 / (C + 1)``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Union

import numpy as np


@dataclasses.dataclass(frozen=True)
class Uniform:
  """Every eligible item is equally likely."""


@dataclasses.dataclass(frozen=True)
class Prioritized:
  """Proportional prioritized sampling (Schaul et al., 2016).

  Attributes:
    priority_exponent: alpha in ``P(i) = p_i**alpha / sum_j p_j**alpha``.
      0 gives uniform sampling over items with positive priority.
  """

  priority_exponent: float = 0.6

  def __post_init__(self):
    a = self.priority_exponent
    # 2**15: powers.MAX_EXPONENT (the integer p**alpha; above it p**alpha is 0 or inf for
    # every float32 p outside [0.9973, 1.0027]). Checked as float32, the value used.
    if (not isinstance(a, (int, float)) or not math.isfinite(a)
        or not (0 <= a < 2.0**15 and float(np.float32(a)) < 2.0**15)):
      raise ValueError(
          f"Prioritized(priority_exponent={a!r}): the exponent must be a "
          "number in [0, 32768) (0.6 is the usual choice).")


@dataclasses.dataclass(frozen=True)
class Fifo:
  """First in, first out (by insertion order).

  As a remover, by default a *ring*: the table writes slots in order and, when
  the slot it reaches holds an item, evicts that item (the oldest). O(B)
  contiguous writes and an O(1) uniform draw, but a slot freed early (delete,
  ``max_times_sampled``, staleness) stays a hole until the ring comes back to
  it, so the oldest item is evicted even while holes are free: capacity 3,
  insert 0, 1, 2, delete 1, insert 3 keeps {2, 3}.

  Attributes:
    fill_holes: Reverb's FIFO remover instead: free slots first, and only a
      full table evicts its oldest item (the example keeps {0, 2, 3}). Costs an
      order tree (O(log C) per changed item) and the portable per-row victim
      loop; no native kernels (BUILD.md, "The Fifo remover is a ring").
  """

  fill_holes: bool = False

  def __post_init__(self):
    if not isinstance(self.fill_holes, bool):
      raise TypeError(f"Fifo(fill_holes={self.fill_holes!r}): expected a bool.")


@dataclasses.dataclass(frozen=True)
class Lifo:
  """Last in, first out (by insertion order)."""


@dataclasses.dataclass(frozen=True)
class MinHeap:
  """Lowest priority first; ties broken by insertion order (oldest first)."""


@dataclasses.dataclass(frozen=True)
class MaxHeap:
  """Highest priority first; ties broken by insertion order (oldest first)."""


@dataclasses.dataclass(frozen=True)
class StalestFirst:
  """Lowest item version (the stalest item) first; ties by insertion order, oldest first.

  xtuner's ``StalenessReplayPolicy`` (``sort by (-staleness, timestamp)``): use items
  before they expire. A sampler only (O(C log C) per sample, like the other
  deterministic samplers); ``Table.take_batch`` / ``peek`` follow it too.
  """


@dataclasses.dataclass(frozen=True)
class FreshestFirst:
  """Highest item version (the freshest item) first; ties by insertion order, oldest first."""


Selector = Union[Uniform, Prioritized, Fifo, Lifo, MinHeap, MaxHeap, StalestFirst, FreshestFirst]
SAMPLERS = (Uniform, Prioritized, Fifo, Lifo, MinHeap, MaxHeap, StalestFirst, FreshestFirst)
REMOVERS = (Uniform, Fifo, Lifo, MinHeap, MaxHeap)
ORDERED = (Fifo, Lifo, MinHeap, MaxHeap, StalestFirst, FreshestFirst)


def is_ring(remover) -> bool:
  """True for the ``Fifo`` ring remover (``Fifo()``, not ``Fifo(fill_holes=True)``)."""
  return isinstance(remover, Fifo) and not remover.fill_holes


def is_ordered(selector) -> bool:
  """True for the deterministic selectors (Fifo, Lifo, MinHeap, MaxHeap)."""
  return isinstance(selector, ORDERED)
