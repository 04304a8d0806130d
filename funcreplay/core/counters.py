"""Two-word unsigned counters that stay exact past 2**32 operations.

JAX runs with 32-bit integers unless ``jax_enable_x64`` is set, and long RL
runs perform billions of inserts and samples. A counter is therefore a
``uint32[2]`` array ``[hi, lo]`` holding ``hi * 2**32 + lo``: it wraps only
after 2**64 operations. All functions are pure and jit-friendly.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

_U32 = jnp.uint32


def zero() -> jnp.ndarray:
  """A counter holding 0: ``uint32[2]``."""
  return jnp.zeros((2,), _U32)


def from_int(value: int) -> jnp.ndarray:
  """A counter holding the Python int ``value`` (0 <= value < 2**64)."""
  if not 0 <= value < 2**64:
    raise ValueError(f"counter value must be in [0, 2**64), got {value}")
  return jnp.asarray([value >> 32, value & 0xFFFFFFFF], _U32)


def to_int(counter) -> int:
  """Exact Python int of a counter (host side)."""
  hi, lo = np.asarray(counter, dtype=np.uint64)
  return int(hi) * 2**32 + int(lo)


def to_float(counter) -> jnp.ndarray:
  """float32 approximation of a counter, for ratios inside jit."""
  c = counter.astype(jnp.float32)
  return c[0] * jnp.float32(2.0**32) + c[1]


def add(counter, n) -> jnp.ndarray:
  """``counter + n`` for a scalar ``n`` in [0, 2**32), with carry."""
  n = jnp.asarray(n).astype(_U32)
  lo = counter[1] + n  # wraps modulo 2**32
  carry = (lo < counter[1]).astype(_U32)
  return jnp.stack([counter[0] + carry, lo])


# A half sum of this many values fits uint32: CHUNK * (2**16 - 1) < 2**32.
CHUNK = 1 << 16


def half_sums(values, where=None):
  """``(lo16, hi16)``: uint32 sums of the low and high 16-bit halves of ``values[where]``
  (non-negative int32/uint32, at most ``CHUNK`` = 65,536 of them, so neither sum
  overflows; ``total`` takes any number).

  One reduction of the two halves stacked, not two sums: XLA:CPU runs a sum of more
  than 32 elements as two operations (a windowed reduction, then a reduction), so two
  sums of a B = 64 batch were four operations of a scan step (BUILD.md finding 20).
  """
  v = _flat(values, where)
  lo16, hi16 = jnp.sum(jnp.stack([v & _U32(0xFFFF), v >> _U32(16)]), axis=-1, dtype=_U32)
  return lo16, hi16


def _flat(values, where):
  v = jnp.asarray(values).astype(_U32)
  if where is not None:
    v = jnp.where(where, v, _U32(0))
  return v.reshape(-1)  # every element, whatever the shape


def _two_words(lo16, hi16):
  """``(hi, lo)`` of ``hi16 * 2**16 + lo16`` (uint32 arrays, elementwise)."""
  lo = ((hi16 & _U32(0xFFFF)) << _U32(16)) + lo16
  return (hi16 >> _U32(16)) + (lo < lo16).astype(_U32), lo


def total(values, where=None):
  """``(hi, lo)``: the exact two-word ``sum(values[where])`` (non-negative int32/uint32).

  Up to ``CHUNK`` values: the two half sums (``half_sums``, one reduction). More (a
  sample with replacement of more than 65,536 rows, an eviction pass over a larger
  table): the half sums of each chunk of ``CHUNK`` values, whose low words are summed
  the same way again (at most ``CHUNK`` chunks, i.e. 2**32 values) and whose high words
  are small (each below 2**16). The number of values is static, so the program is the
  one-reduction program whenever it can be.
  """
  v = _flat(values, where)
  n = v.shape[0]
  if n <= CHUNK:
    return _two_words(*half_sums(v))
  k = -(-n // CHUNK)
  if k > CHUNK:
    raise ValueError(f"counters.total: at most 2**32 values, got {n}.")
  v = jnp.concatenate([v, jnp.zeros((k * CHUNK - n,), _U32)]).reshape(k, CHUNK)
  lo16, hi16 = jnp.sum(jnp.stack([v & _U32(0xFFFF), v >> _U32(16)]), axis=-1, dtype=_U32)
  hi_k, lo_k = _two_words(lo16, hi16)     # chunk k's sum: hi_k * 2**32 + lo_k
  hi, lo = total(lo_k)                    # k <= CHUNK low words: exact
  return hi + jnp.sum(hi_k, dtype=_U32), lo


def add_sum(counter, values, where=None) -> jnp.ndarray:
  """``counter + sum(values[where])`` exactly (``total``; non-negative int32/uint32)."""
  hi, lo = total(values, where)
  counter = add(counter, lo)
  return counter.at[0].add(hi)
