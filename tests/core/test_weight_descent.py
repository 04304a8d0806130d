"""Draws proportional to weight (``weight_descent``): the blocked descent takes the binary
descent's path bit for bit, and the two-stage descent's realised probabilities, counted
over every target of both stages, are each leaf's share to within a few 2**-16 of itself
where one stage rounded them to 2**-24 of the total."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from funcreplay.core import inplace, trees, weight_descent

# Values of a 24-bit uniform (``bits.uniform24``): the grid a stage's draw counts over.
_GRID = 1 << 24


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 14), st.floats(0, 1), st.integers(0, 2**16))
def test_blocked_weight_descent_is_the_binary_descent(log_p, zero_frac, seed):
  """``descend_weight_blocked`` (2 levels per step on CPU, 4 elsewhere, and others) takes the
  binary descent's path, bit for bit, redraw included (from 256 leaves), zero-weight leaves
  and targets at the interval ends included."""
  rng = np.random.default_rng(seed)
  p = 1 << log_p
  leaves = (rng.random(p) * (rng.random(p) >= zero_frac)).astype(np.float32)
  leaves[rng.integers(p)] = 1.0
  tree = trees.build_sum(jnp.asarray(leaves))
  u = np.r_[rng.random(61), 0.0, 1.0 - 2**-24].astype(np.float32) * np.asarray(tree[1])
  fresh = jnp.asarray(np.r_[rng.random(61), 1.0 - 2**-24, 0.0].astype(np.float32))
  want = weight_descent.descend_weight(tree, jnp.asarray(u), fresh)
  # (4, 13): the accelerators' levels a step (sampling.exact.ACCELERATOR_WEIGHT_LEVELS).
  for levels, top_depth in ((1, 13), (2, 13), (3, 13), (4, 13), (2, 0), (2, 3), (3, 4), (4, 0)):
    got = weight_descent.descend_weight_blocked(tree, jnp.asarray(u), fresh,
                                                inplace.materialize, levels, top_depth)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{levels=}")


def test_redraw_depth_is_about_half_the_levels():
  """The rule the native ``RedrawDepth`` repeats: none below 256 leaves, then the multiple of
  4 nearest half the depth: neither stage spans more than half the levels plus 2."""
  assert [weight_descent.redraw_depth(1 << d) for d in (0, 7, 8, 11, 12, 19, 20, 24, 30)] == [
      0, 0, 4, 4, 8, 8, 12, 12, 16]
  for d in range(8, 32):
    r = weight_descent.redraw_depth(1 << d)
    assert r % weight_descent.REDRAW_ALIGN == 0 and max(r, d - r) <= d // 2 + 2


def _grid(k):
  """Grid value ``k`` (int32) as the uniform ``k * 2**-24`` (float32, exact)."""
  return k.astype(jnp.float32) * 2.0**-24


def _counts(draw, boundaries):
  """``c[i]``: how many of the 2**24 grid values ``k`` draw a leaf in ``[boundaries[i],
  boundaries[i + 1])`` under ``draw`` (int32 ``k`` -> leaf), found by bisection for the
  first ``k`` at or past each boundary. Exact because a draw is monotone in ``k`` (a
  larger target never lands on an earlier leaf: every comparison and rounded subtraction
  of the descent is monotone), which the test also checks on a sample."""
  b = jnp.asarray(boundaries, jnp.int32)
  lo, hi = jnp.zeros(b.shape, jnp.int32), jnp.full(b.shape, _GRID, jnp.int32)
  for _ in range(25):  # 2**24 + 1 candidates
    mid = (lo + hi) // 2  # < _GRID while lo < hi
    past = draw(jnp.minimum(mid, _GRID - 1)) >= b
    lo, hi = jnp.where(~past & (lo < hi), mid + 1, lo), jnp.where(past & (lo < hi), mid, hi)
  return np.diff(np.asarray(lo, np.int64))


def test_every_leaf_is_drawn_with_its_share_to_a_few_parts_in_100_000():
  """Exact realised probabilities, no sampling noise. 50,000 weights in [0.5, 1.5) in a
  65,536-leaf tree (redraw at depth 8: nodes of 256 leaves). Stage 1: the 2**24 target
  values with ``fresh = 0`` (which lands on a node's first positive leaf) give each node's
  count; stage 2: the 2**24 ``fresh`` values below two nodes (the first, and the last,
  partial one). Realised ``P(leaf) = c1(node) / 2**24 * c2(leaf) / 2**24`` is within 3 grid
  steps of the share at each stage (a float32 ``fresh * node sum`` has the grid's own
  spacing, so the roundings merge or skip a step or two). One stage gave each leaf 335 or
  336 of the 2**24 targets: 0.3% apart here, 6% among 2**20 equal weights."""
  p, n, node_leaves = 1 << 16, 50_000, 256
  assert trees.depth(p) - weight_descent.redraw_depth(p) == 8  # nodes of 256 leaves
  rng = np.random.default_rng(0)
  leaves = np.zeros(p, np.float32)
  leaves[:n] = 0.5 + rng.random(n).astype(np.float32)
  tree = trees.build_sum(jnp.asarray(leaves))
  total = np.float64(np.asarray(tree[1]))
  descend = jax.jit(weight_descent.descend_weight)

  def stage1(k):
    return descend(tree, _grid(k) * tree[1], jnp.zeros(k.shape, jnp.float32))

  sample = jnp.asarray(np.sort(rng.integers(0, _GRID, 1 << 16)), jnp.int32)
  assert np.all(np.diff(np.asarray(stage1(sample))) >= 0)
  node_count = _counts(stage1, np.arange(0, p + 1, node_leaves))
  node_sum = leaves.astype(np.float64).reshape(-1, node_leaves).sum(axis=1)
  live = node_sum > 0
  assert node_count.sum() == _GRID and np.all(node_count[~live] == 0)
  node_share = node_sum[live] / total
  np.testing.assert_array_less(np.abs(node_count[live] / _GRID - node_share), 3 * 2.0**-24)

  for node in (0, n // node_leaves):
    lo = node * node_leaves
    # Any target inside this node's interval: its first grid value.
    target = _grid(jnp.int32(node_count[:node].sum())) * tree[1]

    def stage2(k, target=target):
      return descend(tree, jnp.full(k.shape, target), _grid(k))

    assert np.all(np.diff(np.asarray(stage2(sample))) >= 0)
    c2 = _counts(stage2, np.arange(lo, lo + node_leaves + 1))
    assert c2.sum() == _GRID and np.all(c2[leaves[lo:lo + node_leaves] == 0] == 0)
    w = leaves[lo:lo + node_leaves].astype(np.float64)
    keep = w > 0
    realised = node_count[node] / _GRID * c2[keep] / _GRID
    share = w[keep] / total
    rel = np.abs(realised / share - 1)
    # Stage errors: 3 grid steps of the node's share and of the leaf's share of the node.
    bound = 3 * 2.0**-24 * (1 / node_share[node] + node_sum[node] / w[keep])
    np.testing.assert_array_less(rel, bound)
    assert rel.max() < 6e-5, rel.max()  # 3 grid steps of a 1/256 share: 4.5e-5


def test_uniform24_is_exact_and_a_target_is_one_rounding():
  """``uniform24(w) = (w >> 8) * 2**-24`` exactly, and a target ``uniform24_times(w, total)``
  in a program is the one rounding of that product even for a total below 2**-102 (where
  XLA's reassociation of ``(x * 2**-24) * total`` to ``x * (total * 2**-24)`` flushed a
  subnormal to 0)."""
  from funcreplay.core import bits
  words = np.array([0, 255, 256, 257, 2**31, 2**32 - 1, 0x12345678, 0xFFFFFF00], np.uint32)
  want = (words >> 8).astype(np.float32) * np.float32(2.0**-24)
  np.testing.assert_array_equal(np.asarray(bits.uniform24(jnp.asarray(words))), want)
  for total in (np.float32(3.6e-37), np.float32(1e-31), np.float32(1.0), np.float32(3e38)):
    got = jax.jit(bits.uniform24_times)(jnp.asarray(words), total)
    product = want * total
    # XLA:CPU flushes a subnormal result to 0 (a target below every normal weight: the
    # same leaf either way, as the kernel's unflushed one).
    product[np.abs(product) < np.finfo(np.float32).tiny] = 0.0
    np.testing.assert_array_equal(np.asarray(got), product, err_msg=f"{total=}")
