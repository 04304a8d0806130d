"""Core contract tests, trees: the occupancy and sum trees' incremental refreshes equal a
rebuild bit for bit (the weight descents: test_weight_descent.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(0, 39), st.integers(0, 1),
                                              st.booleans()), min_size=1, max_size=12))
def test_count_tree_refresh_equals_rebuild(capacity, updates):
  """The one-scatter-add refresh of the occupancy tree matches a from-scratch build."""
  from funcreplay.core import trees
  p = 1 << max(0, (capacity - 1).bit_length())
  leaves = np.zeros(p, np.int32)
  tree = trees.build_sum(jnp.asarray(leaves))
  seen, slots, values, valid = set(), [], [], []
  for slot, value, ok in updates:
    slot %= capacity
    ok = ok and slot not in seen  # valid slots are distinct (the documented contract)
    seen |= {slot} if ok else set()
    slots.append(slot), values.append(value), valid.append(ok)
    if ok:
      leaves[slot] = value
  tree = trees.refresh_count(tree, jnp.asarray(slots, jnp.int32), jnp.asarray(values, jnp.int32),
                             jnp.asarray(valid))
  np.testing.assert_array_equal(np.asarray(tree), np.asarray(trees.build_sum(jnp.asarray(leaves))))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 300), st.lists(st.tuples(st.integers(0, 299), st.floats(0, 10, width=32)),
                                     min_size=1, max_size=6), st.integers(0, 2**16))
def test_sum_tree_block_refresh_is_bit_identical(capacity, updates, seed):
  """Few updates recompute 4 levels per step, many 2, the top levels densely from any
  depth: the same bits, and those of a tree built from scratch (every node
  fl(left + right) of its children)."""
  from funcreplay.core import trees
  p = 1 << max(0, (capacity - 1).bit_length())
  leaves = np.random.default_rng(seed).random(p).astype(np.float32)
  tree = trees.build_sum(jnp.asarray(leaves))
  slots = np.array([s % capacity for s, _ in updates], np.int32)
  values = np.array([v for _, v in updates], np.float32)
  _, last = np.unique(slots[::-1], return_index=True)  # one value per slot
  keep = np.zeros(len(slots), bool)
  keep[len(slots) - 1 - last] = True
  few = trees.refresh_sum(tree, jnp.asarray(slots), jnp.asarray(values), jnp.asarray(keep))
  pad = 200 - len(slots)  # > 128 entries: the other block size
  many = trees.refresh_sum(tree, jnp.asarray(np.r_[slots, np.zeros(pad, np.int32)]),
                           jnp.asarray(np.r_[values, np.zeros(pad, np.float32)]),
                           jnp.asarray(np.r_[keep, np.zeros(pad, bool)]))
  np.testing.assert_array_equal(np.asarray(few).view(np.uint32), np.asarray(many).view(np.uint32))
  leaves[slots[keep]] = values[keep]
  want = np.asarray(trees.build_sum(jnp.asarray(leaves))).view(np.uint32)
  np.testing.assert_array_equal(np.asarray(few).view(np.uint32), want)
  # The top levels recomputed densely from any depth (0: none; the depth: all of them).
  for dense in sorted({0, 1, 3, trees.depth(p)}):
    got = trees.refresh_sum(tree, jnp.asarray(slots), jnp.asarray(values), jnp.asarray(keep),
                            dense=dense)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want, err_msg=f"{dense=}")
  np.testing.assert_allclose(np.asarray(few[1]), leaves.astype(np.float64).sum(), rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(0, 39), st.booleans()),
                                    min_size=1, max_size=12))
def test_add_one_equals_rebuild(capacity, updates):
  """``trees.add_one`` (the ring insert's occupancy update) matches a from-scratch build:
  1 added at the distinct slots marked, nothing at the others."""
  from funcreplay.core import trees
  p = 1 << max(0, (capacity - 1).bit_length())
  leaves = np.zeros(p, np.int32)
  tree = trees.build_sum(jnp.asarray(leaves))
  seen, slots, where = set(), [], []
  for slot, ok in updates:
    slot %= capacity
    ok = ok and slot not in seen
    seen |= {slot} if ok else set()
    slots.append(slot), where.append(ok)
    leaves[slot] += ok
  tree = trees.add_one(tree, jnp.asarray(slots, jnp.int32), jnp.asarray(where))
  np.testing.assert_array_equal(np.asarray(tree), np.asarray(trees.build_sum(jnp.asarray(leaves))))
