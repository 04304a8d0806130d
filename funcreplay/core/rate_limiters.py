"""Rate limiters (Reverb semantics) as pure predicates on table counters.

A rate limiter is described by ``samples_per_insert`` (spi), a minimum table
size before sampling is allowed and a window ``[min_diff, max_diff]`` for

    diff = spi * inserts - samples.

As in Reverb:

* an insert of ``n`` items may proceed if the table (after the insert) holds
  at most ``min_size_to_sample`` items, or ``spi * (inserts + n) - samples
  <= max_diff``;
* a sample of ``n`` items may proceed if the table holds at least
  ``min_size_to_sample`` items and ``spi * inserts - (samples + n) >= min_diff``.

``spi`` is kept as an exact fraction ``p / q``: a ``fractions.Fraction``
as given, an int, or a float read as the shortest decimal that prints as it
(``0.3333`` is ``3333 / 10000``, not the nearest binary fraction and never
rounded to a nearby simple ratio). The window bounds are read the same way.
The table state tracks the integer ``p * inserts - q * samples``
(``TableState.limiter_diff``, int32, saturating at +-2**30) and the
predicates compare it with the window scaled by ``q`` in integer arithmetic,
so they never lose precision however many operations a run performs. A
ratio or window whose scaled form does not fit (``p``, ``q`` and the scaled
bounds at most 2**29 in magnitude, ``MAX_TERM``) is refused with a clear
error: pass a ``Fraction`` with a smaller denominator. Saturation does not
matter to limiters without a window (``MinSize``), whose predicate never reads
the diff. A window keeps the diff within a batch of its bounds, except for the
inserts it does not check: those made while the table holds fewer than
``min_size_to_sample`` items (as in Reverb), e.g. while items are deleted as
they come. Each adds ``p``, so about ``2**30 / p`` of them (~1e9 at ``spi =
1``, 2 at ``p = 2**29``) saturate the diff, which then returns into the window
after fewer samples than Reverb's exact one: inserts unblock early.

A window with ``min_diff > spi * min_size_to_sample`` is refused (as in
Reverb: sampling could never start), and ``SampleToInsertRatio`` requires,
as Reverb's code does, a window at least ``2 * max(1, spi)`` wide.
"""

from __future__ import annotations

import dataclasses
import fractions
import functools
import math
from typing import Tuple, Union

import jax.numpy as jnp

DIFF_LIMIT = 2**30
# Largest |p|, |q| and |scaled window bound|: with the diff clipped to
# +-DIFF_LIMIT, (bound - diff) stays inside int32 (2**29 + 2**30 < 2**31).
MAX_TERM = 2**29

Number = Union[int, float, fractions.Fraction]


def exact(x: Number) -> fractions.Fraction:
  """``x`` as an exact fraction; a float as the shortest decimal that prints as it."""
  if isinstance(x, fractions.Fraction):
    return x
  if isinstance(x, bool):
    raise TypeError(f"expected a number, got {x!r}")
  if isinstance(x, int):
    return fractions.Fraction(x)
  return fractions.Fraction(repr(float(x)))


def _finite(x) -> bool:
  return isinstance(x, fractions.Fraction) or math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class RateLimiter:
  """General rate limiter; prefer the named constructors below.

  ``samples_per_insert``, ``min_diff`` and ``max_diff`` may be ints, floats
  (read as their shortest decimal) or ``fractions.Fraction``; the bounds may
  be infinite.
  """

  samples_per_insert: Number
  min_size_to_sample: int
  min_diff: Number
  max_diff: Number

  def __post_init__(self):
    spi, m = self.samples_per_insert, self.min_size_to_sample
    if (not isinstance(spi, (int, float, fractions.Fraction)) or isinstance(spi, bool)
        or not _finite(spi) or spi <= 0):
      raise ValueError(f"samples_per_insert must be a finite number > 0, got {spi!r}")
    if not isinstance(m, int) or m < 0:
      raise ValueError(f"min_size_to_sample must be an int >= 0, got {m!r}")
    if not self.min_diff <= self.max_diff:
      raise ValueError(
          f"min_diff ({self.min_diff}) must be <= max_diff ({self.max_diff}): "
          "the window would block inserts and samples forever.")
    if _finite(self.min_diff) and exact(self.min_diff) > exact(spi) * m:
      raise ValueError(
          f"min_diff ({self.min_diff}) exceeds samples_per_insert * min_size_to_sample "
          f"({spi} * {m}): sampling could never start (Reverb refuses this window too).")
    p, q = self.ratio
    for name, value in (("p", p), ("q", q)):
      if value > MAX_TERM:
        raise ValueError(
            f"samples_per_insert={spi!r} is exactly {p}/{q}, whose {name} exceeds 2**29 "
            "(the int32 ledger cannot hold it); pass a fractions.Fraction with a smaller "
            "denominator, e.g. Fraction(1, 3).")
    for name, bound in (("min_diff", self.q_min), ("max_diff", self.q_max)):
      if bound is not None and abs(bound) > MAX_TERM:
        raise ValueError(
            f"{name} * q = {bound} (samples_per_insert = {p}/{q}) exceeds 2**29 in magnitude: "
            "the int32 ledger cannot hold this window; use a smaller window or a "
            "fractions.Fraction ratio with a smaller denominator.")

  @functools.cached_property
  def ratio(self) -> Tuple[int, int]:
    """``samples_per_insert`` as an exact fraction ``(p, q)`` (see the module doc)."""
    f = exact(self.samples_per_insert)
    return f.numerator, f.denominator

  @functools.cached_property
  def q_min(self):
    """``ceil(min_diff * q)`` (int), or None when ``min_diff`` is -inf."""
    if not _finite(self.min_diff):
      return None
    return math.ceil(exact(self.min_diff) * self.ratio[1])

  @functools.cached_property
  def q_max(self):
    """``floor(max_diff * q)`` (int), or None when ``max_diff`` is +inf."""
    if not _finite(self.max_diff):
      return None
    return math.floor(exact(self.max_diff) * self.ratio[1])

  # -- pure predicates ------------------------------------------------------
  def can_insert(self, size, limiter_diff, n=1):
    """May ``n`` more items be inserted? ``size``: current table size."""
    if self.q_max is None:
      return jnp.asarray(True)
    p, _ = self.ratio
    small = size + n <= self.min_size_to_sample
    # p * inserts - q * samples + p * n <= q_max, in int32 without overflow.
    room = jnp.int32(self.q_max) - jnp.asarray(limiter_diff, jnp.int32)
    return small | ((room >= 0) & (jnp.asarray(n, jnp.int32) <= room // p))

  def can_sample(self, size, limiter_diff, n=1):
    """May ``n`` more items be sampled? ``size``: current table size."""
    big_enough = size >= self.min_size_to_sample
    if self.q_min is None:
      return big_enough
    _, q = self.ratio
    # p * inserts - q * (samples + n) >= q_min, in int32 without overflow.
    room = jnp.asarray(limiter_diff, jnp.int32) - jnp.int32(self.q_min)
    return big_enough & (room >= 0) & (jnp.asarray(n, jnp.int32) <= room // q)


def _saturating_step(diff, k: int, n, up: bool):
  """``clip(diff +- k * n, -DIFF_LIMIT, DIFF_LIMIT)`` for ``diff`` already inside the
  clip, ``k`` in [1, MAX_TERM] and ``n >= 0``, exactly (no int32 overflow)."""
  n = jnp.asarray(n, jnp.int32).astype(jnp.uint32)
  step = jnp.minimum(n, jnp.uint32((2**32 - 1) // k)) * jnp.uint32(k)   # < 2**32
  d = diff.astype(jnp.uint32)
  if up:
    head = jnp.uint32(DIFF_LIMIT) - d        # DIFF_LIMIT - diff, in [0, 2**31]
    return jnp.where(step >= head, jnp.int32(DIFF_LIMIT), diff + step.astype(jnp.int32))
  head = d + jnp.uint32(DIFF_LIMIT)          # diff + DIFF_LIMIT, in [0, 2**31]
  return jnp.where(step >= head, jnp.int32(-DIFF_LIMIT), diff - step.astype(jnp.int32))


def update_diff(limiter: RateLimiter, diff, inserted=0, sampled=0):
  """New ``limiter_diff`` after ``inserted`` inserts, then ``sampled`` samples
  (each step saturating at +-DIFF_LIMIT)."""
  p, q = limiter.ratio
  d = jnp.asarray(diff, jnp.int32)
  d = _saturating_step(d, p, inserted, up=True)
  return _saturating_step(d, q, sampled, up=False).astype(jnp.int32)


def MinSize(min_size_to_sample: int = 1) -> RateLimiter:  # noqa: N802 (Reverb name)
  """Block sampling until the table holds ``min_size_to_sample`` items."""
  return RateLimiter(1.0, min_size_to_sample, -math.inf, math.inf)


def SampleToInsertRatio(samples_per_insert: Number, min_size_to_sample: int,  # noqa: N802
                        error_buffer: Union[Number, Tuple[Number, Number]]) -> RateLimiter:
  """Keep ``samples / inserts`` near ``samples_per_insert`` (Reverb semantics).

  ``error_buffer`` is either a number ``e`` (window ``spi * min_size +- e``)
  or an explicit ``(min_diff, max_diff)`` pair; the window must be at least
  ``2 * max(1, spi)`` wide (Reverb's rule). ``samples_per_insert`` is kept
  exactly (a float as its shortest decimal; pass a ``fractions.Fraction`` for
  ratios such as 1/3).
  """
  if isinstance(error_buffer, (int, float, fractions.Fraction)):
    if error_buffer < 0:
      raise ValueError(f"error_buffer must be >= 0, got {error_buffer}")
    offset = exact(samples_per_insert) * int(min_size_to_sample)
    lo, hi = offset - exact(error_buffer), offset + exact(error_buffer)
  else:
    lo, hi = error_buffer
  # Reverb's rule: the window must admit a sample and an insert from anywhere in it.
  width = 2 * max(1, exact(samples_per_insert))
  if _finite(lo) and _finite(hi) and exact(hi) - exact(lo) < width:
    raise ValueError(
        f"SampleToInsertRatio: the error buffer window [{lo}, {hi}] is narrower than "
        f"2 * max(1, samples_per_insert={samples_per_insert}) = {width}; inserts and samples "
        "could deadlock (Reverb's rule). Use a larger error_buffer.")
  return RateLimiter(samples_per_insert, int(min_size_to_sample), lo, hi)


def Queue(size: int) -> RateLimiter:  # noqa: N802
  """Limiter of a queue of ``size`` items: inserts block when full, samples when empty."""
  if not isinstance(size, int) or size < 1:
    raise ValueError(f"Queue size must be an int >= 1, got {size!r}")
  return RateLimiter(1.0, 1, 0.0, float(size))


def Stack(size: int) -> RateLimiter:  # noqa: N802
  """Limiter of a stack of ``size`` items (same rule as ``Queue``)."""
  return Queue(size)
