"""``RaggedArena``: the values of one ``Ragged`` leaf, without per-item padding.

One flat buffer per leaf plus ``(offset, length)`` per slot. New values are
appended at a bump pointer (``top``); a freed item only drops its length from the
live count. When the next write does not fit, the arena *compacts*: live spans move
down to the front, in offset order, in place (``numpy`` handles the overlapping
copies), and the buffer is then resized (``realloc``: in place when it shrinks) to
``(live + next write) / (1 - SLACK)``. So:

* memory: right after a compaction the buffer holds ``live / (1 - SLACK)``
  values (1.032x at ``SLACK = 1/32``); a ``free`` that leaves less than ``1 - 2 SLACK``
  of it held compacts it down again, so the buffer is at most ``1 / (1 - 2 SLACK)``
  (1.067x) of the values held, above ``MIN_SIZE`` (evictions reclaim memory at once);
* time: a compaction copies at most the live values and leaves ``SLACK`` of the
  buffer free (and ``1 - SLACK`` of it held), so it happens at most once per
  ``SLACK * size`` values appended or freed: amortized ``<= 1 / SLACK`` copies per
  appended or freed value (memcpy speed);
* no fragmentation survives a compaction: holes are reclaimed as a whole.

Slots are the table's slots (``funcreplay.host.rollout.sidecar`` attaches and
frees them as the table's items come and go).
"""

from __future__ import annotations

import math

import numpy as np

SLACK = 1.0 / 32  # free fraction after a compaction: <= 32 copies per value, 1.032x memory
MIN_SIZE = 256    # values: tiny tables do not reallocate on every item


class RaggedArena:
  """Variable-length values per slot, in one flat ``dtype`` buffer.

  Attributes:
    buf: the buffer (``[size]`` of ``dtype``).
    off: int64[C] offset of each slot's values; len: int32[C] their count (0: free).
    top: the bump pointer (values below it are live, dead or staged).
    live: the values held by slots.
    compactions / reallocations: counters, for reports and tests.
  """

  def __init__(self, dtype, capacity: int, initial: int = MIN_SIZE):
    self.dtype = np.dtype(dtype)
    self.buf = np.zeros((max(MIN_SIZE, int(initial)),), self.dtype)
    self.off = np.zeros((capacity,), np.int64)
    self.len = np.zeros((capacity,), np.int32)
    self.top = 0
    self.live = 0
    self.compactions = 0
    self.reallocations = 0
    self._staged = []  # Staged rows of inserts in progress (moved by compactions)

  @property
  def size(self) -> int:
    return int(self.buf.shape[0])

  @property
  def nbytes(self) -> int:
    """Bytes held: the buffer and the per-slot offsets and lengths."""
    return self.buf.nbytes + self.off.nbytes + self.len.nbytes

  def stage(self, flat: np.ndarray, lengths: np.ndarray) -> "Staged":
    """Append the rows of ``flat`` (their ``lengths`` in order) for an insert.

    Staged values belong to no slot until ``attach``; ``release`` ends the staging
    (rows never attached become garbage, reclaimed by the next compaction). A
    compaction meanwhile (another insert while this one waits on the rate limiter)
    moves staged rows too."""
    n = int(flat.shape[0])
    lengths = np.asarray(lengths, np.int32)
    self._reserve(n)
    self.buf[self.top:self.top + n] = flat
    offsets = self.top + np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)])
    self.top += n
    staged = Staged(offsets.astype(np.int64), lengths)
    self._staged.append(staged)
    return staged

  def attach(self, slots: np.ndarray, staged: "Staged", rows: np.ndarray) -> None:
    """Free ``slots`` (unique) now hold the staged ``rows`` (unique) of ``staged``."""
    self.off[slots] = staged.offsets[rows]
    self.len[slots] = staged.lengths[rows]
    staged.active[rows] = False
    self.live += int(np.sum(staged.lengths[rows], dtype=np.int64))

  def adopt_staged(self, other: "RaggedArena") -> None:
    """Take over ``other``'s staged rows (inserts waiting on the rate limiter when a
    ``Table.load`` replaced ``other`` by this arena): their values are appended here, and
    the same ``Staged`` objects (which those inserts hold) now point into this arena."""
    for st in other._staged:  # noqa: SLF001 (the same class)
      rows = np.nonzero(st.active)[0]
      lengths = st.lengths[rows].astype(np.int64)
      n = int(lengths.sum())
      self._reserve(n)
      starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
      idx = np.repeat(st.offsets[rows] - starts, lengths) + np.arange(n, dtype=np.int64)
      self.buf[self.top:self.top + n] = other.buf[idx]
      st.offsets[rows] = self.top + starts
      self.top += n
      self._staged.append(st)
    other._staged = []  # noqa: SLF001

  def release(self, staged: "Staged") -> None:
    """End ``staged``: its rows not attached are garbage from now on."""
    self._staged = [s for s in self._staged if s is not staged]
    self._reclaim()  # rows never attached are garbage now

  def free(self, slots: np.ndarray) -> None:
    """Release the values of ``slots`` (unique). Once the held values (live and staged)
    fall below ``(1 - 2 SLACK)`` of the buffer, compact it down to their ideal size: the
    buffer never holds more than ``1 / (1 - 2 SLACK)`` times what it keeps (above
    ``MIN_SIZE``), however many items leave at once."""
    self.live -= int(np.sum(self.len[slots], dtype=np.int64))
    self.len[slots] = 0
    self._reclaim()

  def _reclaim(self) -> None:
    keep = self.live + self._staged_values()
    if self.size > MIN_SIZE and keep < (1.0 - 2 * SLACK) * self.size:
      self._compact(max(MIN_SIZE, math.ceil(keep / (1.0 - SLACK))))

  def _staged_values(self) -> int:
    return sum(int(st.lengths[st.active].sum()) for st in self._staged)

  def gather(self, slots: np.ndarray):
    """``(values [sum_len], lengths int32[B], starts int64[B+1])`` of ``slots`` (-1: empty)."""
    slots = np.asarray(slots)
    ok = slots >= 0
    safe = np.where(ok, slots, 0)
    lengths = np.where(ok, self.len[safe], 0).astype(np.int32)
    starts = np.zeros((len(slots) + 1,), np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = int(starts[-1])
    idx = np.repeat(self.off[safe] - starts[:-1], lengths) + np.arange(total, dtype=np.int64)
    return self.buf[idx], lengths, starts

  def _reserve(self, n: int) -> None:
    if self.top + n <= self.size:
      return
    need = self.live + n + self._staged_values()
    self._compact(max(MIN_SIZE, math.ceil(need / (1.0 - SLACK))))

  def _compact(self, new_size: int) -> None:
    """Move the live and staged spans to the front, in offset order, then resize the
    buffer to ``new_size`` (>= the values kept)."""
    held = np.nonzero(self.len)[0]
    offs = [self.off[held]]
    lens = [self.len[held].astype(np.int64)]
    for st in self._staged:
      rows = np.nonzero(st.active)[0]
      offs.append(st.offsets[rows])
      lens.append(st.lengths[rows].astype(np.int64))
    offs, lens = np.concatenate(offs), np.concatenate(lens)
    order = np.argsort(offs, kind="stable")
    new_off = np.zeros_like(offs)
    new_off[order] = np.concatenate([[0], np.cumsum(lens[order][:-1])])
    buf = self.buf
    # Spans only move down (new offset <= old), in offset order. Consecutive spans with
    # the same shift are contiguous at both ends: one slice copy moves each such run, so
    # a compaction costs one memmove per hole, not one per item.
    o_sorted, n_sorted, d_sorted = offs[order], lens[order], new_off[order]
    shift = o_sorted - d_sorted
    cuts = np.flatnonzero(np.diff(shift)) + 1
    for a, b in zip(np.concatenate([[0], cuts]).tolist(),
                    np.concatenate([cuts, [order.size]]).tolist()):
      if b > a and shift[a] > 0:
        src, dst = int(o_sorted[a]), int(d_sorted[a])
        n = int(o_sorted[b - 1] + n_sorted[b - 1]) - src
        buf[dst:dst + n] = buf[src:src + n]
    self.off[held] = new_off[:held.size]
    k = held.size
    for st in self._staged:
      rows = np.nonzero(st.active)[0]
      st.offsets[rows] = new_off[k:k + rows.size]
      k += rows.size
    self.top = int(lens.sum())
    if new_size != buf.shape[0]:
      # realloc: no second buffer when shrinking. Safe: the arena hands out copies only
      # (``gather``), so no view of ``buf`` outlives a call.
      buf.resize((new_size,), refcheck=False)
      self.reallocations += 1
    self.compactions += 1

  def check(self) -> None:
    """Invariants (tests): spans in bounds, disjoint, below ``top``; ``live`` = their sum."""
    held = np.nonzero(self.len)[0]
    o, n = self.off[held], self.len[held].astype(np.int64)
    assert int(n.sum()) == self.live, (int(n.sum()), self.live)
    assert self.top <= self.size
    if held.size:
      order = np.argsort(o)
      o, n = o[order], n[order]
      assert o[0] >= 0 and o[-1] + n[-1] <= self.top
      assert np.all(o[1:] >= o[:-1] + n[:-1]), "overlapping spans"


class Staged:
  """Rows an insert appended to an arena (``RaggedArena.stage``)."""

  __slots__ = ("offsets", "lengths", "active")

  def __init__(self, offsets: np.ndarray, lengths: np.ndarray):
    self.offsets = offsets
    self.lengths = lengths
    self.active = np.ones(lengths.shape, bool)  # not attached yet
