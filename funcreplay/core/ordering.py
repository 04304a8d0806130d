"""Orders used by the deterministic selectors (Fifo, Lifo, MinHeap, MaxHeap, StalestFirst,
FreshestFirst).

Keys are uint32 insertion indices that wrap modulo 2**32, so "older" is
decided by *age* ``next_key - key`` (mod 2**32), which orders every pair of
items correctly as long as both were inserted within the last 2**32 inserts.
Heap selectors break priority ties as Reverb does, by the least recent insert
*or priority update*: the age ``clock - touched`` of ``TableState.touched``'s
stamps (mod 2**32, correct while both items were touched within the last
2**32 inserts and updates).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from funcreplay.core import selectors as sel


def age(state, slots):
  """uint32 age of the items in ``slots`` (1 = newest)."""
  return state.next_key - state.key[slots]


def touch_age(state, slots):
  """uint32 age of the last insert or priority update of the items in ``slots``
  (heap selectors only: ``state.touched`` holds the stamps, its last word the clock)."""
  return state.touched[-1] - state.touched[slots]


def priority_bits(priority):
  """int32 with the same order as the (non-negative, finite) float32 priorities. ``-0.0``
  (which passes every ``>= 0`` check) is ``0.0``: its bits are ``INT32_MIN``, which
  would put it before every priority, and negated (a ``MaxHeap``) still there."""
  bits = lax.bitcast_convert_type(priority.astype(jnp.float32), jnp.int32)
  return jnp.maximum(bits, 0)


def better_fn(selector, state):
  """``better(a, b)`` for the arg-best tree of a Lifo / MinHeap / MaxHeap remover
  (or a Fifo order)."""

  def older(a, b):
    return age(state, a) > age(state, b)

  if isinstance(selector, sel.Fifo):
    return older
  if isinstance(selector, sel.Lifo):
    return lambda a, b: age(state, a) < age(state, b)
  if isinstance(selector, (sel.MinHeap, sel.MaxHeap)):
    sign = 1 if isinstance(selector, sel.MinHeap) else -1

    def better(a, b):
      pa, pb = state.priority[a] * sign, state.priority[b] * sign
      return (pa < pb) | ((pa == pb) & (touch_age(state, a) > touch_age(state, b)))

    return better
  raise TypeError(f"no order for selector {selector!r}")


def order_keys(selector, state):
  """Sort keys (a tuple of ``[C]`` arrays, ascending, most significant first) that put
  the slots in ``selector``'s order (deterministic selectors)."""
  # Whole columns, not ``age(state, arange(C))``: a gather by an iota stays a gather
  # (22 us of a 65,536-slot heap sample in a scan).
  c = state.occupied.shape[0]
  a = state.next_key - state.key
  if isinstance(selector, sel.Fifo):
    return (~a,)          # oldest (largest age) first
  if isinstance(selector, sel.Lifo):
    return (a,)           # newest first
  if isinstance(selector, (sel.MinHeap, sel.MaxHeap)):
    touch_age = state.touched[c] - state.touched[:c]
    prio = priority_bits(state.priority)
    return (prio if isinstance(selector, sel.MinHeap) else -prio, ~touch_age)
  if isinstance(selector, sel.StalestFirst):
    return (state.version, ~a)
  if isinstance(selector, sel.FreshestFirst):
    return (~state.version, ~a)  # ~v = -v - 1: decreasing in v, no overflow
  raise TypeError(f"{selector!r} is not a deterministic selector")


def sorted_eligible(selector, state, eligible):
  """All slots sorted by ``selector``'s order, eligible ones first.

  O(C log C) (a multi-operand sort of the table: 12 ms at C = 65,536 on XLA:CPU);
  the reference for ``first_eligible``, which the samplers use.

  Returns:
    ``(slots int32[C], is_eligible bool[C])`` in selection order.
  """
  c = eligible.shape[0]
  slots = jnp.arange(c, dtype=jnp.int32)
  inel = (~eligible).astype(jnp.int32)
  keys = (inel, *order_keys(selector, state))
  out = lax.sort((*keys, slots), num_keys=len(keys))
  return out[-1], out[0] == 0


def ascending_u32(key):
  """uint32[C] in the order of ``key`` (signed / unsigned ints, floats; ascending)."""
  if jnp.issubdtype(key.dtype, jnp.floating):
    key = jnp.where(key == 0, 0.0, key).astype(jnp.float32)  # -0.0 ties with 0.0, as in <
    b = lax.bitcast_convert_type(key, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(1 << 31))  # negatives reversed
  if jnp.issubdtype(key.dtype, jnp.signedinteger):
    return lax.bitcast_convert_type(key.astype(jnp.int32), jnp.uint32) ^ jnp.uint32(1 << 31)
  return key.astype(jnp.uint32)


# The bits of the order keys are selected on DIGIT_BITS at a time by ``lax.top_k`` over
# float32 scores. A digit d < 2**30 is scored by the float whose bit pattern is
# ``MIN_NORMAL_BITS + d``: positive normal floats order as their bit patterns, so the
# scores order exactly as the digits (no denormal, which a flush-to-zero would merge,
# and the largest, 0x407fffff, is finite). 2**31 digits would run into inf / NaN.
DIGIT_BITS = 30
MIN_NORMAL_BITS = 0x00800000


def _digits(words):
  """The concatenated bits of ``words`` (uint32 arrays, most significant first), cut
  into digits of ``DIGIT_BITS`` from the top (the last one shorter)."""
  total, out, pos = 32 * len(words), [], 0
  while pos < total:
    n = min(DIGIT_BITS, total - pos)
    d = jnp.zeros_like(words[0])
    for i, w in enumerate(words):  # word i holds bits [32 i, 32 i + 32) from the top
      a, b = max(pos, 32 * i), min(pos + n, 32 * i + 32)
      if a < b:
        d = (d << (b - a)) | ((w >> (32 * i + 32 - b)) & jnp.uint32((1 << (b - a)) - 1))
    out.append(d)
    pos += n
  return out


def _scan_backwards(selector) -> bool:
  """True when ``first_eligible`` should run its top-k passes (but the last digit's,
  among the few candidates left) from the last slot down.

  XLA:CPU's top-k keeps a heap of the ``b`` best scores seen so far, so scores that
  rise along the array enter it one by one: 65,536 rising scores take 1.6 ms, falling
  or random ones 70-80 us (k = 64). A table written in slot order (a ring between its
  wraps, a stack's lowest-free-slot fills) holds its items oldest first, so the newest
  first order (``Lifo``) rises along the slots: it is read backwards. Every other
  order puts the oldest (or least recently touched) first among equals and falls."""
  return isinstance(selector, sel.Lifo)


def first_eligible(selector, state, eligible, b: int):
  """``(slots int32[b], num_eligible int32[])``: the first ``b`` eligible slots in
  ``selector``'s order (``order_keys``; equal keys by slot), -1 past the eligible ones.

  Two executors of the same rows, chosen when the program is lowered
  (``lax.platform_dependent``: no condition in the program): ``select_first`` on the CPU
  and the TPU, ``sort_first`` on a GPU, where XLA:GPU lowers a top-k over the table to a
  sort of the table, so each of the select's digits cost a sort (H200: a heap table's
  insert 64 + sample 64 step 240 us with the select, 154 us with one sort; BUILD.md "On
  XLA:GPU", second measurements). ``b <= C`` static; ``eligible`` bool[C].
  """
  select = functools.partial(select_first, selector, b=b)
  by_sort = functools.partial(sort_first, selector, b=b)
  return lax.platform_dependent(state, eligible, cuda=by_sort, rocm=by_sort, default=select)


def sort_first(selector, state, eligible, b: int):
  """``first_eligible``'s rows by one multi-operand sort of the table (O(C log C)): the
  eligible first, then the order keys as ``select_first`` compares them
  (``ascending_u32`` words: ``-0.0`` ties with ``0.0``), then the slot."""
  c = eligible.shape[0]
  words = [ascending_u32(k) for k in order_keys(selector, state)]
  out = lax.sort(((~eligible).astype(jnp.int32), *words, jnp.arange(c, dtype=jnp.int32)),
                 num_keys=1 + len(words))
  n = jnp.sum(eligible, dtype=jnp.int32)
  return jnp.where(jnp.arange(b) < n, out[-1][:b], -1), n


def select_first(selector, state, eligible, b: int):
  """``first_eligible``'s rows without sorting the table: a radix select
  whose digits are picked by ``lax.top_k`` (XLA:CPU runs float32 top-k as a tuned
  O(C log b) kernel; a sort of C multi-operand rows compiles a comparator call per
  comparison: 10-17 ms at C = 65,536). The keys' bits (64 for the heaps and the version
  orders, 32 for Fifo / Lifo) are cut into ``DIGIT_BITS`` digits. ``cand`` holds the
  eligible slots that tie with the rows still to choose on every digit so far, ``need``
  how many rows those are. Per digit, a top-k of the candidates' scores gives the
  ``need``-th smallest digit (the threshold) and, in its first places, the candidates
  below it: those are chosen; the ones on it stay candidates. The last digit's top-k
  takes its first ``need`` (below, then tied by slot: ``lax.top_k`` puts equal values
  lower index first). The ``b`` chosen rows are then sorted by (keys, slot).
  O(C) a digit (O(C log b) for rising scores, see ``_scan_backwards``) + O(b log b); no
  condition, no loop. (Keys are unique in practice: ages and touch stamps are.)

  ``b <= C`` static; ``eligible`` bool[C].
  """
  c = eligible.shape[0]
  words = [ascending_u32(k) for k in order_keys(selector, state)]
  n = jnp.sum(eligible, dtype=jnp.int32)
  total = jnp.minimum(n, b)
  digits = _digits(words)
  cand, need, pieces = eligible, total, []  # pieces: (slots int32[b] best first, count)
  for j, d in enumerate(digits):
    score = jnp.where(cand, -lax.bitcast_convert_type(d + jnp.uint32(MIN_NORMAL_BITS),
                                                       jnp.float32), -jnp.inf)
    if j == len(digits) - 1:  # in slot order: ties by slot (few candidates are left)
      pieces.append((lax.top_k(score, b)[1].astype(jnp.int32), need))
      break
    if _scan_backwards(selector):  # only the values and the strictly better matter here
      top, idx = lax.top_k(score[::-1], b)
      idx = c - 1 - idx.astype(jnp.int32)
    else:
      top, idx = lax.top_k(score, b)
    thr = jnp.where(need > 0, top[jnp.maximum(need - 1, 0)], jnp.inf)
    better = jnp.sum(top > thr, dtype=jnp.int32)  # all in ``top``: thr is in it
    pieces.append((idx.astype(jnp.int32), better))
    need = need - better
    cand = score == thr  # none for need 0 (thr inf)
  p = jnp.arange(b, dtype=jnp.int32)
  rows, start = jnp.zeros((b,), jnp.int32), jnp.int32(0)
  for idx, count in pieces:
    here = (p >= start) & (p < start + count)
    rows = jnp.where(here, idx[jnp.clip(p - start, 0, b - 1)], rows)
    start = start + count
  valid = p < total
  keys = [jnp.where(valid, w[rows], 0) for w in words]
  slots = lax.sort((~valid, *keys, rows), num_keys=2 + len(keys))[-1]
  return jnp.where(valid, slots, -1), n
