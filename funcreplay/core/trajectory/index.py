"""The index of windows crossing no episode start: a bitmask plus a count tree over its words.

With ``cross_episodes=False`` the sampleable windows are the stored ones
minus those that contain an episode start after their first step: not a
closed form any more. Bit ``w`` of ``ok_bits`` (uint32 words, 32 windows
each) says whether window ``w`` is complete and crosses no episode start;
``ok_tree`` is an int32 count tree (``core.trees`` layout) whose leaf ``i``
counts the set bits of word ``i``.

Why not a count tree over the windows themselves: at 16 envs x 65,536 steps
that tree holds 2M int32 (8 MiB) and every draw walks 20 levels of it with a
cache miss per level; over the 32,768 words it is 256 KiB and stays in
cache. A draw descends the word tree (``uniform_lean.kth_with_rank``: the word
and the rank of the wanted bit in it), then selects that set bit of the word
with five popcounts. An update flips bits (one scatter-add on the words: the
windows of one update are distinct) and adds +-1 along the word's ancestors
(one scatter-add). O(log(N / 32)) per window either way, no loop.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from funcreplay.core import trees
from funcreplay.core.sampling.uniform_lean import kth_with_rank

BITS = 32  # windows per word


def num_words(num_windows: int) -> int:
  return -(-num_windows // BITS)


def tree_size(num_windows: int) -> int:
  """Leaves of ``ok_tree``: the next power of two >= the number of words."""
  return 1 << max(0, (num_words(num_windows) - 1).bit_length())


def empty(num_windows: int):
  """``(ok_bits uint32[words], ok_tree int32[2P])`` with no window set."""
  return (jnp.zeros((num_words(num_windows),), jnp.uint32),
          jnp.zeros((2 * tree_size(num_windows),), jnp.int32))


def is_set(bits, w):
  """bool[...]: bit ``w`` (int32[...], in range) of ``bits``."""
  return ((bits[w // BITS] >> (w % BITS).astype(jnp.uint32)) & jnp.uint32(1)) > 0


def update(bits, tree, w, value, valid):
  """Set bit ``w`` to ``value`` (bool[K]) where ``valid``; the valid ``w`` must be distinct.

  Returns ``(bits, tree)``. Each bit that changes adds ``+-2**b`` to its word
  (no carry: the bit was clear / set) and ``+-1`` to the word's leaf and
  every ancestor; additions commute, so words shared by several rows are fine.
  """
  w = jnp.where(valid, w, 0)
  change = valid & (is_set(bits, w) != value)
  one = jnp.uint32(1) << (w % BITS).astype(jnp.uint32)
  word = jnp.where(change, w // BITS, bits.shape[0])
  bits = bits.at[word].add(jnp.where(value, one, jnp.uint32(0) - one), mode="drop")
  p = tree.shape[0] // 2
  levels = jnp.arange(trees.depth(p) + 1, dtype=jnp.int32)[:, None]
  nodes = jnp.where(change[None, :], (p + w // BITS)[None, :] >> levels, 2 * p)
  delta = jnp.broadcast_to(jnp.where(value, 1, -1).astype(jnp.int32)[None, :], nodes.shape)
  tree = tree.at[nodes.reshape(-1)].add(delta.reshape(-1), mode="drop")
  return bits, tree


def kth(bits, tree, k):
  """int32[B]: the ``k``-th (0-based, below ``tree[1]``) set bit of ``bits``."""
  word, rank = kth_with_rank(tree, k)
  x = bits[jnp.minimum(word, bits.shape[0] - 1)]
  pos = jnp.zeros(k.shape, jnp.int32)
  for width in (16, 8, 4, 2, 1):  # binary search by the popcount of the lower half
    low = (x >> pos.astype(jnp.uint32)) & jnp.uint32((1 << width) - 1)
    c = lax.population_count(low).astype(jnp.int32)
    go = rank >= c
    rank = jnp.where(go, rank - c, rank)
    pos = jnp.where(go, pos + width, pos)
  return word * BITS + pos


def count(tree):
  return tree[1]
