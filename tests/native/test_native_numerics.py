"""The kernels' integer ``p**alpha`` and division (native/csrc/powers.h, fixedpoint.h) give
the bits of ``core.powers.power`` and ``core.fixedpoint.divide`` on every input tried: the
float32 bit patterns at random (NaN, inf, denormals, negatives included), the neighbours of
1.0 and of every power of two, and exponents across the accepted range."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from funcreplay.core import fixedpoint, powers
from funcreplay.native import build
from tests.helpers import require_native_kernels

_P = ctypes.c_void_p


@pytest.fixture(scope="module")
def lib():
  require_native_kernels()
  lib = build.library()
  lib.funcreplay_power_weights.argtypes = [_P, ctypes.c_float, ctypes.c_int64, _P, _P]
  lib.funcreplay_divide_exact.argtypes = [ctypes.c_int64, _P, _P, _P, ctypes.c_int32]
  return lib


def _inputs(seed):
  rng = np.random.default_rng(seed)
  one = np.float32(1).view(np.uint32)
  near_one = one + np.arange(-3000, 3000).astype(np.int64)
  pow2 = (np.arange(1, 255, dtype=np.int64) << 23)[:, None] + np.array([-1, 0, 1])
  bits = np.concatenate([rng.integers(0, 2**32, 200_000, dtype=np.uint64), near_one,
                         pow2.ravel()]).astype(np.uint32)
  return bits.view(np.float32)


@pytest.mark.parametrize("alpha", [0.0, 1e-30, 2.0**-40, 0.3, 0.5, 0.6, 1.0, 1.5, 2.0, 7.3,
                                   1234.567, float(np.nextafter(np.float32(2**15), 0))])
def test_kernel_power_equals_portable(lib, alpha):
  x = _inputs(int(alpha * 1e6) % 2**31)
  want = np.asarray(jax.jit(lambda p: powers.power(p, alpha))(jnp.asarray(x)))
  got = np.empty_like(x)
  words = powers.words()
  lib.funcreplay_power_weights(words.ctypes.data, float(np.float32(alpha)), x.size,
                               x.ctypes.data, got.ctypes.data)
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_kernel_divide_equals_portable(lib):
  rng = np.random.default_rng(1)
  n = 300_000
  num = rng.integers(0, 0x7F800001, n, dtype=np.uint32).view(np.float32)  # +0 .. +inf
  den = rng.integers(0x0DA24260, 0x7F800001, n, dtype=np.uint32).view(np.float32)  # TINY..inf
  # Ties at the underflow edge, equal operands, inf and NaN operands.
  extra_n = np.float32([0.99999994, 1.0, np.inf, np.inf, 3e38, np.nan, 5.0, 1e-45])
  extra_d = np.float32([2.0**126, 1.0, 2.0, np.inf, np.inf, 1.0, np.nan, 3.0])
  # Quotients around the smallest normal float (2**-126), where the flush decides.
  edge_n = rng.uniform(1, 2, 50_000).astype(np.float32)
  edge_d = (edge_n.astype(np.float64) * 2.0**126 * rng.uniform(0.999999, 1.000001, 50_000)
            ).astype(np.float32)
  num = np.concatenate([num, extra_n, edge_n])
  den = np.concatenate([den, extra_d, edge_d])
  want = np.asarray(jax.jit(fixedpoint.divide)(num, den))
  for long_division in (1, 0):  # DivideLong, the same steps; DivideExact, via double
    got = np.empty_like(num)
    lib.funcreplay_divide_exact(num.size, num.ctypes.data, den.ctypes.data, got.ctypes.data,
                                long_division)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), long_division)
