"""What the core contract tests (tests/core/test_core_*.py) share."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tests.helpers import items_from_ids, jitted

# A two-leaf item (float32[3] and an int32: packed rows), for the ring and index tests.
SMALL_ITEM = {"x": np.zeros((3,), np.float32), "a": np.int32(0)}


def small_items(b, start=0):
  """``b`` items of ``SMALL_ITEM`` with ids ``start, start + 1, ...``: ``x = [id, id + 0.5,
  -id]``, ``a = id`` (strictly increasing payloads)."""
  v = np.arange(start, start + b)
  return {"x": jnp.asarray(np.stack([v, v + 0.5, -v], 1).astype(np.float32)),
          "a": jnp.asarray(v.astype(np.int32))}


def fill(spec, n, version=0):
  """A fresh table of ``spec`` holding items ``0 .. n-1`` inserted at ``version``."""
  f = jitted(spec)
  state = f["table"].init()
  return f["insert"](state, items_from_ids(np.arange(n)), version=version)
