"""Item info: each slot's key, version, times sampled and priority in one ``uint32[C, 4]`` row.

``TableState.item_info`` holds, per slot, the four words a ``sample`` hands out
as ``SampleInfo`` (its ``probability`` aside), each as the bit pattern of its
dtype:

  ======  ===============  ========  ==============================================
  column  name             dtype     meaning
  ======  ===============  ========  ==============================================
  0       ``key``          uint32    the item's unique id (insertion index mod 2**32)
  1       ``version``      int32     the policy version that produced the item
  2       ``times_sampled`` int32    how often it was sampled
  3       ``priority``     float32   its priority (prioritized and heap selectors)
  ======  ===============  ========  ==============================================

Why one array and not four columns: inside a jitted step XLA:CPU runs every
operation of a loop body through its thunk executor, and a small step's time
is proportional to the number of operations, not to the bytes they move
(BUILD.md, finding 15). With one array, an insert writes the four words of a
row with one ``dynamic_update_slice`` (four, as columns) and a sample reads
them with one gather of ``[B, 4]`` (four gathers). On a GPU each of those is
a kernel launch. Whole-column reads (``column``; the ordered samplers, the
checkpoint) read every fourth word, which costs O(C) either way.

``TableState``'s properties ``key``, ``version``, ``times_sampled`` and
``priority`` read typed columns through ``column``; the operations write rows
through ``put`` and single words through ``put_field`` / ``add_field``, which
XLA updates in place. This module is the codec (no drift: the native kernels
find each column through ``COLUMNS`` and ``WIDTH``, passed to them by
``funcreplay.native``).
"""

from __future__ import annotations

from typing import Dict, Mapping

import jax.numpy as jnp
import numpy as np
from jax import lax

ITEM_INFO = (
    ("key", jnp.uint32),
    ("version", jnp.int32),
    ("times_sampled", jnp.int32),
    ("priority", jnp.float32),
)
FIELDS = tuple(name for name, _ in ITEM_INFO)
COLUMNS = {name: i for i, name in enumerate(FIELDS)}
DTYPES = dict(ITEM_INFO)
WIDTH = len(ITEM_INFO)


def _is_host(x) -> bool:
  return isinstance(x, (np.ndarray, np.generic, int, float))


def _field(name: str) -> int:
  if name not in COLUMNS:
    raise KeyError(f"item_info has no field {name!r}; its fields are {list(FIELDS)}.")
  return COLUMNS[name]


def empty(capacity: int) -> jnp.ndarray:
  """uint32[capacity, WIDTH] of zeros (key 0, version 0, never sampled, priority 0.0)."""
  return jnp.zeros((capacity, WIDTH), jnp.uint32)


def checked(info):
  if np.ndim(info) < 2 or np.shape(info)[-1] != WIDTH:
    raise ValueError(f"state.item_info has shape {list(np.shape(info))}; a TableState's "
                     f"item_info holds {WIDTH} uint32 words per slot on its last axis "
                     f"({list(FIELDS)}; funcreplay.core.item_info).")
  return info


def to_words(x, name: str):
  """``x`` converted to field ``name``'s dtype, its bits as uint32 (same shape)."""
  dtype = DTYPES[name]
  if _is_host(x):
    return np.asarray(np.asarray(x).astype(np.dtype(dtype))).view(np.uint32)
  return lax.bitcast_convert_type(jnp.asarray(x).astype(dtype), jnp.uint32)


def from_words(words, name: str):
  """uint32 ``words`` of field ``name`` reinterpreted as its dtype."""
  dtype = DTYPES[name]
  if isinstance(words, np.ndarray):
    return words.view(np.dtype(dtype))
  return lax.bitcast_convert_type(words, dtype)


def column(info, name: str):
  """Field ``name`` of every slot: ``[..., C]`` of its dtype (numpy in, numpy out)."""
  return from_words(checked(info)[..., _field(name)], name)


def at(info, slots, name: str):
  """Field ``name`` of the slots ``slots`` (int32 of any shape, a scalar too): that shape,
  of the field's dtype, gathered from ``info`` itself. Not ``column(info, name)[slots]``:
  a gather's operand is a buffer on XLA:TPU, so that column (a strided slice of ``info``)
  was copied out whole, O(C) every call (BUILD.md finding 28); XLA:CPU and XLA:GPU fuse
  either form into the gather."""
  return from_words(checked(info)[slots, _field(name)], name)


def unpack(words) -> Dict[str, jnp.ndarray]:
  """``uint32[..., WIDTH]`` rows (say ``item_info[slots]``) -> name -> ``[...]`` typed."""
  return {name: from_words(words[..., i], name) for i, name in enumerate(FIELDS)}


def pack(**fields) -> jnp.ndarray:
  """``uint32[..., WIDTH]`` rows holding ``fields`` (every name of ``FIELDS``, same shape)."""
  if set(fields) != set(FIELDS):
    raise ValueError(f"item_info.pack needs exactly {list(FIELDS)}; missing "
                     f"{sorted(set(FIELDS) - set(fields))}, unexpected "
                     f"{sorted(set(fields) - set(FIELDS))}.")
  words = [to_words(fields[name], name) for name in FIELDS]
  shape = np.broadcast_shapes(*(np.shape(w) for w in words))
  if all(isinstance(w, np.ndarray) for w in words):
    return np.stack([np.broadcast_to(w, shape) for w in words], axis=-1)
  # Each word padded to its column and the pads OR-ed: one elementwise expression
  # that XLA fuses into the write of the rows (a stack is a concatenate, which
  # XLA:CPU can run as an operation of its own; storage.put_one).
  # Host words (say times_sampled=0) go into one literal: XLA folds a pad of a constant
  # into a broadcast that it hoists out of a scan's loop, an operation on every call.
  host, rows = np.zeros(shape + (WIDTH,), np.uint32), None
  for i, w in enumerate(words):
    if isinstance(w, np.ndarray):
      host[..., i] = w
      continue
    w = jnp.broadcast_to(w, shape)[..., None]
    padded = lax.pad(w, jnp.uint32(0), [(0, 0, 0)] * len(shape) + [(i, WIDTH - 1 - i, 0)])
    rows = padded if rows is None else rows | padded
  if rows is None:
    return host
  return rows | host if host.any() else rows


def set_column(info, name: str, values):
  """``info`` with field ``name`` of every slot replaced by ``values`` (``[..., C]``).

  O(C): for whole-column rewrites (restores, sharded states). Operations on B
  slots use ``put`` / ``put_field`` / ``add_field``.
  """
  i = _field(name)
  words = to_words(values, name)
  if isinstance(info, np.ndarray) and isinstance(words, np.ndarray):
    out = info.copy()
    out[..., i] = words
    return out
  return jnp.asarray(info).at[..., i].set(words)


def put(info, slots, rows, **scatter_kwargs):
  """``info`` with rows ``slots`` (int32[B]) set to ``rows`` (uint32[B, WIDTH], ``pack``)."""
  return info.at[slots].set(rows, **scatter_kwargs)


def put_field(info, slots, name: str, values, **scatter_kwargs):
  """``info`` with field ``name`` of ``slots`` (int32[B]) set to ``values`` ([B])."""
  return info.at[slots, _field(name)].set(to_words(values, name), **scatter_kwargs)


def add_field(info, slots, name: str, n, **scatter_kwargs):
  """``info`` with ``n`` added to the integer field ``name`` of ``slots`` (wraps mod 2**32)."""
  if DTYPES[name] == jnp.float32:
    raise TypeError(f"item_info.add_field: {name} is a float field; use put_field.")
  # Whole rows, ``n`` in the field's column and 0 elsewhere: the slots alone index the
  # scatter (a ``[B, 2]`` index of (slot, column) is one more operation to build).
  words = jnp.broadcast_to(jnp.asarray(to_words(n, name)), jnp.shape(slots))[:, None]
  i = _field(name)
  rows = lax.pad(words, jnp.uint32(0), [(0, 0, 0), (i, WIDTH - 1 - i, 0)])
  return info.at[slots].add(rows, **scatter_kwargs)


def fields_of(state) -> Mapping[str, jnp.ndarray]:
  """The four columns by name (``TableState``'s properties)."""
  return {name: getattr(state, name) for name in FIELDS}
