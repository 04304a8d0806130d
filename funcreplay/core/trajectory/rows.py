"""Step storage: the signature's leaves, or all of them packed into one row of words.

When every leaf of the step signature is 4 bytes wide (float32 / int32 /
uint32) and there are at least two, a step is stored as one row of
``R = sum(leaf sizes)`` uint32 words: ``state.data`` is then a single
``uint32[E, T, R]`` array (``packed(spec)``), written by one scatter per
``add`` and read by one gather per ``sample`` (``B * L`` rows of ``R``
words), then split and bitcast back to the leaves. XLA:CPU pays per gathered
element and per gather: one gather of ``2048 x 19`` words instead of four,
one per leaf, was about 20% faster here (``experiments/bench_trajectory.py``'s
step). Other signatures keep one array per leaf.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import signature as sig_lib
from funcreplay.core.trajectory.spec import TrajectorySpec

_WORD = 4  # bytes


def packed(spec: TrajectorySpec) -> bool:
  """True when steps are stored as rows of uint32 words (static)."""
  leaves = spec.signature.leaves
  return len(leaves) >= 2 and all(np.dtype(x.dtype).itemsize == _WORD
                                  and np.dtype(x.dtype).kind in "fiu" for x in leaves)


def width(spec: TrajectorySpec) -> int:
  """``R``: words per packed step."""
  return sum(math.prod(x.shape) for x in spec.signature.leaves)


def empty(spec: TrajectorySpec, lead):
  """Zero storage with leading axes ``lead``."""
  if packed(spec):
    return jnp.zeros(tuple(lead) + (width(spec),), jnp.uint32)
  return sig_lib.zeros(spec.signature, tuple(lead))


def pack(spec: TrajectorySpec, tree, nlead: int):
  """``tree`` (leaves ``[*lead, *leaf_shape]``) as storage: the tree itself, or uint32
  ``[*lead, R]`` words (``packed``)."""
  if not packed(spec):
    return tree
  leaves = spec.signature.treedef.flatten_up_to(tree)
  lead = jnp.shape(leaves[0])[:nlead]
  return jnp.concatenate([lax.bitcast_convert_type(x, jnp.uint32).reshape(lead + (-1,))
                          for x in leaves], axis=-1)


def unpack(spec: TrajectorySpec, data, nlead: int):
  """Storage (leading axes ``nlead``) back to the step pytree."""
  if not packed(spec):
    return data
  lead = data.shape[:nlead]
  out, at = [], 0
  for x in spec.signature.leaves:
    n = math.prod(x.shape)
    words = data[..., at:at + n].reshape(lead + tuple(x.shape))
    out.append(lax.bitcast_convert_type(words, x.dtype))
    at += n
  return jax.tree_util.tree_unflatten(spec.signature.treedef, out)
