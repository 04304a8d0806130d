"""An index of item versions, so counting the items fresh enough to sample is O(V), not O(C).

With ``max_staleness`` set, an item is eligible at policy version ``ver``
when ``item_version >= ver - max_staleness``. ``sample`` reports how many
items were eligible (``num_eligible``, and ``1 / num_eligible`` as the
uniform selection probability), ``count`` and ``can_sample`` return it, and
a pass over the ``version`` column for it costs O(C): about 200 us per call
at a million slots on a 2-core CPU, more than the whole draw.

The index keeps, for a window of the ``V`` newest versions, a histogram of
the items' versions, plus a count of the older items:

* ``version_hist: int32[V]`` -- bucket ``v mod V`` counts the items with
  version ``v`` in the window ``(hi - V, hi]``;
* ``version_bounds: int32[3]`` -- ``[hi, n_old, old_min]``: ``hi`` the
  largest version ever inserted, ``n_old`` the items with a version
  ``<= hi - V``, and ``old_min`` a lower bound of those items' versions
  (exact when they arrive; not raised when they leave).

A count at threshold ``thr = ver - max_staleness`` is then exact in two
cases, which cover the steady state of a table: every item is fresh enough
(``thr <=`` the smallest possible version: the count is the size, O(1)), or
the threshold lies inside the window (all older items are stale: sum the
buckets from ``thr`` to ``hi``, O(V)). Otherwise (a threshold below the
window with old items about) the count falls back to the O(C) pass, under
a ``lax.cond`` so the pass runs only then (under ``vmap`` a cond becomes a
select and the pass always runs).

``V`` is the power of two ``>= 2 * (max_staleness + 1)`` (so a learner a
few versions ahead of its newest items still counts in the window), at
least 8; above ``MAX_WINDOW`` only the "every item is fresh" answer is
kept fast, and ``V`` is 8. The index costs one O(V) pass per
insert call (moving buckets that leave the window to ``n_old``) and O(B)
per inserted or removed batch. Tables without ``max_staleness`` keep empty
arrays and pay nothing.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import numerics
from funcreplay.core.spec import TableSpec

MAX_WINDOW = 4096
_NONE = jnp.iinfo(jnp.int32).max  # old_min when no old item is left


def window(spec: TableSpec) -> int:
  """``V``, the number of versions the histogram covers (0: no staleness limit)."""
  if spec.max_staleness is None:
    return 0
  need = 2 * (spec.max_staleness + 1)
  if need > MAX_WINDOW:
    # The threshold never falls inside a window this short, so only the
    # "every item is fresh" answer is fast; the smallest window keeps the
    # per-insert pass cheap.
    return 8
  return int(max(8, 1 << max(0, need - 1).bit_length()))


def empty(spec: TableSpec):
  """``(version_hist, version_bounds)`` of an empty table."""
  v = window(spec)
  if not v:
    return jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32)
  return jnp.zeros((v,), jnp.int32), jnp.asarray([0, 0, _NONE], jnp.int32)


def as_version(version, what: str = "version", scalar: bool = False) -> jnp.ndarray:
  """int32 array of a policy version (a scalar, or ``[B]`` for an insert): integers only.
  A float would be truncated to another version and a host integer beyond int32 wrapped
  (refused, naming ``what``); a traced one is checked by its dtype. ``scalar``: any other
  shape is refused (a sample's version: ``[1]`` failed later, in a stack)."""
  if version is None:
    raise TypeError(f"{what} must be an integer (a policy version), got None.")
  x = version if hasattr(version, "dtype") else np.asarray(version)
  if scalar and x.ndim:
    raise ValueError(f"{what} must be a scalar (the sampler's policy version), got shape "
                     f"{list(x.shape)}.")
  if x.dtype.kind not in "iu":
    raise TypeError(f"{what} must be an integer (a policy version), got {x.dtype}.")
  bad = numerics.beyond(version, np.int32)
  if bad:
    raise ValueError(f"{what} must fit int32, got "
                     f"{bad[0] if bad[0] < np.iinfo(np.int32).min else bad[1]}.")
  return jnp.asarray(version, jnp.int32)


def threshold(spec: TableSpec, version) -> jnp.ndarray:
  """int32[]: the oldest version still fresh at ``version``: ``version - max_staleness``,
  saturated at the int32 minimum (every item is fresh) instead of wrapping.

  An item is eligible when ``item_version >= threshold``. Comparing versions
  to this threshold, never ``version - item_version`` to ``max_staleness``,
  keeps the test exact for any two int32 versions (that difference can wrap).
  """
  lowest = jnp.iinfo(jnp.int32).min + spec.max_staleness  # fits: 0 <= max_staleness < 2**31
  return jnp.maximum(as_version(version), jnp.int32(lowest)) - spec.max_staleness


def behind(version, item_version) -> jnp.ndarray:
  """uint32: how many versions ``item_version`` (int32) is behind ``version`` (int32[]),
  0 for an item at or ahead of it; the ``sampled_staleness_sum`` counter's terms. Exact
  for any two int32 versions: ``max(version - item_version, 0)`` in int32 wrapped when
  they are 2**31 or more apart (an item far ahead counted as stale, one far behind as
  fresh; found by a review). The kernels' ``Behind`` (csrc/common.h) computes the same."""
  item_version = jnp.asarray(item_version, jnp.int32)
  version = jnp.asarray(version, jnp.int32)
  u32 = lambda x: lax.bitcast_convert_type(x, jnp.uint32)  # noqa: E731
  return jnp.where(version > item_version, u32(version) - u32(item_version), jnp.uint32(0))


def _bucket_versions(hi, v):
  """int32[V]: the version bucket ``b`` stands for, in the window ``(hi - V, hi]``."""
  b = jnp.arange(v, dtype=jnp.int32)
  return hi - ((hi - b) & (v - 1))


def _old(n_old, old_min, versions, is_old):
  n_old = n_old + jnp.sum(is_old, dtype=jnp.int32)
  return n_old, jnp.minimum(old_min, jnp.min(jnp.where(is_old, versions, _NONE)))


def advance(spec: TableSpec, hist, bounds, versions, mask):
  """Move the window up to the newest of ``versions[mask]`` (int32[B]), before they
  are added: buckets that fall out of it go to the old items. O(V), once per insert."""
  v = window(spec)
  if not v:
    return hist, bounds
  hi, n_old, old_min = bounds[0], bounds[1], bounds[2]
  new_hi = jnp.maximum(hi, jnp.max(jnp.where(mask, versions, hi)))
  vb = _bucket_versions(hi, v)
  leaving = (vb <= new_hi - v) & (hist > 0)
  n_old = n_old + jnp.sum(jnp.where(leaving, hist, 0))
  old_min = jnp.minimum(old_min, jnp.min(jnp.where(leaving, vb, _NONE)))
  return jnp.where(leaving, 0, hist), jnp.stack([new_hi, n_old, old_min])


def add(spec: TableSpec, hist, bounds, versions, mask):
  """Index ``versions[mask]`` (int32[K], all ``<= hi``: ``advance`` first). O(K)."""
  return _shift(spec, hist, bounds, versions, mask, 1)


def on_remove(spec: TableSpec, hist, bounds, versions, mask):
  """Un-index ``versions[mask]`` (int32[K]) of items being removed. O(K)."""
  return _shift(spec, hist, bounds, versions, mask, -1)


def _shift(spec, hist, bounds, versions, mask, delta: int):
  """Count ``versions[mask]`` in (``delta`` = 1) or out (-1) of the index."""
  v = window(spec)
  if not v:
    return hist, bounds
  hi, n_old, old_min = bounds[0], bounds[1], bounds[2]
  in_window = mask & (versions > hi - v)
  hist = hist.at[jnp.where(in_window, versions & (v - 1), v)].add(delta, mode="drop")
  old = mask & ~in_window
  n_old = n_old + delta * jnp.sum(old, dtype=jnp.int32)
  if delta > 0:
    old_min = jnp.minimum(old_min, jnp.min(jnp.where(old, versions, _NONE)))
  else:  # a lower bound: not raised when old items leave, reset when none is left
    old_min = jnp.where(n_old > 0, old_min, _NONE)
  return hist, jnp.stack([hi, n_old, old_min])


def rebuild(spec: TableSpec, hist, bounds, occupied, version):
  """The index recomputed from the columns (``occupied`` bool[C], ``version`` int32[C]). O(C).

  ``hi`` is kept (or raised to the newest item), and ``old_min`` stays the
  stored bound when that is lower, so a consistent index rebuilds to itself.
  """
  v = window(spec)
  if not v:
    return hist, bounds
  hi = jnp.maximum(bounds[0], jnp.max(jnp.where(occupied, version, bounds[0])))
  in_window = occupied & (version > hi - v)
  hist = jnp.zeros((v,), jnp.int32).at[jnp.where(in_window, version & (v - 1), v)].add(
      1, mode="drop")
  n_old, old_min = _old(jnp.int32(0), bounds[2], version, occupied & ~in_window)
  return hist, jnp.stack([hi, n_old, jnp.where(n_old > 0, old_min, _NONE)])


def count_fresh(spec: TableSpec, hist, bounds, size, threshold, full_count):
  """Items with ``version >= threshold``: O(1) or O(V) from the index, else
  ``full_count()`` (the O(C) pass), chosen at run time."""
  v = window(spec)
  hi, n_old, old_min = bounds[0], bounds[1], bounds[2]
  lowest = hi - v + 1  # smallest version a window item can have
  lowest = jnp.where(n_old > 0, jnp.minimum(old_min, lowest), lowest)
  everyone = threshold <= lowest
  in_window = threshold > hi - v  # all old items are stale
  from_hist = jnp.sum(jnp.where(_bucket_versions(hi, v) >= threshold, hist, 0))
  fast = jnp.where(everyone, size, from_hist)
  return lax.cond(everyone | in_window, lambda: fast, full_count)
