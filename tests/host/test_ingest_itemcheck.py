"""The ingestor's item checks (funcreplay.host.itemcheck): ``ItemChecker``'s fast path
agrees with JAX's flattening and converts Python scalars exactly; ``stack_leaf``."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay.host.itemcheck import ItemChecker, stack_leaf

Point = collections.namedtuple("Point", "a b")


def test_fast_check_agrees_with_jax_flattening():
  sig = fr.Signature({"p": Point(jnp.zeros(2), jnp.zeros((), jnp.int32)),
                      "q": (jnp.zeros((), bool), [jnp.zeros(3, jnp.uint8)]), "r": None})
  chk = ItemChecker(sig)
  good = {"p": Point(np.ones(2, np.float32), np.int32(3)),
          "q": (np.bool_(True), [np.arange(3, dtype=np.uint8)]), "r": None}
  leaves = chk.fast(good)
  assert leaves is not None
  for a, b in zip(leaves, jax.tree_util.tree_leaves(good), strict=True):
    assert a is b
  variants = [
      {**good, "p": (np.ones(2, np.float32), np.int32(3))},        # tuple, not Point
      {**good, "q": (np.bool_(True), (np.arange(3, dtype=np.uint8),))},
      {**good, "r": np.zeros(1)},
      {**good, "p": Point(np.ones(2, np.float64), np.int32(3))},
      {**good, "p": Point(np.ones(3, np.float32), np.int32(3))},
      {k: v for k, v in good.items() if k != "r"},
  ]
  for v in variants:
    assert chk.fast(v) is None
    with pytest.raises((ValueError, TypeError)):
      chk(v)
  # Python scalars take the slow path and come back as arrays of the leaf dtype.
  conv = chk({**good, "p": Point(np.ones(2, np.float32), 5)})
  assert conv[1].dtype == np.int32 and int(conv[1]) == 5


def test_python_scalars_take_the_fast_path_and_convert_exactly():
  sig = fr.Signature({"f": jnp.zeros((), jnp.float32), "i": jnp.zeros((), jnp.int32),
                      "b": jnp.zeros((), bool), "v": jnp.zeros(2, jnp.float32)})
  chk = ItemChecker(sig)
  v = np.zeros(2, np.float32)
  leaves = chk.fast({"f": 0.5, "i": 3, "b": True, "v": v})
  assert leaves is not None
  b, f, i, _ = leaves
  assert (type(b), type(f), type(i)) == (np.bool_, np.float32, np.int32)
  assert (bool(b), float(f), int(i)) == (True, 0.5, 3)
  assert chk.fast({"f": 1, "i": 3, "b": True, "v": v})[1] == np.float32(1.0)  # int -> float
  for bad in ({"i": 2**40}, {"i": 2.5}, {"b": 1}, {"f": "x"}, {"v": [0.0, 0.0]}):
    assert chk.fast({"f": 0.5, "i": 3, "b": True, "v": v, **bad}) is None
  with pytest.raises(ValueError, match="fit"):
    chk({"f": 0.5, "i": 2**40, "b": True, "v": v})


def test_stack_leaf_handles_views_jax_arrays_and_scalars():
  spec = jax.ShapeDtypeStruct((2,), jnp.float32)
  base = np.arange(12, dtype=np.float32).reshape(2, 6)
  views = [base[:, k] for k in range(6)]  # non-contiguous [2] views
  assert not views[0].flags.c_contiguous
  np.testing.assert_array_equal(stack_leaf(tuple(views), 6, spec), base.T)
  jx = tuple(jnp.asarray([k, -k], jnp.float32) for k in range(3))
  np.testing.assert_array_equal(stack_leaf(jx, 3, spec), [[0, 0], [1, -1], [2, -2]])
  contiguous = tuple(np.array([k, k + 0.5], np.float32) for k in range(4))
  out = stack_leaf(contiguous, 4, spec)
  assert out.dtype == np.float32 and out.shape == (4, 2)
  np.testing.assert_array_equal(out[:, 1], [0.5, 1.5, 2.5, 3.5])
  sc = jax.ShapeDtypeStruct((), jnp.int32)
  mixed = (np.int32(1), np.array(2, np.int32), jnp.int32(3))
  np.testing.assert_array_equal(stack_leaf(mixed, 3, sc), [1, 2, 3])
