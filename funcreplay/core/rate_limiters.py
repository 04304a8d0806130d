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

``spi`` is kept as an exact fraction ``p / q`` and the table state tracks the
integer ``p * inserts - q * samples`` (``TableState.limiter_diff``, int32,
saturating at +-2**30), so the predicate never loses precision however many
operations a run performs. Saturation only matters for limiters without a
window (``MinSize``), whose predicate never reads the diff.
"""

from __future__ import annotations

import dataclasses
import fractions
import math
from typing import Tuple, Union

import jax.numpy as jnp

DIFF_LIMIT = 2**30

# Largest denominator ``q`` of the exact fraction ``p / q`` kept for
# ``samples_per_insert`` (``RateLimiter.ratio``): the state tracks the
# integer ``p * inserts - q * samples`` in int32, so ``p`` and ``q`` must stay
# small next to ``DIFF_LIMIT``; a float spi such as 0.333 becomes the nearest
# fraction with q <= 1000.
MAX_RATIO_DENOMINATOR = 1000


@dataclasses.dataclass(frozen=True)
class RateLimiter:
  """General rate limiter; prefer the named constructors below."""

  samples_per_insert: float
  min_size_to_sample: int
  min_diff: float
  max_diff: float

  def __post_init__(self):
    spi, m = self.samples_per_insert, self.min_size_to_sample
    if not isinstance(spi, (int, float)) or not math.isfinite(spi) or spi <= 0:
      raise ValueError(f"samples_per_insert must be a finite number > 0, got {spi!r}")
    if not isinstance(m, int) or m < 0:
      raise ValueError(f"min_size_to_sample must be an int >= 0, got {m!r}")
    if not self.min_diff <= self.max_diff:
      raise ValueError(
          f"min_diff ({self.min_diff}) must be <= max_diff ({self.max_diff}): "
          "the window would block inserts and samples forever.")

  @property
  def ratio(self) -> Tuple[int, int]:
    """``samples_per_insert`` as an exact fraction ``(p, q)``."""
    f = fractions.Fraction(self.samples_per_insert).limit_denominator(MAX_RATIO_DENOMINATOR)
    return f.numerator, f.denominator

  # -- pure predicates ------------------------------------------------------
  def can_insert(self, size, limiter_diff, n=1):
    """May ``n`` more items be inserted? ``size``: current table size."""
    p, _ = self.ratio
    if math.isinf(self.max_diff):
      return jnp.asarray(True)
    q_max = self._scaled(self.max_diff)
    small = size + n <= self.min_size_to_sample
    diff_after = limiter_diff.astype(jnp.float32) + jnp.float32(p) * n
    return small | (diff_after <= q_max)

  def can_sample(self, size, limiter_diff, n=1):
    """May ``n`` more items be sampled? ``size``: current table size."""
    big_enough = size >= self.min_size_to_sample
    if math.isinf(self.min_diff) and self.min_diff < 0:
      return big_enough
    _, q = self.ratio
    q_min = self._scaled(self.min_diff)
    diff_after = limiter_diff.astype(jnp.float32) - jnp.float32(q) * n
    return big_enough & (diff_after >= q_min)

  def _scaled(self, bound: float) -> jnp.ndarray:
    _, q = self.ratio
    return jnp.float32(bound * q)


def update_diff(limiter: RateLimiter, diff, inserted=0, sampled=0):
  """New ``limiter_diff`` after ``inserted`` inserts and ``sampled`` samples."""
  p, q = limiter.ratio
  d = (diff + jnp.int32(p) * jnp.asarray(inserted, jnp.int32)
       - jnp.int32(q) * jnp.asarray(sampled, jnp.int32))
  return jnp.clip(d, -DIFF_LIMIT, DIFF_LIMIT).astype(jnp.int32)


def MinSize(min_size_to_sample: int = 1) -> RateLimiter:  # noqa: N802 (Reverb name)
  """Block sampling until the table holds ``min_size_to_sample`` items."""
  return RateLimiter(1.0, min_size_to_sample, -math.inf, math.inf)


def SampleToInsertRatio(samples_per_insert: float, min_size_to_sample: int,  # noqa: N802
                        error_buffer: Union[float, Tuple[float, float]]) -> RateLimiter:
  """Keep ``samples / inserts`` near ``samples_per_insert`` (Reverb semantics).

  ``error_buffer`` is either a number ``e`` (window ``spi * min_size +- e``)
  or an explicit ``(min_diff, max_diff)`` pair.
  """
  if isinstance(error_buffer, (int, float)):
    if error_buffer < 0:
      raise ValueError(f"error_buffer must be >= 0, got {error_buffer}")
    offset = samples_per_insert * min_size_to_sample
    lo, hi = offset - error_buffer, offset + error_buffer
  else:
    lo, hi = error_buffer
  # Reverb's rule of thumb: the window must admit at least one sample/insert.
  if hi - lo < max(1.0, samples_per_insert):
    raise ValueError(
        f"SampleToInsertRatio: the error buffer window [{lo}, {hi}] is narrower than "
        f"max(1, samples_per_insert={samples_per_insert}); inserts and samples would "
        "deadlock. Use a larger error_buffer.")
  return RateLimiter(float(samples_per_insert), int(min_size_to_sample), float(lo), float(hi))


def Queue(size: int) -> RateLimiter:  # noqa: N802
  """Limiter of a queue of ``size`` items: inserts block when full, samples when empty."""
  if not isinstance(size, int) or size < 1:
    raise ValueError(f"Queue size must be an int >= 1, got {size!r}")
  return RateLimiter(1.0, 1, 0.0, float(size))


def Stack(size: int) -> RateLimiter:  # noqa: N802
  """Limiter of a stack of ``size`` items (same rule as ``Queue``)."""
  return Queue(size)
