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
  """int32 with the same order as the (non-negative, finite) float32 priorities."""
  return lax.bitcast_convert_type(priority.astype(jnp.float32), jnp.int32)


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
  slots = jnp.arange(state.occupied.shape[0], dtype=jnp.int32)
  a = age(state, slots)
  if isinstance(selector, sel.Fifo):
    return (~a,)          # oldest (largest age) first
  if isinstance(selector, sel.Lifo):
    return (a,)           # newest first
  if isinstance(selector, sel.MinHeap):
    return (priority_bits(state.priority), ~touch_age(state, slots))
  if isinstance(selector, sel.MaxHeap):
    return (-priority_bits(state.priority), ~touch_age(state, slots))
  if isinstance(selector, sel.StalestFirst):
    return (state.version, ~a)
  if isinstance(selector, sel.FreshestFirst):
    return (~state.version, ~a)  # ~v = -v - 1: decreasing in v, no overflow
  raise TypeError(f"{selector!r} is not a deterministic selector")


def sorted_eligible(selector, state, eligible):
  """All slots sorted by ``selector``'s order, eligible ones first.

  O(C log C): used by the deterministic samplers, which Reverb intends for
  queue- and stack-sized tables.

  Returns:
    ``(slots int32[C], is_eligible bool[C])`` in selection order.
  """
  c = eligible.shape[0]
  slots = jnp.arange(c, dtype=jnp.int32)
  inel = (~eligible).astype(jnp.int32)
  keys = (inel, *order_keys(selector, state))
  out = lax.sort((*keys, slots), num_keys=len(keys))
  return out[-1], out[0] == 0
