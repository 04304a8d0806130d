"""Random bits, uniform integers, and an exact loop-free draw without replacement.

The bit recipe (a native kernel reproduces it bit for bit):

* **Words.** ``words(key, n)`` equals ``jax.random.bits(key, (2, n), uint32)``
  (computed by an unrolled threefry here: jax's rolls into a ``while`` on CPU): with
  the threefry-2x32 PRNG and ``jax_threefry_partitionable`` (the default since
  jax 0.5), word ``k`` of the flattened ``[2n]`` array is ``y0 ^ y1`` where
  ``(y0, y1) = threefry2x32(key, (0, k))``. Row ``i`` takes ``hi = words[0, i]``
  and ``lo = words[1, i]``. No ``split`` or ``fold_in``: one threefry pass.
* **Uniform integer in ``[lo_bound, lo_bound + r)``** (``1 <= r < 2**31``):
  ``lo_bound + floor((hi * 2**32 + lo) * r / 2**64)``, a 64-bit fixed-point
  multiply (in C++: ``(uint64(hi) * r + ((uint64(lo) * r) >> 32)) >> 32``).
  Its bias is below ``r / 2**64`` (under 2**-33 for any table), i.e. exact
  for every practical purpose, where a float ``uniform * r`` is not once
  ``r`` exceeds 2**24 (a float32 has 24 significant bits).

The draw without replacement (``without_replacement``) is a partial
Fisher-Yates shuffle of the virtual array ``A = [0, n)``: for ``i < B``,
``j_i ~ U[i, n)``, ``x_i = A[j_i]``, then ``A[i], A[j_i]`` swap. The array is
never built. Step ``i`` reads positions ``i`` and ``j_i >= i``, never a
position ``l < i`` again, so only the writes ``A[j_l] = w_l`` matter, where
``w_l`` is the value at position ``l`` before step ``l``:

* ``w_i = i`` unless some ``l < i`` had ``j_l = i``; then ``w_i = w_p`` for
  the last such ``l = p``. Following ``p`` from ``i`` ends at a root ``r``
  (no earlier write), and ``w_i = r``: pointer jumping, ``ceil(log2 B)``
  gathers of ``B`` elements.
* ``x_i = j_i`` unless some ``l < i`` had ``j_l = j_i``; then ``x_i = w_l``
  for the last such ``l``: one stable sort of the ``B`` pairs ``(j_l, l)``.

Two executors of those two rules, equal value for value (``resolve``): on XLA:CPU a
scatter and a sort (``resolve_sorted``), on accelerators, up to ``_PAIRS_MAX_B`` rows,
``B x B`` comparisons (``resolve_pairs``), one reduction kernel there.

So ``x`` is exactly the first ``B`` entries of a uniformly random
permutation of ``[0, n)`` (every ordered ``B``-tuple of distinct values
equally likely), in O(B log B) with no loop and no condition. Rows
``i >= n`` are invalid (``j_i = i`` there, which no valid row can equal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core.inplace import materialize_on_cpu

_U16 = jnp.uint32(0xFFFF)


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # threefry's key-schedule constant


def _rotl(x, r: int):
  return (x << jnp.uint32(r)) | (x >> jnp.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32 (20 rounds), unrolled: bit for bit ``jax``'s ``threefry2x32``.

  jax lowers its own to a rolled ``while`` loop on CPU; this one has no loop
  (a few dozen elementwise operations that XLA fuses into one kernel).
  All arguments uint32 (broadcast); returns ``(y0, y1)``.
  """
  ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_PARITY))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
  return x0, x1


# Shapes of raw key data (uint32) for JAX's key implementations: threefry2x32 (the
# default) and rbg / unsafe_rbg.
_RAW_KEY_SHAPES = ((2,), (4,))


def check_key(rng, what: str) -> None:
  """Refuse anything but one PRNG key: a typed key array of shape ``()``
  (``jax.random.key``) or raw key data, ``uint32[2]`` (``jax.random.PRNGKey``; ``[4]``
  for the rbg implementations). The draws read the key's first two words, so a float
  array, int words or a batch of keys would otherwise become some other key silently.
  Static (dtype and shape only): works on traced keys."""
  x = rng if hasattr(rng, "dtype") and hasattr(rng, "shape") else np.asarray(rng)
  if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
    ok = x.shape == ()
  else:
    ok = x.dtype == jnp.uint32 and tuple(x.shape) in _RAW_KEY_SHAPES
  if not ok:
    raise TypeError(f"{what}: rng must be one PRNG key, jax.random.key(seed) or "
                    f"jax.random.PRNGKey(seed) (uint32[2]), got {x.dtype}{list(x.shape)}. "
                    "For several draws, split a key (jax.random.split) and pass one at a time.")


def words(key, n: int):
  """``(hi, lo)``: two uint32[n] words of random bits from ``key`` (the recipe above):
  equal to ``jax.random.bits(key, (2, n), uint32)`` rows 0 and 1, without its loop."""
  key = jnp.asarray(key)
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  k0, k1 = key[0].astype(jnp.uint32), key[1].astype(jnp.uint32)
  count = jnp.arange(2 * n, dtype=jnp.uint32)  # flat index; its high word is 0
  y0, y1 = threefry2x32(k0, k1, jnp.zeros_like(count), count)
  # Materialized on CPU: a consumer such as ``below`` reads each word several times, and
  # XLA:CPU fused the ~100 operations of threefry into it once per read (BUILD.md finding
  # 24: the random words of a 256-row draw 14 -> 2 us in a scan).
  w = materialize_on_cpu(y0 ^ y1).reshape(2, n)
  return w[0], w[1]


# 24 in a float32's exponent field: subtracting it divides a normal float by 2**24.
_EXP24 = 24 << 23


def uniform24(word):
  """float32 in [0, 1): the top 24 bits of a uint32 ``word`` times 2**-24 (exact; the
  native kernels' ``Uniform24``)."""
  return (word >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def uniform24_times(word, total, tiny: bool = True):
  """``uniform24(word) * total`` with one rounding, for a scalar ``total`` (a draw's target).

  XLA rewrites ``(x * 2**-24) * total`` (a broadcast scalar) as ``x * (total * 2**-24)``,
  and for a total below 2**-102 that scalar is subnormal, flushed to 0 on XLA:CPU: every
  target was 0, every draw the first leaf (a Prioritized(2.0) table of priorities ~1e-19;
  found by a review). So ``uniform24`` is scaled by the exponent's bits here, which XLA
  cannot rewrite. ``tiny=False`` (static): the caller's positive totals are never below
  2**-102 (``indexes.tiny_weights``), the rewrite is exact, and the plain product costs
  an H200 kernel less a prioritized step (two more integer operations split the random
  words' fusion from their materialization). A product with a per-element factor (the
  redraw's node sums) is not rewritten."""
  if not tiny:
    return uniform24(word) * total
  x = (word >> 8).astype(jnp.float32)  # exact: at most 24 bits
  # x >= 1 keeps a positive (normal) exponent; x = 0 goes negative, clamped to +0.0.
  u = lax.bitcast_convert_type(
      jnp.maximum(lax.bitcast_convert_type(x, jnp.int32) - _EXP24, 0), jnp.float32)
  return u * total


def mulhi32(a, b):
  """High 32 bits of the 64-bit product of uint32 arrays ``a`` and ``b`` (16-bit limbs)."""
  a0, a1 = a & _U16, a >> 16
  b0, b1 = b & _U16, b >> 16
  t = a0 * b0
  m1 = a1 * b0 + (t >> 16)          # < 2**32: (2**16 - 1)**2 + 2**16 - 1
  m2 = a0 * b1 + (m1 & _U16)        # < 2**32 likewise
  return a1 * b1 + (m1 >> 16) + (m2 >> 16)


def below(hi, lo, r):
  """uint32: ``floor((hi * 2**32 + lo) * r / 2**64)``, uniform in ``[0, r)`` up to
  a bias below ``r / 2**64``. ``hi``, ``lo``, ``r``: uint32 arrays (broadcast)."""
  r = jnp.asarray(r, jnp.uint32)
  a1, a0 = mulhi32(hi, r), hi * r   # hi * r = a1 * 2**32 + a0
  s = a0 + mulhi32(lo, r)           # + the high word of lo * r, with carry
  return a1 + (s < a0).astype(jnp.uint32)


def without_replacement(key, n, b: int, n_max: int = 1 << 31):
  """The first ``b`` values of a uniformly random permutation of ``[0, n)``.

  Args:
    key: a PRNG key (the ``words`` recipe).
    n: int32[] size of the virtual array (traced; may be below ``b``).
    b: static batch size.
    n_max: static upper bound of ``n`` (the capacity; lets ``resolve`` sort faster).

  Returns:
    ``(x int32[b], valid bool[b])``: ``x[i]`` for ``i < min(b, n)`` distinct
    values in ``[0, n)``; rows ``i >= n`` invalid (``x[i] = i``, do not use).
  """
  hi, lo = words(key, b)
  i = jnp.arange(b, dtype=jnp.int32)
  n = jnp.asarray(n, jnp.int32)
  valid = i < n
  r = jnp.maximum(n - i, 1).astype(jnp.uint32)
  j = jnp.where(valid, i + below(hi, lo, r).astype(jnp.int32), i)
  return resolve(j, n_max), valid


def sort_pairs(j, n_max: int):
  """``(j, l)`` pairs (``l`` the row, int32[B]) sorted by ``j`` then ``l``.

  When ``n_max * B <= 2**32`` (static; e.g. C = 2**18, B = 256) the pair is
  packed into one uint32 ``j * 2**k + l``: XLA:CPU sorts a single primitive
  array natively (about 8 us for 256 keys here) but calls a compiled
  comparator per comparison for a multi-operand sort (about 50 us).
  """
  b = j.shape[0]
  k = max(1, (b - 1).bit_length())
  i = jnp.arange(b, dtype=jnp.int32)
  if max(n_max, b) << k <= 1 << 32:
    key = jax.lax.sort((j.astype(jnp.uint32) << k) | i.astype(jnp.uint32))
    return (key >> k).astype(jnp.int32), (key & ((1 << k) - 1)).astype(jnp.int32)
  return jax.lax.sort((j, i), num_keys=1, is_stable=True)


# Batches up to this size resolve by all-pairs comparisons on accelerators. There the two
# [B, B] comparisons of ``resolve_pairs`` are one reduction kernel (64K elements at
# B = 256), where ``resolve_sorted`` is 7 kernels more, of ~1 us each on a GPU: two
# scatters into fresh buffers with their broadcasts and copies, the sort of packed pairs
# (experiments/accel_hlo.py counts them; BUILD.md finding 27). On XLA:CPU the comparisons
# cost more than the sort (in-scan uniform step 105 -> 155 us at B = 256), so the CPU
# keeps it. The work grows as B**2: 1024 rows are 1M comparisons, microseconds on a GPU.
_PAIRS_MAX_B = 1024


def resolve(j, n_max: int = 1 << 31):
  """``x`` from the swap targets ``j`` (int32[B], ``j[i] >= i``, all ``< max(n_max, B)``):
  see the module doc. ``n_max``: static bound of ``n`` (the capacity).

  The same values on every backend: ``resolve_sorted`` on CPU, ``resolve_pairs`` on
  others for ``B <= _PAIRS_MAX_B`` (chosen when the program is lowered, not at run time:
  no condition in the program)."""
  if j.shape[0] > _PAIRS_MAX_B:
    return resolve_sorted(j, n_max)
  return lax.platform_dependent(j, cpu=lambda v: resolve_sorted(v, n_max),
                                default=resolve_pairs)


def _roots(p):
  """w (int32[B]): the root reached from each ``i`` by following ``p`` (``p[q]`` the last
  step that wrote position ``q``, -1 for none): pointer jumping, ``ceil(log2 B)`` gathers."""
  b = p.shape[0]
  i = jnp.arange(b, dtype=jnp.int32)
  root = jnp.where(p < 0, i, p)
  for _ in range(max(0, (b - 1).bit_length())):  # chains are shorter than b
    # Materialized each jump on CPU: fused, the last jump would evaluate the first 2**k
    # times per element (a jump reads its operand twice). BUILD.md finding 24.
    root = materialize_on_cpu(root[root])
  return root


def resolve_pairs(j):
  """``resolve`` by comparing all pairs of rows: O(B**2) elementwise work, no scatter and
  no sort. ``p[q]`` (the last ``l != q`` with ``j_l = q``) and ``prev[i]`` (the last
  ``l < i`` with ``j_l = j_i``) are maxima over ``[B, B]`` masks."""
  b = j.shape[0]
  i = jnp.arange(b, dtype=jnp.int32)
  row, col = i[:, None], i[None, :]
  p = jnp.max(jnp.where((j[None, :] == row) & (col != row), col, -1), axis=1)
  prev = jnp.max(jnp.where((j[None, :] == j[:, None]) & (col < row), col, -1), axis=1)
  return jnp.where(prev >= 0, _roots(p)[jnp.maximum(prev, 0)], j)


def resolve_sorted(j, n_max: int = 1 << 31):
  """``resolve`` by one scatter (``p``) and one sort of the ``(j_l, l)`` pairs (``prev``):
  O(B log B). ``n_max`` as ``resolve``."""
  b = j.shape[0]
  i = jnp.arange(b, dtype=jnp.int32)
  # p[q]: the last step l < q that wrote position q (j_l = q); a root points at itself.
  # Every l with j_l = q has l <= q, so excluding l = q leaves l < q, and max is the last.
  tgt = jnp.where((j < b) & (j != i), j, b)
  p = jnp.full((b,), -1, jnp.int32).at[tgt].max(i, mode="drop")
  w = _roots(p)  # w_i: the value at position i before step i
  # The last l < i with j_l = j_i: its predecessor in the sort by (j, l).
  sj, si = sort_pairs(j, n_max)
  same = jnp.concatenate([jnp.zeros((1,), bool), sj[1:] == sj[:-1]])
  prev_sorted = jnp.where(same, jnp.concatenate([jnp.full((1,), -1, jnp.int32), si[:-1]]), -1)
  prev = jnp.zeros((b,), jnp.int32).at[si].set(prev_sorted, unique_indices=True)
  return jnp.where(prev >= 0, w[jnp.maximum(prev, 0)], j)
