"""Item storage: one array per signature leaf ("columns"), or every leaf of an item packed
into one row of uint32 words ("rows").

With ``"rows"``, ``state.data`` is a single ``uint32[*lead, R]`` array, ``R =
sum(leaf sizes)`` words (``width``): an item is written by one
``dynamic_update_slice`` / scatter of one row and read by one gather of whole
rows, then split and bit-cast back to its leaves (``unpack``: slices and
bit-casts that XLA fuses into the consumers). With ``"columns"`` every leaf
is its own ``[*lead, ...]`` array (one gather and one write per leaf).

Why rows: XLA:CPU pays per gather and per gathered element, and a row of
contiguous words is read as whole cache lines. Measured inside ``lax.scan``
(``experiments/bench_layout.py``, the 524-byte transition, capacity 262,144):
sampling 256 rows was ~3x faster from one ``u32[C, 136]`` array than from
five per-leaf columns, and funcreplay's own uniform insert b16 + sample b256
went from 0.67x to 1.44x flashbax (BUILD.md, "Row storage").

Rows apply when every leaf is 4 bytes wide (float32 / int32 / uint32, so a
bit-cast is exact and free) and there are at least two leaves (one leaf is
already one array); ``TableSpec(storage=None)`` picks them then, ``"columns"``
otherwise. The choice is a layout only: samples, states' meaning and
checkpoints do not depend on it (a checkpoint stores the columns, see
``to_columns``), and the same ``(state, key)`` gives the same batch either way.
Every function here works on jax arrays (also while tracing) and on numpy
arrays (the checkpoint's host copies).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import signature as sig_lib

WORD = 4  # bytes per stored word
STORAGES = ("rows", "columns")


def packable(signature: sig_lib.Signature) -> Optional[str]:
  """None if ``signature`` can be stored as rows; else why not (for error messages)."""
  if len(signature.leaves) < 2:
    return "the item has one leaf (it is stored as one array already)"
  for name, x in zip(signature.names, signature.leaves):
    dt = np.dtype(x.dtype)
    if dt.itemsize != WORD or dt.kind not in "fiu":
      return (f"leaf {name} is {dt.name}; rows need every leaf 4 bytes wide "
              "(float32 / int32 / uint32)")
  return None


def resolve(signature: sig_lib.Signature, storage: Optional[str], ragged: bool) -> str:
  """The storage a ``TableSpec`` uses: ``storage`` checked, or picked when None."""
  if storage is None:
    return "rows" if not ragged and packable(signature) is None else "columns"
  if storage not in STORAGES:
    raise ValueError(f"TableSpec.storage must be None, 'rows' or 'columns', got {storage!r}.")
  if storage == "rows":
    why = "the item has ragged leaves" if ragged else packable(signature)
    if why is not None:
      raise ValueError(f"TableSpec.storage='rows': {why}. Use storage='columns' (or None).")
  return storage


def width(signature: sig_lib.Signature) -> int:
  """``R``: words per stored row."""
  return sum(math.prod(x.shape) for x in signature.leaves)


def empty(signature: sig_lib.Signature, rows: bool, lead):
  """Zero storage with leading axes ``lead``."""
  if rows:
    return jnp.zeros(tuple(lead) + (width(signature),), jnp.uint32)
  return sig_lib.zeros(signature, tuple(lead))


def _is_numpy(x) -> bool:
  return isinstance(x, np.ndarray) and not isinstance(x, jax.Array)


def pack(signature: sig_lib.Signature, rows: bool, tree: Any, nlead: int):
  """An item pytree (leaves ``[*lead, *leaf_shape]``) as storage: the tree itself
  (columns), or ``uint32[*lead, R]`` words (rows)."""
  if not rows:
    return tree
  leaves = signature.treedef.flatten_up_to(tree)
  lead = tuple(np.shape(leaves[0])[:nlead])
  if all(_is_numpy(x) for x in leaves):
    return np.concatenate([np.ascontiguousarray(x).view(np.uint32).reshape(lead + (-1,))
                           for x in leaves], axis=-1)
  return jnp.concatenate([lax.bitcast_convert_type(jnp.asarray(x), jnp.uint32)
                          .reshape(lead + (-1,)) for x in leaves], axis=-1)


def put_one(signature: sig_lib.Signature, rows: bool, data: Any, item: Any, start):
  """``data`` with one item (leaves ``[1, *leaf_shape]``) written at slot ``start``.

  Columns: one ``dynamic_update_slice`` per leaf. Rows: the row's words are built by one
  elementwise expression (each leaf bit-cast and padded to its words of the row, the
  pads OR-ed; the words outside a leaf's range are 0) and written by one
  ``dynamic_update_slice``. XLA fuses that expression, with the leaves' slices out of a
  ``lax.scan`` input, into the in-place update: one operation where a ``concatenate``
  (which XLA:CPU runs as its own operation, fed by one more per leaf) or a write per leaf
  would be six or five (in-scan insert b1: 0.50 -> 0.22 us for the row write alone,
  BUILD.md finding 15). For B rows the OR form is slower than the concatenation (every
  output word evaluates every pad: 16 rows 2.0 -> 3.8 us), so ``pack`` keeps it."""
  leaves = signature.treedef.flatten_up_to(item)
  if not rows:
    cols = signature.treedef.flatten_up_to(data)
    return jax.tree_util.tree_unflatten(signature.treedef, [
        lax.dynamic_update_slice_in_dim(c, jnp.asarray(x).astype(c.dtype), start, 0)
        for c, x in zip(cols, leaves)])
  r, at, row = width(signature), 0, None
  for x, leaf in zip(leaves, signature.leaves):
    words = lax.bitcast_convert_type(jnp.asarray(x).astype(leaf.dtype), jnp.uint32)
    n = math.prod(leaf.shape)
    padded = lax.pad(words.reshape(1, n), jnp.uint32(0), [(0, 0, 0), (at, r - at - n, 0)])
    row = padded if row is None else row | padded
    at += n
  return lax.dynamic_update_slice(data, row, (start, jnp.int32(0)))


def unpack(signature: sig_lib.Signature, rows: bool, data: Any, nlead: int):
  """Storage (leading axes ``nlead``) back to the item pytree. For numpy input the leaves
  are fresh C-contiguous arrays."""
  if not rows:
    return data
  lead = tuple(data.shape[:nlead])
  out, at = [], 0
  for x in signature.leaves:
    n = math.prod(x.shape)
    words = data[..., at:at + n]
    if _is_numpy(data):
      out.append(np.ascontiguousarray(words).view(x.dtype).reshape(lead + tuple(x.shape)))
    else:
      out.append(lax.bitcast_convert_type(words.reshape(lead + tuple(x.shape)), x.dtype))
    at += n
  return jax.tree_util.tree_unflatten(signature.treedef, out)


def check(spec, data, what: str) -> None:
  """Raise ``ValueError`` naming the storage when ``data`` (``state.data``, one slot axis)
  is not laid out as ``spec.storage`` says (static: shapes only). A state built under
  another storage is the likely cause, e.g. one made before storage was picked."""
  want = jax.eval_shape(lambda: empty(spec.signature, spec.packed_rows,
                                      (np.shape(jax.tree_util.tree_leaves(data)[0])[0],)))
  if jax.tree_util.tree_structure(want) != jax.tree_util.tree_structure(data) or any(
      tuple(w.shape) != tuple(np.shape(g)) or np.dtype(w.dtype) != np.dtype(g.dtype)
      for w, g in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(data))):
    layout = (f"one uint32[C, {width(spec.signature)}] array of packed rows" if spec.packed_rows
              else "the item pytree with a [C] axis")
    raise ValueError(f"{what}: state.data does not match spec.storage={spec.storage!r} "
                     f"({layout}). A state made under the other storage needs a spec with "
                     f"TableSpec(..., storage={'columns' if spec.packed_rows else 'rows'!r}), "
                     "or a checkpoint round trip (checkpoints restore into either storage).")


def stored_items(spec, state):
  """The items ``state`` holds, as the signature's pytree with every leaf ``[C, ...]``
  (every slot, occupied or not: ``state.occupied`` says which are items), whatever
  ``spec.storage`` is. A fresh unpacked copy with row storage; read-only inspection (the
  pure functions and the host ``Table`` are how items go in and out)."""
  return to_columns(spec, state.data, 1)


def to_columns(spec, data, nlead: int):
  """``state.data`` of ``spec`` as one array per signature leaf (what checkpoints store)."""
  return unpack(spec.signature, spec.storage == "rows", data, nlead)


def from_columns(spec, data, nlead: int):
  """The inverse of ``to_columns``: per-leaf arrays as ``spec``'s storage."""
  return pack(spec.signature, spec.storage == "rows", data, nlead)
