"""Integer arithmetic for float results that must have the same bits on every backend.

Two operations of the portable programs did not: ``p**alpha`` (``core.powers``) and
the float32 division behind a batch's ``info.probability``. XLA:GPU divides float32
with PTX's ``div.full.f32`` (XLA passes ``-nvptx-prec-divf32=1``: up to 2 ulp off),
XLA:CPU with the correctly rounded IEEE division; measured on an H100 (jax 0.11.2,
tests/core/test_backends.py), probabilities differed by one ulp. Integer operations
are exact everywhere, so ``divide`` computes the correctly rounded quotient from the
operands' bits: the value IEEE division gives (but for a denormal result: flushed to 0);
the native kernels run the same long division (native/csrc/fixedpoint.h).

JAX without x64 has 32-bit integers only: ``mulhi`` builds the high word of a 64-bit
product from 16-bit halves, ``divide`` runs a long division 8 bits per step.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

_F32_MIN_NORMAL_EXP = 1  # biased exponents below it are denormal: flushed to 0
_INF_BITS = 0x7F800000
_NAN_BITS = 0x7FC00000  # the quiet NaN IEEE division returns


def mulhi(a, b):
  """uint32 ``floor(a * b / 2**32)`` of uint32 ``a``, ``b`` (four 16x16-bit products,
  each fits 32 bits)."""
  a_lo, a_hi, b_lo, b_hi = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
  lh, hl = a_lo * b_hi, a_hi * b_lo
  mid = ((a_lo * b_lo) >> 16) + (lh & 0xFFFF) + (hl & 0xFFFF)
  return a_hi * b_hi + (lh >> 16) + (hl >> 16) + (mid >> 16)


def divide(num, den):
  """float32 ``num / den`` correctly rounded (to nearest, ties to even), from integers.

  Args:
    num: float32, ``>= 0`` (0 gives 0; a denormal counts as 0); ``+inf`` and NaN as IEEE.
    den: float32, positive: a normal float (callers pass ``max(x, numerics.MIN_TOTAL)``) or
      ``+inf`` (a weight total that overflowed); broadcastable against ``num``.
  Returns:
    float32: the IEEE quotient (``x / inf = 0``, ``inf / x = inf``, ``inf / inf`` NaN),
    except that a result below the smallest normal float32 is 0 (as XLA:CPU flushes
    denormals; rounded to 24 bits first, then flushed). native/csrc/fixedpoint.h is the
    same algorithm in C++.
  """
  num, den = jnp.broadcast_arrays(jnp.asarray(num, jnp.float32), jnp.asarray(den, jnp.float32))
  a = lax.bitcast_convert_type(num, jnp.uint32)
  b = lax.bitcast_convert_type(den, jnp.uint32)
  ea, eb = (a >> 23).astype(jnp.int32), (b >> 23).astype(jnp.int32)
  ma, mb = (a & 0x7FFFFF) | 0x800000, (b & 0x7FFFFF) | 0x800000  # 24-bit significands
  # q = floor(ma * 2**25 / mb) in [2**24, 2**26): one step of 1 bit, three of 8 (each
  # remainder < mb < 2**24, so remainder << 8 fits 32 bits).
  r = ma << 1
  q = r // mb
  r = r - q * mb
  for _ in range(3):
    r = r << 8
    d = r // mb
    q = (q << 8) | d
    r = r - d * mb
  wide = (q >> 25).astype(jnp.int32)  # 1: q in [2**25, 2**26), the quotient's top bit
  shift = 1 + wide.astype(jnp.uint32)
  mant = q >> shift
  half = (q >> (shift - 1)) & 1
  sticky = ((q & (shift - 1)) != 0) | (r != 0)  # bits below the rounding bit
  mant = mant + (half & (sticky | ((mant & 1) == 1)).astype(jnp.uint32))
  carry = (mant >> 24).astype(jnp.int32)  # the rounding reached 2**24
  biased = ea - eb + 126 + wide + carry
  bits = (jnp.clip(biased, 1, 254).astype(jnp.uint32) << 23) | (mant & 0x7FFFFF)
  bits = jnp.where(biased >= 255, jnp.uint32(0x7F800000), bits)
  bits = jnp.where((biased < _F32_MIN_NORMAL_EXP) | (ea == 0), jnp.uint32(0), bits)
  # Non-finite operands (exponent 255), as IEEE: the long division above read them as 2**128.
  nan = (a > _INF_BITS) | (b > _INF_BITS) | ((a == _INF_BITS) & (b == _INF_BITS))
  bits = jnp.where(b == _INF_BITS, jnp.uint32(0), bits)
  bits = jnp.where(a == _INF_BITS, jnp.uint32(_INF_BITS), bits)
  bits = jnp.where(nan, jnp.uint32(_NAN_BITS), bits)
  return lax.bitcast_convert_type(bits, jnp.float32)
