"""PER importance weights of a ``Sample``."""

from __future__ import annotations

import jax.numpy as jnp

from funcreplay.core import numerics
from funcreplay.core.state import Sample


def importance_weights(sample: Sample, beta: float):
  """PER importance weights ``(N * P(i))**-beta / max`` over valid rows (0 elsewhere)."""
  n = jnp.maximum(sample.num_eligible, 1).astype(jnp.float32)
  p = jnp.where(sample.valid, sample.info.probability, 1.0)
  w = jnp.power(n * jnp.maximum(p, numerics.TINY), -beta)
  w = jnp.where(sample.valid, w, 0.0)
  return w / jnp.maximum(jnp.max(w), numerics.TINY)
