"""``core.powers.power``: ``p**alpha`` in integer arithmetic (the same bits on every backend).

Accuracy against float64 over every binade of float32, the edge inputs (zeros, negatives,
denormals, TINY, inf, NaN), exactness of alpha 0 and 1, monotonicity, and the exponent
range. Bit-equality with the C++ copy (native/csrc/powers.h) is checked through the direct
priority update (tests/host/test_direct.py), and CPU vs GPU by tests/core/test_backends.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay.core import numerics, powers

_TINY = np.float32(numerics.TINY)
_F32_MIN = np.finfo(np.float32).tiny


def _power(x, alpha):
  return np.asarray(jax.jit(lambda p: powers.power(p, alpha))(jnp.asarray(x, jnp.float32)))


def _floats(n, seed):
  """float32 from TINY to the largest finite, uniform over the bit patterns (every binade)."""
  lo = int(_TINY.view(np.uint32))
  return np.random.default_rng(seed).integers(lo, 0x7F7FFFFF, n, dtype=np.uint32).view(
      np.float32)


@pytest.mark.parametrize("alpha", [1e-6, 0.01, 0.3, 0.5, 0.6, 0.7, 1.5, 2.0, 3.0, 7.25, 16.0])
def test_within_one_ulp_of_float64(alpha):
  x = np.concatenate([_floats(100_000, int(alpha * 1000)),
                      np.float32([1.0, 2.0, 0.5, 1.5, 3.0, 1e-30, 3.4e38, 1.0000001])])
  got = _power(x, alpha).astype(np.float64)
  want = np.power(x.astype(np.float64), float(np.float32(alpha)))
  normal = (want >= _F32_MIN) & (want <= powers.MAX_WEIGHT)
  ulp = np.spacing(want[normal].astype(np.float32)).astype(np.float64)
  err = np.abs(got[normal] - want[normal]) / ulp
  assert err.max() < 0.6, (alpha, err.max())  # measured 0.51-0.55: about correctly rounded
  # Below float32's normal range: 0 (flushed, as XLA:CPU does); above MAX_WEIGHT (2**96,
  # float32's largest value and beyond included): MAX_WEIGHT, so sum trees stay finite.
  assert np.all(got[want < _F32_MIN] == 0)
  assert np.all(got[want > powers.MAX_WEIGHT] == powers.MAX_WEIGHT)
  assert (want > powers.MAX_WEIGHT).any() or alpha < 1  # the sample reaches the cap


@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_weights_saturate_at_max_weight(alpha):
  """Finite priorities weigh at most 2**96 (``powers`` step 5), exactly at the boundary
  too; alpha = 1 (the weight is the priority) included."""
  cap = np.float32(powers.MAX_WEIGHT)
  root = np.float32(powers.MAX_WEIGHT ** (1 / alpha))  # exact: 2**96, 2**48
  x = np.float32([root, np.nextafter(root, np.float32(0)), np.nextafter(root, np.inf),
                  3.4e38, np.finfo(np.float32).max])
  got = _power(x, alpha)
  assert got[0] == cap and got[1] < cap
  np.testing.assert_array_equal(got[2:], np.full(3, cap))


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_alpha_zero_and_one_are_exact(alpha):
  x = _floats(10_000, 3)
  want = np.ones_like(x) if alpha == 0 else np.minimum(x, np.float32(powers.MAX_WEIGHT))
  np.testing.assert_array_equal(_power(x, alpha), want)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, 2.0])
def test_edge_inputs(alpha):
  x = np.float32([0.0, -0.0, -1.0, -np.inf, np.inf, np.nan, 1e-45, 1e-38, 1e-31, 1e-30])
  got = _power(x, alpha)
  assert np.all(got[:4] == 0)  # p <= 0 (and -inf): weight 0
  assert got[4] == (1.0 if alpha == 0 else np.inf)
  assert np.isnan(got[5])
  # Positive p below TINY (denormals too, compared as bits) count as TINY.
  np.testing.assert_array_equal(got[6:], np.full(4, _power(np.float32([1e-30]), alpha)[0]))
  if alpha <= 1:
    assert got[6] > 0  # TINY**alpha stays a positive normal float for alpha <= 1


@pytest.mark.parametrize("alpha", [0.4, 0.6, 2.5])
def test_monotonic_in_the_priority(alpha):
  x = np.sort(_floats(50_000, 7))
  w = _power(x, alpha)
  assert np.all(w[1:] >= w[:-1])  # (inf - inf is NaN: compare, do not subtract)


def test_exponent_range_is_checked_up_front():
  # 32767.9995 is below 2**15 but its float32 value (the one used) is 32768.0.
  for bad in (-0.5, 2.0**15, 32767.9995, float("inf"), float("nan"), 1e300):
    with pytest.raises(ValueError, match="priority_exponent"):
      fr.Prioritized(bad)
  with pytest.raises(ValueError, match="alpha"):
    powers.exponent_parts(2.0**15)
  fr.Prioritized(2.0**15 - 1)  # the largest accepted: the integer path still applies
  w = _power(np.float32([1.0, 1.0001, 0.9999]), 2.0**15 - 1)
  assert w[0] == 1.0 and np.isfinite(w[1]) and w[1] > 1 and 0 < w[2] < 1


def test_tables_are_the_correctly_rounded_values():
  c = powers.constants()
  fresh = powers.compute_constants()  # the literals of powers_tables, recomputed
  np.testing.assert_array_equal(c["tables"], fresh["tables"])
  assert {k: c[k] for k in fresh if k != "tables"} == {k: fresh[k] for k in fresh
                                                        if k != "tables"}
  i = np.arange(1 << powers.INDEX_BITS, dtype=np.float64)
  m = 1 + i / len(i)
  log2_m, recip_m, exp2_j = c["tables"].astype(np.float64)
  np.testing.assert_allclose(log2_m / 2**32, np.log2(m), rtol=0, atol=2**-32)
  np.testing.assert_allclose(recip_m / 2**32, 1 / m, rtol=0, atol=2**-32)
  np.testing.assert_allclose(exp2_j / 2**30, 2 ** (i / len(i)), rtol=0, atol=2**-30)
  assert c["third"] == round(2**32 / 3) and c["sixth"] == round(2**32 / 6)


def _race_keys(bits, w):
  return np.asarray(jax.jit(powers.race_keys)(np.asarray(bits, np.uint32),
                                              np.asarray(w, np.float32)))


def test_race_keys_are_minus_log2_u_over_the_weight():
  """``race_keys``: ``-log2(u) / (w 2**-e)`` with ``u = 1 - top23(bits) / 2**23`` and ``e``
  the largest weight's exponent, within 1e-6 relative (float32 roundings) plus 2**-30 / w
  (the integer log2's error) of float64, over random and edge bits and weights; weight 0
  gives inf, ``u = 1`` gives 0, and the keys rise with the bits."""
  rng = np.random.default_rng(3)
  bits = np.concatenate([rng.integers(0, 2**32, 20000, dtype=np.uint32),
                         np.uint32([0, 511, 512, 2**31, 2**32 - 512, 2**32 - 1])])
  w = np.concatenate([np.exp(rng.uniform(-60, 30, 20000)).astype(np.float32),
                      np.float32([1.0, 1.0, 3.0, 1e-20, 2.5, 7.0])])
  got = _race_keys(bits, w)
  u = 1.0 - (bits >> 9).astype(np.float64) / 2**23
  scale = 2.0 ** -np.frexp(w.max())[1] * 2  # the largest weight's exponent to 0
  ws = np.maximum(w.astype(np.float64) * scale, np.float32(numerics.TINY))  # below: TINY
  want = -np.log2(u) / ws
  # The integer log2's own error (~2**-32 absolute in -log2 u) shows where u is near 1.
  err = np.abs(got - want)
  assert (err <= 1e-6 * want + 2.0**-30 / ws).all(), np.max(err - 1e-6 * want)
  assert got[-6] == 0.0 and got[-5] == 0.0  # bits < 512: u = 1
  zero_w = _race_keys(bits[:4], [0, 0, 1, 0])
  assert np.isinf(zero_w[[0, 1, 3]]).all() and np.isfinite(zero_w[2])
  ordered = np.sort(rng.integers(0, 2**32, 5000, dtype=np.uint32))
  assert (np.diff(_race_keys(ordered, np.ones(5000))) >= 0).all()


@pytest.mark.parametrize("weights,first", [
    ([3e38, 3e38], 0.5),  # keys near 0: without the scaling 91% underflowed to 0 (a tie)
    ([1e-31, 1e-33], 0.99),  # below TINY: without the scaling both raced at TINY
    ([1.0, 3.0], 0.25)])
def test_race_keys_pick_in_proportion_at_any_scale(weights, first):
  """The first of two races is won in proportion to the weights, however large or small
  (one power of two scales them all): 20,000 races, within 4 standard deviations."""
  n = 20000
  bits = np.random.default_rng(8).integers(0, 2**32, (n, 2), dtype=np.uint32)
  keys = np.asarray(jax.jit(jax.vmap(lambda b: powers.race_keys(b, jnp.float32(weights))))(bits))
  p = np.mean(keys[:, 0] < keys[:, 1])
  assert abs(p - first) < 4 * np.sqrt(first * (1 - first) / n) + 1e-9, p


def test_race_keys_odd_weights():
  """inf races first (key 0); 0, negatives, NaN and denormals never (inf, compared as
  bits); a weight 2**-100 of the largest or less races at TINY: still finite."""
  w = np.float32([np.inf, 0.0, -1.0, np.nan, 1e-40, 1.0, 1e-35])
  k = _race_keys(np.full(7, 2**31, np.uint32), w)
  assert k[0] == 0.0 and np.isinf(k[1:5]).all() and np.isfinite(k[5:]).all()
  assert k[6] > k[5]
