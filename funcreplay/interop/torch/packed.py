"""``TorchBatch`` views of a packed sample (``Table.sample_packed``): one DLPack export per call.

``torch.from_dlpack`` of a fresh JAX CPU array costs ~10 us, more than the
rest of handing a batch over; a ``Sample`` has about a dozen arrays. A
``PackedSample`` is one buffer, so the batch crosses with one export (or one
host-to-device copy) and every field becomes a view at its offset
(``as_strided`` on a view of the buffer as that field's dtype). Each view
costs ~1.2 us of torch dispatch, so the six info columns are made when first
read (``TorchInfo.lazy``): a learner without priority write-back reads none.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional

import jax
import numpy as np
import torch

from funcreplay.core import caches, packing
from funcreplay.core.packing import PackedLayout, PackedSample, check_buffer
from funcreplay.interop.torch.batches import TorchBatch, TorchInfo, importance_weights
from funcreplay.interop.torch.dlpack import (
    OnCopy,
    TransferReport,
    as_device,
    check_on_copy,
    dense_strides,
    handle_copies,
    jax_pointer,
    move,
    same_device,
)

_INFO_FIELDS = ("slot", "key", "probability", "priority", "times_sampled", "version")


def torch_dtype(dtype) -> Optional[torch.dtype]:
  """The torch dtype of a numpy / JAX dtype (same name), or None if torch has none."""
  name = np.dtype(dtype).name
  t = getattr(torch, name, None)
  return t if isinstance(t, torch.dtype) else None


def unsupported(layout: PackedLayout) -> Optional[str]:
  """None if every field of ``layout`` has a torch dtype, else which one does not."""
  return _unsupported(layout)


@functools.lru_cache(maxsize=256)
def _unsupported(layout: PackedLayout) -> Optional[str]:
  for f in layout.fields:
    if torch_dtype(f.dtype) is None:
      return f"field {f.name} has dtype {f.dtype.name}, which torch does not have"
  return None


caches.register("interop.torch.unsupported", _unsupported.cache_clear)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Precomputed views of one (layout, parts): per field its torch dtype, the
  shape and strides of one part, and the element offset of part 0."""

  dtypes: tuple  # distinct torch dtypes of the fields
  views: tuple   # (dtype index, shape, strides, start, elements per part) per field
  info: dict     # the views of the info columns, by TorchInfo field name


@functools.lru_cache(maxsize=256)
def _plan(lay: PackedLayout, parts: int) -> _Plan:
  dtypes, views = [], []
  b = lay.batch_size // parts
  for f in lay.fields[:-1]:
    td = torch_dtype(f.dtype)
    if td not in dtypes:
      dtypes.append(td)
    shape = (b,) + f.shape[1:]
    views.append((dtypes.index(td), shape, dense_strides(shape),
                  f.offset // f.dtype.itemsize, int(np.prod(shape, dtype=np.int64))))
  nd = lay.num_data
  return _Plan(tuple(dtypes), tuple(views), dict(zip(_INFO_FIELDS, views[nd + 1:])))


caches.register("interop.torch.plan", _plan.cache_clear)


def packed_batches(packed: PackedSample, parts: int = 1, *, device=None,
                   on_copy: OnCopy = "warn", non_blocking: bool = False) -> List[TorchBatch]:
  """``parts`` ``TorchBatch`` objects viewing consecutive row ranges of ``packed``.

  Args:
    packed: from ``Table.sample_packed(parts * B)``.
    parts: number of batches to cut the rows into (B = rows / parts each).
    device: torch device; None: the buffer's own (zero copy). Another device
      costs one copy of the whole buffer (pinned and asynchronous with
      ``non_blocking``), not one per field.
    on_copy: "ignore" / "warn" / "raise" if the export itself copied.

  Every tensor is a view of the exported buffer (``data_ptr`` inside it).
  ``weights`` are None; the batches share ``num_eligible``.
  """
  if not isinstance(packed, PackedSample):
    raise TypeError(f"packed_batches expects a funcreplay PackedSample (Table.sample_packed), "
                    f"got {type(packed).__name__}.")
  check_on_copy(on_copy)
  lay = packed.layout
  check_buffer(packed.buffer, lay, "packed_batches")
  rows = lay.batch_size
  if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 or rows % parts:
    raise ValueError(f"packed_batches: parts must be an int >= 1 dividing the {rows} rows, "
                     f"got {parts!r}.")
  why = _unsupported(lay)
  if why is not None:
    raise TypeError(f"packed_batches: {why}; use sample_to_torch(Table.sample(...)).")
  buf = packed.buffer
  if isinstance(buf, (torch.Tensor, np.ndarray)):  # Table.sample_packed(out=...): host memory
    return host_batches(buf, lay, parts, device, non_blocking)
  plan = _plan(lay, parts)
  ne = lay.fields[-1]
  if buf.is_deleted():
    raise ValueError("packed_batches: the buffer has been deleted (donated to a jitted call).")
  buf.block_until_ready()  # async dispatch: XLA must have finished writing it
  raw = torch.from_dlpack(buf)
  ptr = jax_pointer(buf)
  if ptr is not None and ptr != raw.data_ptr():
    handle_copies(TransferReport(1, 0, (("<buffer>", "DLPack export copied the buffer"),)),
                   on_copy, "packed_batches")
  num_eligible = _read_num_eligible(raw, ne) if raw.device.type == "cpu" else None
  return _views(raw, num_eligible, lay, plan, parts, device, non_blocking)


def host_batches(buf, lay: PackedLayout, parts: int, device,
                 non_blocking: bool) -> List[TorchBatch]:
  """``packed_batches`` of a host buffer already checked against ``lay`` (a numpy array or
  CPU torch tensor, ``uint8[lay.nbytes]``, C-contiguous; ``parts`` divides the rows)."""
  if isinstance(buf, torch.Tensor):
    raw, host = buf, buf.numpy()
  else:
    raw, host = torch.from_numpy(buf), buf
  ne = lay.fields[-1].offset
  num_eligible = int(host[ne:ne + 4].view(np.int32)[0])
  return _views(raw, num_eligible, lay, _plan(lay, parts), parts, device, non_blocking)


def _read_num_eligible(t: torch.Tensor, ne) -> int:
  """The int32 at field ``ne``'s offset (a device->host copy for GPU tensors)."""
  return int(t[ne.offset:ne.offset + 4].view(torch.int32)[0])


def _views(raw: torch.Tensor, num_eligible: Optional[int], lay: PackedLayout, plan: _Plan,
           parts: int, device, non_blocking: bool) -> List[TorchBatch]:
  """The ``TorchBatch`` views of a packed buffer ``raw`` (moved to ``device`` first).
  ``num_eligible`` None: read from the buffer (a GPU buffer: after the move)."""
  exported = raw
  dev = as_device(device)
  if dev is not None and not same_device(raw, dev):
    raw = move(raw, dev, non_blocking)
  if num_eligible is None:  # a GPU buffer: from its host copy once complete, else from it
    done = raw.device.type == "cpu" and not non_blocking
    num_eligible = _read_num_eligible(raw if done else exported, lay.fields[-1])
  typed = _typed(raw, plan.dtypes)
  nd = lay.num_data
  eager = plan.views[:nd + 1]  # the data leaves and valid; the info columns are lazy
  if parts == 1:
    per_part = [[_at(typed[d], shape, strides, start)
                 for d, shape, strides, start, _ in eager]]
  else:  # one [parts, B, ...] view per field, unbound into the parts
    per_part = zip(*(_at(typed[d], (parts,) + shape, (n,) + strides, start).unbind(0)
                     for d, shape, strides, start, n in eager))
  out = []
  for i, arrays in enumerate(per_part):
    info = TorchInfo.lazy(functools.partial(_info_view, typed, plan.info, i))
    out.append(TorchBatch(jax.tree_util.tree_unflatten(lay.treedef, arrays[:nd]), arrays[nd],
                          info, None, num_eligible))
  return out


def _info_view(typed: List[torch.Tensor], info: dict, part: int, name: str) -> torch.Tensor:
  """Info column ``name`` of batch ``part``: a view of the typed buffer."""
  d, shape, strides, start, n = info[name]
  return _at(typed[d], shape, strides, start + part * n)


def _typed(raw: torch.Tensor, dtypes) -> List[torch.Tensor]:
  """``raw`` (uint8[N]) viewed as each of ``dtypes``. ``raw`` may start inside a larger
  storage (``sample_packed(out=big[n:])``); a view as a wider type needs that start to be
  a multiple of the type's size."""
  start = raw.storage_offset()
  for td in dtypes:
    if start % td.itemsize:
      raise ValueError(
          f"packed_batches: the buffer starts {start} bytes into its tensor's storage, not a "
          f"multiple of {td.itemsize} ({td}), so its fields cannot be viewed as tensors. "
          f"Pass a buffer that starts at a multiple of {packing.ALIGN} bytes (a slice of a "
          f"larger one at a multiple of the packed size is), or unpack it with numpy.")
  return [raw.view(td) for td in dtypes]


def _at(typed: torch.Tensor, shape, strides, start: int) -> torch.Tensor:
  """The view of ``typed`` at element ``start`` of the buffer it views. ``as_strided``'s
  offset counts from its storage's first element, not the tensor's: a buffer sliced out
  of a larger one starts ``storage_offset()`` elements in."""
  return typed.as_strided(shape, strides, typed.storage_offset() + start)


def packed_to_torch(packed: PackedSample, *, device=None, beta: Optional[float] = None,
                    on_copy: OnCopy = "warn", non_blocking: bool = False) -> TorchBatch:
  """A ``TorchBatch`` viewing a ``PackedSample`` (one DLPack export; see ``packed_batches``).

  ``beta``: importance-weight exponent; None: ``weights`` is None.
  """
  (batch,) = packed_batches(packed, 1, device=device, on_copy=on_copy,
                            non_blocking=non_blocking)
  if beta is not None:
    batch = dataclasses.replace(
        batch, weights=importance_weights(batch.info.probability, batch.valid,
                                          batch.num_eligible, beta))
  return batch
