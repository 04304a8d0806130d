"""``priority**alpha`` in integer arithmetic: the same float32 bits on every backend.

Why. A prioritized table stores ``w = p**alpha`` in its sum tree, and every draw reads
the tree, so the weight's last bit decides which item a key draws near a boundary.
``jnp.power`` is not the same function everywhere: XLA:CPU calls libm's ``powf``,
XLA:GPU libdevice's ``__nv_powf``, and JAX itself rewrites ``alpha = 0.5`` into a
square root and whole ``alpha`` into multiplications. Measured on an H100 (jax 0.11.2,
tests/core/test_backends.py): the weight trees of CPU and GPU parted after the first
insert for ``alpha = 0.6`` and ``0.8``. Float formulas do not fix this either: a
backend may contract ``a * b + c`` into one fused multiply-add (XLA:GPU does), which
rounds once instead of twice. Integer arithmetic is exact on every backend, so this
module computes the weight with 32-bit integer operations only, and the native
kernels (native/csrc/powers.h) run the same steps with the same tables.

Algorithm, for a float32 ``x = 2**e * m`` (``m`` in [1, 2)), fixed point throughout
(``Q.k``: an integer holding ``value * 2**k``):

1. ``log2(m) = log2(m_i) + log2(1 + u)``: ``m_i = 1 + i/256`` from the top 8 mantissa
   bits ``i``; ``u = (m - m_i) / m_i < 2**-8`` from a table of ``1/m_i``; ``ln(1 + u)``
   by its series to ``u**3`` (error < 2**-34), times ``1/ln 2``. ``L = log2(m)`` Q.32.
2. ``y = alpha * (e + L)`` exactly: ``alpha``'s float32 value is ``M * 2**E`` with an
   integer ``M < 2**24``; ``M * (e * 2**32 + L)`` is a signed 64-bit integer (two
   words: ``M * e`` in int32, ``M * L`` by a 32x32 -> 64-bit product), and shifting it
   by ``32 - E`` splits ``y`` into ``floor(y)`` and its fraction ``f`` Q.32.
3. ``2**f = 2**(j/256) * 2**r``: ``j`` the top 8 bits of ``f`` (a table, Q.30), ``2**r =
   exp(r ln 2)`` by its series to the cube (error < 2**-38, ``r < 2**-8``).
4. Round the Q.30 mantissa to 24 bits (half up), add ``floor(y) + 127`` as the exponent:
   below the smallest normal float32 the weight is 0 (as XLA:CPU flushes it).
5. Saturate at ``MAX_WEIGHT = 2**96``: a sum tree adds up to ``2**31`` weights in float32
   (about ``2**128`` at most), so a larger weight, or the sum of many large ones, would
   reach inf, and every draw of an inf (or NaN) total would pick the table's first
   eligible slot with probability 0. Capped, a tree's total stays below ``2**127 *
   (1 + 2**-19)`` for any capacity: priorities whose weight would exceed ``2**96`` (about
   7.9e28; ``p > 2.8e14`` at ``alpha = 2``) all weigh ``2**96``, the most likely items
   and equally likely among themselves. Reverb keeps doubles; float32 cannot hold their
   range, and this is the one place where the two differ for finite priorities.

Error: under 0.6 ulp of the exact ``p**alpha`` for ``alpha`` up to 16 (measured by
tests/core/test_powers.py against float64 over every binade): 0.5 ulp from the final
rounding, and ``L``'s 2**-32 step times ``alpha`` (about ``alpha / 370`` ulp: 0.9 ulp at
alpha 100, ~50 at 16384, the largest exponents only of use for near-1 priorities).
``alpha = 0`` and ``alpha = 1`` are exact (1 and ``p``), decided when the program is built.

Inputs: ``p <= 0`` (and -0.0) gives 0; a positive ``p`` below ``numerics.TINY`` counts as
``TINY`` (denormals included, compared as bits, so no backend's flush-to-zero mode
matters); ``+inf`` gives inf (1 for ``alpha = 0``); NaN stays NaN (the tables store
both as 0, ``ops.rows.sanitize_priorities``, before they reach here). Cost: about 110
integer operations per element (eight 32x32 -> 64-bit products of 16-bit halves), fused
into the surrounding elementwise work; O(1) per element, no loop.
"""

from __future__ import annotations

import decimal
import functools
import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import fixedpoint, numerics, powers_tables

# 256 entries per table: the series after the table lookup then run on |u|, r < 2**-8,
# where three terms are exact to 2**-34 (a 64-entry table would need five).
INDEX_BITS = 8
# The largest alpha the integer path takes: ``alpha = M * 2**E`` must leave a shift
# ``32 - E >= 40`` (step 2), i.e. alpha < 2**15. Above it p**alpha is 0 or inf for every
# float32 p outside [0.9973, 1.0027] anyway.
MAX_EXPONENT = 2.0**15

_TINY_BITS = int(np.float32(numerics.TINY).view(np.uint32))
_MIN_NORMAL_BITS = 0x00800000
_MAX_FINITE_BITS = 0x7F7FFFFF
# Step 5 of the module doc: every finite weight is at most 2**96, so a float32 sum of up to
# 2**31 of them stays finite. The kernels' kMaxWeightBits (native/csrc/powers.h) is this.
MAX_WEIGHT = 2.0**96
_MAX_WEIGHT_BITS = int(np.float32(MAX_WEIGHT).view(np.uint32))
_INF_BITS = 0x7F800000


@functools.lru_cache(maxsize=None)
def constants() -> dict:
  """The tables and constants (``powers_tables``): ``tables`` uint32[3, 256] (``log2_m``
  Q.32, ``recip_m`` Q.32, ``1/m_i`` with the first entry ``2**32 - 1``, ``exp2_j`` Q.30)
  and the scalars ``inv_ln2`` Q.31, ``ln2`` Q.32, ``third`` / ``sixth`` Q.32.
  native/csrc/powers.h receives these same arrays."""
  t = powers_tables
  return dict(tables=np.array([t.LOG2_M, t.RECIP_M, t.EXP2_J], np.uint32),
              inv_ln2=t.INV_LN2, ln2=t.LN2, third=t.THIRD, sixth=t.SIXTH)


@functools.lru_cache(maxsize=None)
def words() -> np.ndarray:
  """uint32[3 * 256 + 4]: ``constants()`` flattened as native/csrc/powers.h reads them
  (``kPowWords``: the three tables, then inv_ln2, ln2, third, sixth). Read-only."""
  c = constants()
  out = np.concatenate([c["tables"].ravel(), np.array(
      [c["inv_ln2"], c["ln2"], c["third"], c["sixth"]], np.uint32)])
  out.setflags(write=False)
  return out


def compute_constants() -> dict:
  """``constants()`` computed afresh, correctly rounded (``decimal`` at 60 digits, so the
  same integers on every machine; ~1 s): how ``powers_tables`` was made, and its test."""
  ctx = decimal.Context(prec=60, rounding=decimal.ROUND_HALF_EVEN)
  d = decimal.Decimal
  ln2 = ctx.ln(d(2))
  n = 1 << INDEX_BITS

  def q(x, bits):
    return int(ctx.multiply(x, d(2) ** bits).to_integral_value(rounding=decimal.ROUND_HALF_EVEN))

  m = [ctx.add(d(1), ctx.divide(d(i), d(n))) for i in range(n)]
  log2_m = [q(ctx.divide(ctx.ln(x), ln2), 32) for x in m]
  recip_m = [min(q(ctx.divide(d(1), x), 32), (1 << 32) - 1) for x in m]
  exp2_j = [q(ctx.exp(ctx.multiply(ctx.divide(d(j), d(n)), ln2)), 30) for j in range(n)]
  return dict(
      tables=np.array([log2_m, recip_m, exp2_j], np.uint32),
      inv_ln2=q(ctx.divide(d(1), ln2), 31), ln2=q(ln2, 32),
      third=q(ctx.divide(d(1), d(3)), 32), sixth=q(ctx.divide(d(1), d(6)), 32))


def exponent_parts(alpha: float):
  """``(M, E)`` with ``float32(alpha) == M * 2**E`` exactly, ``M`` an int < 2**24."""
  a = float(np.float32(alpha))
  if not (0 <= a < MAX_EXPONENT):
    raise ValueError(f"priority exponent {alpha!r}: expected 0 <= alpha < {MAX_EXPONENT:g}.")
  frac, ex = math.frexp(a)  # a = frac * 2**ex, frac in [0.5, 1)
  return int(frac * (1 << 24)), ex - 24


def _u32(x):
  return jnp.uint32(x)


def _log2_fraction(x, c):
  """uint32 ``log2(m)`` Q.32 of positive finite normal float32 bits ``x`` (step 1)."""
  t = c["tables"]
  f = x & 0x7FFFFF
  i = (f >> (23 - INDEX_BITS)).astype(jnp.int32)
  low = f & ((1 << (23 - INDEX_BITS)) - 1)  # m - m_i, Q.23
  u = fixedpoint.mulhi(low << (17 + INDEX_BITS - 8), jnp.asarray(t[1])[i])  # Q.40, < 2**32
  u2 = fixedpoint.mulhi(u, u)  # Q.48
  u3 = fixedpoint.mulhi(u2, u)  # Q.56
  ln = u - (u2 >> 9) + (fixedpoint.mulhi(u3, _u32(c["third"])) >> 16)  # ln(1 + u), Q.40
  log = fixedpoint.mulhi(ln, _u32(c["inv_ln2"]))  # log2(1 + u), Q.39
  return jnp.asarray(t[0])[i] + (log >> 7)


def _exp2_fraction(f, c):
  """uint32 ``2**f`` Q.30 (in [2**30, 2**31)) of uint32 ``f`` Q.32 (step 3)."""
  j = (f >> (32 - INDEX_BITS)).astype(jnp.int32)
  r = f & ((1 << (32 - INDEX_BITS)) - 1)  # Q.32, < 2**-8
  t = fixedpoint.mulhi(r << INDEX_BITS, _u32(c["ln2"]))  # r ln 2, Q.40
  t2 = fixedpoint.mulhi(t, t)  # Q.48
  t3 = fixedpoint.mulhi(t2, t)  # Q.56
  s = t + (t2 >> 9) + (fixedpoint.mulhi(t3, _u32(c["sixth"])) >> 16)  # 2**r - 1, Q.40
  b = jnp.asarray(c["tables"][2])[j]
  return b + (fixedpoint.mulhi(b, s) >> 8)


def _split(hi, lo, shift: int):
  """``(floor(P / 2**shift) as int32, (P >> (shift - 32)) mod 2**32 as uint32)`` of the
  signed 64-bit ``P = hi * 2**32 + lo`` (int32 ``hi``, uint32 ``lo``), ``shift >= 40``."""
  k = shift - 32  # >= 8: the fraction's lowest bit in P
  whole = hi >> min(k, 31)  # arithmetic: floor for negative P too
  hi_u = lax.bitcast_convert_type(hi, jnp.uint32)
  if k < 32:
    frac = (hi_u << (32 - k)) | (lo >> k)
  else:
    frac = lax.bitcast_convert_type(hi >> min(k - 32, 31), jnp.uint32)
  return whole, frac


def power(priority, alpha: float):
  """float32 ``priority**alpha`` (module doc: same bits on every backend).

  Args:
    priority: float32 array, any shape.
    alpha: static Python float, ``0 <= alpha < MAX_EXPONENT``.
  Returns:
    float32, ``priority``'s shape: 0 where ``priority <= 0``, at most ``MAX_WEIGHT`` where
    ``priority`` is finite.
  """
  m_a, e_a = exponent_parts(alpha)
  bits = lax.bitcast_convert_type(jnp.asarray(priority, jnp.float32), jnp.uint32)
  positive = lax.bitcast_convert_type(bits, jnp.int32) > 0  # sign bit clear, not +0.0
  special = bits >= _INF_BITS  # +inf, NaN (negative ones are not ``positive``)
  x = jnp.clip(bits, _u32(_TINY_BITS), _u32(_MAX_FINITE_BITS))
  if m_a == 0:
    out = jnp.where(special & (bits > _INF_BITS), bits, _u32(np.float32(1).view(np.uint32)))
  elif m_a == 1 << 23 and e_a == -23:  # alpha == 1
    out = jnp.where(special, bits, x)
  else:
    c = constants()
    e = (x >> 23).astype(jnp.int32) - 127
    big_l = _log2_fraction(x, c)
    # P = M * (e * 2**32 + L): hi = M*e + mulhi(M, L) (|.| < 2**31), lo = M*L mod 2**32.
    hi = e * m_a + fixedpoint.mulhi(big_l, _u32(m_a)).astype(jnp.int32)
    lo = big_l * _u32(m_a)
    whole, frac = _split(hi, lo, 32 - e_a)
    mant = (_exp2_fraction(frac, c) + 64) >> 7  # 24 bits, or 2**24 when it rounds up
    carry = mant >> 24
    biased = whole + 127 + carry.astype(jnp.int32)
    normal = ((jnp.clip(biased, 1, 254).astype(jnp.uint32) << 23) | (mant & 0x7FFFFF))
    out = jnp.where(biased >= 255, _u32(_INF_BITS), jnp.where(biased <= 0, _u32(0), normal))
    out = jnp.where(special, bits, out)
  # Step 5 (positive floats order as their bits): finite priorities weigh <= MAX_WEIGHT.
  out = jnp.where(special, out, jnp.minimum(out, _u32(_MAX_WEIGHT_BITS)))
  out = jnp.where(positive, out, _u32(0))
  return lax.bitcast_convert_type(out, jnp.float32)


def positive(priority, alpha: float):
  """bool: ``power(priority, alpha) > 0``, without the power where ``alpha <= 1``: there
  a positive priority (>= TINY once clamped) has a positive normal weight, so the weight
  is 0 exactly when ``priority <= 0`` (compared as bits, like ``power``). Above 1 the
  power can underflow to 0, and is computed."""
  if alpha <= 1:
    bits = lax.bitcast_convert_type(jnp.asarray(priority, jnp.float32), jnp.int32)
    return bits > 0
  return power(priority, alpha) > 0


def race_keys(bits, weight):
  """float32 ``-log2(u) / (weight * 2**-e)``: exponential races for a weighted draw
  without replacement (the smallest keys; Efraimidis & Spirakis), the same bits on every
  backend. ``e`` is the exponent of the largest weight, so the keys are those of
  ``-log2(u) / weight`` times one power of two: the same order, and no key underflows
  to 0 (which ``divide`` flushes; 91% of them for weights near 3e38) nor a small weight
  clamps to ``TINY`` unless it is ``2**-100`` of the largest (then it races at ``TINY``,
  still eligible, its chance negligible).

  ``u = 1 - f`` in ``[2**-23, 1]`` from the top 23 of the uint32 ``bits`` (``f`` on a
  2**-23 grid: both steps exact); ``-log2(u) = -e_u - L / 2**32`` from step 1's integer
  ``log2`` of ``u = 2**e_u m``, subtracted in integers (``-log2 u`` Q.32 in two words: no
  cancellation for ``u`` near 1) and rounded to float32 (error: ``L``'s, ~2**-32
  absolute); the weights scaled by moving their exponents (integers); the division
  correctly rounded (``fixedpoint.divide``). ``jnp.log`` differs between XLA:CPU and
  XLA:GPU, and ``jax.random.uniform``'s ``x * (max - min) + min`` may become one fused
  multiply-add on a GPU.

  Args:
    bits: uint32, ``weight``'s shape (or broadcast to it).
    weight: float32 ``[N]``, all the race's weights: ``+inf`` races at 0 (first); 0,
      negatives, NaN and denormals (compared as bits: a backend's flush-to-zero mode
      does not matter) at ``inf``, never taken.
  """
  one = np.float32(1).view(np.uint32)
  f = lax.bitcast_convert_type((jnp.asarray(bits, jnp.uint32) >> 9) | _u32(one),
                               jnp.float32) - 1.0
  x = lax.bitcast_convert_type(1.0 - f, jnp.uint32)  # u, a normal float in [2**-23, 1]
  whole = 127 - (x >> 23).astype(jnp.int32)  # -floor(log2 u), in [0, 23]
  frac = _log2_fraction(x, constants())  # log2(mantissa) Q.32: -log2 u = whole - frac/2**32
  # whole * 2**32 - frac = hi * 2**32 + lo: a borrow from ``whole`` when frac > 0.
  hi = (whole - (frac > 0).astype(jnp.int32)).astype(jnp.float32)  # exact (< 2**5)
  lo = (_u32(0) - frac).astype(jnp.float32) * np.float32(2.0**-32)  # rounded once; exact scale
  neg_log2 = hi + lo  # < 24: one more rounding (a product by 2**-32 is exact, so an FMA is too)
  wb = lax.bitcast_convert_type(jnp.asarray(weight, jnp.float32), jnp.int32)
  normal = (wb >= _MIN_NORMAL_BITS) & (wb < _INF_BITS)  # positive, normal, finite
  top = jnp.max(jnp.where(normal, wb, _MIN_NORMAL_BITS)) >> 23  # the largest's biased exponent
  biased = (wb >> 23) - top + 127  # each weight's exponent once the largest's is 0
  scaled = jnp.maximum(jnp.where(biased >= 1, (biased << 23) | (wb & 0x7FFFFF), 0),
                       _TINY_BITS)  # below TINY: TINY (positive floats order as their bits)
  key = fixedpoint.divide(neg_log2, lax.bitcast_convert_type(scaled, jnp.float32))
  key = jnp.where(normal, key, jnp.float32(np.inf))
  return jnp.where(wb == _INF_BITS, jnp.float32(0.0), key)
