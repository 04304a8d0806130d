"""A plain-Python reference table implementing the contract (no JAX).

It mirrors the documented semantics of ``funcreplay.core.ops`` / ``sampling``
one item at a time, with lists instead of trees. Random choices (uniform /
prioritized sampling, the Uniform remover) are not reproduced: for those the
tests feed the implementation's choice back with ``apply_sample`` after
checking it is allowed.
"""

from __future__ import annotations

import collections
import math

import funcreplay as fr
from funcreplay.core import selectors as sel

U32 = 2**32


class RefTable:

  def __init__(self, spec: fr.TableSpec):
    self.spec = spec
    c = spec.capacity
    self.occ = [False] * c
    self.key = [0] * c
    self.version = [0] * c
    self.times = [0] * c
    self.prio = [0.0] * c
    self.payload = [None] * c
    self.meta = {m: [0] * c for m in spec.metadata}
    self.next_key = 0
    # Reverb's heaps break priority ties by the least recent insert or update:
    # touch[s] is the value of a counter of inserts and updates (unbounded).
    self.touch = [0] * c
    self.touch_clock = 0
    self.write_pos = 0
    self.max_priority = 1.0
    self.counters = collections.Counter({k: 0 for k in fr.state_counters()})

  # -- helpers -------------------------------------------------------------
  @property
  def size(self):
    return sum(self.occ)

  def age(self, s):
    return (self.next_key - self.key[s]) % U32

  def order_key(self, selector, s):
    """Sort key: smaller = chosen first."""
    if isinstance(selector, fr.Fifo):
      return (-self.age(s),)
    if isinstance(selector, fr.Lifo):
      return (self.age(s),)
    if isinstance(selector, fr.MinHeap):
      return (self.prio[s], self.touch[s])
    if isinstance(selector, fr.MaxHeap):
      return (-self.prio[s], self.touch[s])
    raise TypeError(selector)

  def remover_prefers_new(self, priority, victim):
    """Would the remover pick the item being inserted (``priority``, touched now)
    over ``victim``, the best existing item? Smaller order keys are picked first."""
    remover = self.spec.remover
    if isinstance(remover, fr.Fifo):
      return False
    if isinstance(remover, fr.Lifo):
      return True
    if isinstance(remover, fr.MinHeap):
      return (priority, self.touch_clock) < self.order_key(remover, victim)
    if isinstance(remover, fr.MaxHeap):
      return (-priority, self.touch_clock) < self.order_key(remover, victim)
    raise TypeError(f"the reference cannot draw a {remover!r} victim")

  def victim(self):
    occ = [s for s in range(self.spec.capacity) if self.occ[s]]
    return min(occ, key=lambda s: self.order_key(self.spec.remover, s))

  def _remove(self, s, cause):
    assert self.occ[s]
    self.occ[s] = False
    self.counters[cause] += 1
    self.counters["removed_reuse_sum"] += self.times[s]

  def eligible(self, s, version=None, where=None):
    if not self.occ[s]:
      return False
    if isinstance(self.spec.sampler, fr.Prioritized) and not self.prio[s] > 0:
      return False  # zero-priority items are never sampled, so never eligible
    if version is not None and self.spec.max_staleness is not None:
      if version - self.version[s] > self.spec.max_staleness:
        return False
    if where is not None and not where[s]:
      return False
    return True

  def eligible_slots(self, version=None, where=None):
    return [s for s in range(self.spec.capacity) if self.eligible(s, version, where)]

  # -- operations ------------------------------------------------------------
  def insert(self, payloads, versions, priorities, mask, metadata=None):
    default = (self.spec.default_priority if self.spec.default_priority is not None
               else self.max_priority)
    rows = [i for i, m in enumerate(mask) if m]
    n = len(rows)
    base = self.next_key
    self.next_key = (self.next_key + n) % U32
    n_free = self.spec.capacity - self.size
    free = [s for s in range(self.spec.capacity) if not self.occ[s]]
    for rank, i in enumerate(rows):
      if sel.is_ring(self.spec.remover):
        # The Fifo ring writes the next slot, evicting what it holds (holes are
        # not filled first); Fifo(fill_holes=True) takes the general path.
        s = (self.write_pos + rank) % self.spec.capacity
        if self.occ[s]:
          self._remove(s, "evicted_capacity")
      elif rank < n_free:
        s = free[rank]
      else:
        s = None
      p = default if priorities is None else priorities[i]
      if not math.isfinite(p) or p < 0:
        self.counters["invalid_priorities"] += 1
        p = 0.0
      if s is None:
        # Full: Reverb inserts first, then the remover picks a victim among the
        # C + 1 items, the new one included (it may go at once).
        s = self.victim()
        if self.remover_prefers_new(p, s):
          self.touch_clock += 1
          self.counters["evicted_capacity"] += 1
          continue
        self._remove(s, "evicted_capacity")
      self.occ[s], self.key[s], self.version[s] = True, (base + rank) % U32, versions[i]
      self.times[s], self.prio[s], self.payload[s] = 0, p, payloads[i]
      self.touch[s] = self.touch_clock
      self.touch_clock += 1
      for m in self.meta:
        self.meta[m][s] = (metadata or {}).get(m, [0] * len(mask))[i]
    if sel.is_ring(self.spec.remover):
      self.write_pos = (self.write_pos + n) % self.spec.capacity
    self.counters["inserts"] += n
    applied = [default if priorities is None else priorities[i] for i in rows]
    applied = [p for p in applied if math.isfinite(p) and p >= 0]
    self.max_priority = max([self.max_priority] + applied)

  def expected_ordered_sample(self, batch_size, version=None, where=None):
    elig = self.eligible_slots(version, where)
    elig.sort(key=lambda s: self.order_key(self.spec.sampler, s))
    return elig[:batch_size]

  def apply_sample(self, slots, version=None):
    """Apply a sample that returned ``slots`` (valid rows only)."""
    for s in slots:
      self.times[s] += 1
      self.counters["samples"] += 1
      if version is not None:
        self.counters["sampled_staleness_sum"] += max(version - self.version[s], 0)
    cap = self.spec.max_times_sampled
    if cap:
      for s in sorted(set(slots)):
        if self.times[s] >= cap:
          self._remove(s, "evicted_reuse")

  def _guarded_last(self, slots, keys):
    last = {}
    for i, (s, k) in enumerate(zip(slots, keys)):
      if 0 <= s < self.spec.capacity and self.occ[s] and self.key[s] == k % U32:
        last[s] = i
    return last

  def delete(self, slots, keys):
    for s in self._guarded_last(slots, keys):
      self._remove(s, "deletes")

  def update_priorities(self, slots, keys, priorities):
    # In call order (the last of duplicates wins): each update touches its item.
    for s, i in sorted(self._guarded_last(slots, keys).items(), key=lambda si: si[1]):
      self.touch[s] = self.touch_clock
      self.touch_clock += 1
      p = priorities[i]
      if not math.isfinite(p) or p < 0:
        self.counters["invalid_priorities"] += 1
        p = 0.0
      self.prio[s] = p
      self.max_priority = max(self.max_priority, p)

  def evict_stale(self, version):
    for s in range(self.spec.capacity):
      if self.occ[s] and version - self.version[s] > self.spec.max_staleness:
        self._remove(s, "evicted_stale")
