"""``core.fixedpoint``: the 64-bit high word and the correctly rounded float32 division,
from 32-bit integers (the same bits on every backend; CPU vs GPU: test_backends.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from funcreplay.core import fixedpoint

_divide = jax.jit(fixedpoint.divide)


def test_mulhi_is_the_high_word_of_the_64_bit_product():
  rng = np.random.default_rng(0)
  a = rng.integers(0, 2**32, 200_000, dtype=np.uint64)
  b = rng.integers(0, 2**32, 200_000, dtype=np.uint64)
  a[:3], b[:3] = [0, 2**32 - 1, 2**32 - 1], [5, 2**32 - 1, 1]
  got = np.asarray(jax.jit(fixedpoint.mulhi)(jnp.asarray(a, jnp.uint32),
                                             jnp.asarray(b, jnp.uint32)))
  np.testing.assert_array_equal(got, ((a * b) >> 32).astype(np.uint32))


@pytest.mark.parametrize("lo,hi", [(0x00800000, 0x7F7FFFFF),  # every normal binade
                                   (0x3F000000, 0x40800000),  # [0.5, 4): ties are common
                                   (0x0DA24260, 0x4F000000)])  # TINY .. 2**31
def test_divide_equals_ieee_division(lo, hi):
  rng = np.random.default_rng(lo)
  a = rng.integers(lo, hi, 300_000, dtype=np.uint32).view(np.float32)
  b = rng.integers(max(lo, 0x0DA24260), hi, 300_000, dtype=np.uint32).view(np.float32)
  with np.errstate(all="ignore"):
    want = a / b
  want[np.abs(want) < np.finfo(np.float32).tiny] = 0  # flushed, as XLA:CPU flushes
  np.testing.assert_array_equal(np.asarray(_divide(a, b)).view(np.uint32), want.view(np.uint32))


def test_divide_exact_quotients_and_edges():
  n = np.arange(1, 1 << 16, dtype=np.float32)
  np.testing.assert_array_equal(np.asarray(_divide(np.float32(1), n)), np.float32(1) / n)
  got = np.asarray(_divide(np.float32([0, 1e-45, 3e38, 6.0, 1.0]),
                           np.float32([1, 1, 1e-30, 3.0, 3.0])))
  np.testing.assert_array_equal(got, np.float32([0, 0, np.inf, 2.0, np.float32(1) / 3]))


def test_divide_non_finite_operands_as_ieee():
  """A weight total can overflow to inf (priority 1e20 with alpha 2): x / inf is 0."""
  got = np.asarray(_divide(np.float32([1e38, 3e38, np.inf, np.inf, 1.0, np.nan]),
                           np.float32([np.inf, np.inf, 2.0, np.inf, np.nan, 1.0])))
  assert got[0] == 0 and got[1] == 0 and got[2] == np.inf
  assert np.all(np.isnan(got[3:]))
