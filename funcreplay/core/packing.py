"""A sampled batch as one contiguous byte buffer (``Table.sample_packed``).

A ``Sample`` is about a dozen arrays (the item leaves, ``valid``, six info
columns, ``num_eligible``). Every array handed to another framework costs a
fixed amount on the host: a DLPack export of a fresh JAX CPU array takes
~10 us, so a batch crossed into torch leaf by leaf cost more than sampling it.
Packed, the batch is a single ``uint8`` buffer written by the same compiled
program that samples it: one export, then each field is a zero-copy view at a
fixed offset (``PackedLayout``).

Layout: fields in order (item leaves in pytree order, then ``valid``,
``info.slot``, ``info.key``, ``info.probability``, ``info.priority``,
``info.times_sampled``, ``info.version``, ``num_eligible``), each C-contiguous
``[B, ...]`` (``num_eligible`` a scalar) in native byte order, starting at a
multiple of 64 bytes; ``bool`` fields are stored as bytes 0 / 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import caches
from funcreplay.core.signature import Signature
from funcreplay.core.state import Sample, SampleInfo

ALIGN = 64  # bytes; every field starts at a multiple (cache line, any SIMD width)

_INFO = (("slot", np.int32), ("key", np.uint32), ("probability", np.float32),
         ("priority", np.float32), ("times_sampled", np.int32), ("version", np.int32))


@dataclasses.dataclass(frozen=True)
class PackedField:
  """One array inside a packed buffer.

  Attributes:
    name: ``"data" + leaf path`` (e.g. ``"data['obs']"``), ``"valid"``,
      ``"info.<column>"`` or ``"num_eligible"``.
    dtype: numpy dtype of the array (``bool`` is stored as bytes 0 / 1).
    shape: its shape (``[B, ...]``; ``()`` for ``num_eligible``).
    offset: first byte in the buffer (a multiple of ``ALIGN``).
  """

  name: str
  dtype: np.dtype
  shape: Tuple[int, ...]
  offset: int

  @property
  def nbytes(self) -> int:
    # math.prod: np.prod costs ~4 us a call, and PackedSample.numpy reads this per field.
    return math.prod(self.shape) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Where each field of a packed batch of ``batch_size`` rows lies (static, hashable).

  Attributes:
    batch_size: B.
    treedef: pytree structure of the item (``data`` fields, in order).
    fields: ``PackedField`` per array: the item leaves, then ``valid``, the
      six ``info`` columns and ``num_eligible``.
    nbytes: size of the buffer (a multiple of ``ALIGN``).
  """

  batch_size: int
  treedef: Any
  fields: Tuple[PackedField, ...]
  nbytes: int

  def __hash__(self) -> int:
    # Cached: layouts key lru caches on every sample's path (funcreplay.torch),
    # and hashing the fields anew costs microseconds.
    h = self.__dict__.get("_hash")
    if h is None:
      h = hash((self.batch_size, self.treedef, self.fields, self.nbytes))
      object.__setattr__(self, "_hash", h)
    return h

  @property
  def num_data(self) -> int:
    return len(self.fields) - 2 - len(_INFO)

  def field(self, name: str) -> PackedField:
    for f in self.fields:
      if f.name == name:
        return f
    raise KeyError(f"PackedLayout has no field {name!r}; fields: "
                   f"{[f.name for f in self.fields]}.")


@functools.lru_cache(maxsize=256)
def packable(signature: Signature) -> Optional[str]:
  """None if items of ``signature`` can be packed, else why not.

  Fields are cut out of the buffer as byte ranges, so every element must
  take whole bytes (XLA packs sub-byte types such as int4 several per byte).
  """
  for name, leaf in zip(signature.names, signature.leaves):
    if jax.dtypes.itemsize_bits(leaf.dtype) % 8:
      return f"item leaf {name} has the sub-byte dtype {np.dtype(leaf.dtype).name}"
    if np.dtype(leaf.dtype).kind == "c":  # bitcast_convert_type has no complex form
      return f"item leaf {name} has the complex dtype {np.dtype(leaf.dtype).name}"
  return None


caches.register("core.packing.packable", packable.cache_clear)


@functools.lru_cache(maxsize=256)
def layout(signature: Signature, batch_size: int) -> PackedLayout:
  """The ``PackedLayout`` of a ``batch_size``-row sample of ``signature`` items."""
  why = packable(signature)
  if why is not None:
    raise ValueError(f"cannot pack samples: {why}; use Table.sample instead.")
  b = int(batch_size)
  specs = [(f"data{n if n != '<root>' else ''}", np.dtype(x.dtype), (b,) + tuple(x.shape))
           for n, x in zip(signature.names, signature.leaves)]
  specs.append(("valid", np.dtype(bool), (b,)))
  specs += [(f"info.{n}", np.dtype(d), (b,)) for n, d in _INFO]
  specs.append(("num_eligible", np.dtype(np.int32), ()))
  fields, offset = [], 0
  for name, dtype, shape in specs:
    f = PackedField(name, dtype, shape, offset)
    fields.append(f)
    offset += -(-f.nbytes // ALIGN) * ALIGN
  return PackedLayout(b, signature.treedef, tuple(fields), max(offset, ALIGN))


caches.register("core.packing.layout", layout.cache_clear)


def _as_bytes(x: jnp.ndarray) -> jnp.ndarray:
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint8).reshape(-1)
  # Elements of k > 1 bytes become [..., k] bytes (native byte order).
  return lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def pack(sample: Sample, lay: PackedLayout) -> jnp.ndarray:
  """uint8[lay.nbytes]: ``sample`` laid out by ``lay`` (traceable; padding is zero)."""
  info = sample.info
  arrays = [*jax.tree_util.tree_leaves(sample.data), sample.valid,
            *(getattr(info, n) for n, _ in _INFO), sample.num_eligible]
  if len(arrays) != len(lay.fields):
    raise ValueError(f"pack: the sample has {len(arrays)} arrays, the layout "
                     f"{len(lay.fields)} fields.")
  out = jnp.zeros((lay.nbytes,), jnp.uint8)
  for x, f in zip(arrays, lay.fields):
    x = jnp.asarray(x)
    if tuple(x.shape) != f.shape or np.dtype(x.dtype) != f.dtype:
      raise ValueError(f"pack: field {f.name} is {x.dtype}{list(x.shape)}, the layout "
                       f"expects {f.dtype}{list(f.shape)}.")
    # One in-place copy per field (a concatenate of them all is a per-byte
    # select over every operand on XLA:CPU, several times slower).
    out = lax.dynamic_update_slice(out, _as_bytes(x), (f.offset,))
  return out


def check_buffer(buffer, lay: PackedLayout, what: str) -> None:
  """ValueError unless ``buffer`` is ``uint8[lay.nbytes]`` (e.g. a vmapped or
  scanned ``PackedSample`` holds one buffer per batch: index it first)."""
  shape, dtype = tuple(buffer.shape), np.dtype(str(buffer.dtype).removeprefix("torch."))
  if shape != (lay.nbytes,) or dtype != np.uint8:
    extra = (f" (a stack of {shape[0]} packed batches? index one first)"
             if len(shape) == 2 and shape[1] == lay.nbytes else "")
    raise ValueError(f"{what}: expected a uint8[{lay.nbytes}] buffer for this layout, got "
                     f"{dtype.name}{list(shape)}{extra}.")


def _field_from_bytes(buffer: jnp.ndarray, f: PackedField) -> jnp.ndarray:
  raw = lax.slice(buffer, (f.offset,), (f.offset + f.nbytes,))
  if f.dtype == np.bool_:
    return raw.reshape(f.shape) != 0
  if f.dtype.itemsize == 1:
    return lax.bitcast_convert_type(raw, f.dtype).reshape(f.shape)
  return lax.bitcast_convert_type(raw.reshape(f.shape + (f.dtype.itemsize,)), f.dtype)


def unpack(buffer: jnp.ndarray, lay: PackedLayout) -> Sample:
  """The ``Sample`` stored in ``buffer`` (JAX arrays; traceable, copies each field)."""
  buffer = jnp.asarray(buffer)
  check_buffer(buffer, lay, "unpack")
  return _as_sample([_field_from_bytes(buffer, f) for f in lay.fields], lay)


def is_torch_tensor(x) -> bool:
  """True if ``x`` is a ``torch.Tensor``, checked without importing torch (a tensor
  exists only once torch is imported, so an unimported torch means no tensor)."""
  torch = sys.modules.get("torch")
  return torch is not None and isinstance(x, torch.Tensor)


def _host_view(buffer):
  """``buffer``, or the numpy view of a torch tensor (``Table.sample_packed(out=tensor)``)."""
  if is_torch_tensor(buffer):
    return buffer.numpy()
  return buffer


def _as_sample(arrays, lay: PackedLayout) -> Sample:
  """The ``Sample`` whose arrays, in layout order, are ``arrays``."""
  nd = lay.num_data
  info = SampleInfo(**{n: a for (n, _), a in zip(_INFO, arrays[nd + 1:nd + 1 + len(_INFO)])})
  return Sample(data=jax.tree_util.tree_unflatten(lay.treedef, arrays[:nd]),
                valid=arrays[nd], info=info, num_eligible=arrays[-1])


@functools.partial(jax.tree_util.register_dataclass, data_fields=["buffer"],
                   meta_fields=["layout"])
@dataclasses.dataclass(frozen=True)
class PackedSample:
  """A sampled batch as one buffer (``Table.sample_packed``).

  Attributes:
    buffer: uint8[layout.nbytes]: a fresh JAX array (never part of the table
      state), or the ``out`` buffer the caller passed to
      ``Table.sample_packed`` (a numpy array or CPU torch tensor).
    layout: ``PackedLayout`` saying where each field lies.
  """

  buffer: Any
  layout: PackedLayout

  def unpack(self) -> Sample:
    """The batch as a ``Sample`` of JAX arrays (copies)."""
    return _unpack_jit(_host_view(self.buffer), self.layout)

  def numpy(self) -> Sample:
    """The batch as a ``Sample`` of read-only numpy views of the buffer (zero copy on CPU)."""
    check_buffer(self.buffer, self.layout, "PackedSample.numpy")
    raw = np.asarray(_host_view(self.buffer))
    return _as_sample([raw[f.offset:f.offset + f.nbytes].view(f.dtype).reshape(f.shape)
                       for f in self.layout.fields], self.layout)


_unpack_jit = jax.jit(unpack, static_argnums=1)
