"""What the host hands out for rollout tables: ``RaggedBatch`` and ``HostSample``,
and the check of ragged values given to an insert."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import jax
import numpy as np

from funcreplay.core.columns import Ragged
from funcreplay.core.state import Sample

RAGGED_FORMATS = ("padded", "packed")


class RaggedBatch(NamedTuple):
  """A batch of ``B`` variable-length rows of one ``Ragged`` leaf (numpy arrays).

  Attributes:
    values: ``[B, max_len]`` zero-padded (``"padded"``) or ``[sum_len]`` concatenated
      (``"packed"``, what varlen attention kernels take).
    lengths: int32[B] (0 for invalid rows).
    offsets: int64[B + 1]: row ``i`` of the packed values is ``values[offsets[i]:
      offsets[i + 1]]`` (also given for padded batches).
  """

  values: Any
  lengths: Any
  offsets: Any

  @property
  def packed(self) -> bool:
    return np.ndim(self.values) == 1

  @property
  def mask(self):
    """bool[B, max_len]: True on the real values of a padded batch."""
    if self.packed:
      raise ValueError("RaggedBatch.mask: a packed batch has no padding; use offsets.")
    return np.arange(np.shape(self.values)[1])[None, :] < np.asarray(self.lengths)[:, None]

  def rows(self):
    """The rows as a list of 1-D arrays (copies for padded batches)."""
    if self.packed:
      return [self.values[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]
    return [np.array(v[:n]) for v, n in zip(self.values, self.lengths)]

  @classmethod
  def build(cls, values, lengths, offsets, max_len: int, fmt: str) -> "RaggedBatch":
    if fmt == "packed":
      return cls(values, lengths, offsets)
    out = np.zeros((lengths.shape[0], max_len), values.dtype)
    out[np.arange(max_len)[None, :] < lengths[:, None]] = values
    return cls(out, lengths, offsets)


def check_format(ragged: str, what: str) -> str:
  if ragged not in RAGGED_FORMATS:
    raise ValueError(f"{what}: ragged must be one of {RAGGED_FORMATS}, got {ragged!r}.")
  return ragged


def ragged_rows(r: Ragged, x, b: Optional[int], name: str, what: str):
  """``(flat values [sum_len], lengths int32[B])`` of a batch of ragged values ``x``:
  a list of 1-D arrays, ``(padded [B, L], lengths [B])`` or a ``RaggedBatch``."""
  if isinstance(x, RaggedBatch) and x.packed:
    flat, lengths = np.asarray(x.values), np.asarray(x.lengths)
    # As the (padded, lengths) form: int lengths of one axis, none negative (a negative
    # one made overlapping spans in the arena, a float one was truncated).
    if flat.ndim != 1 or lengths.ndim != 1 or lengths.dtype.kind not in "iu":
      raise ValueError(f"{what}: ragged leaf {name} as a packed RaggedBatch needs values "
                       f"[N] and int lengths [B], got {flat.dtype.name}{list(flat.shape)} "
                       f"and {lengths.dtype.name}{list(lengths.shape)}.")
    if lengths.size and lengths.min() < 0:
      raise ValueError(f"{what}: ragged leaf {name}: a packed RaggedBatch's lengths must be "
                       f">= 0, got {int(lengths.min())}.")
    if lengths.sum() != flat.shape[0]:
      raise ValueError(f"{what}: ragged leaf {name}: a packed RaggedBatch's lengths sum to "
                       f"{int(lengths.sum())}, its values hold {flat.shape[0]}.")
  elif isinstance(x, RaggedBatch) or (type(x) is tuple and len(x) == 2
                                      and hasattr(x[0], "shape")):
    padded, lengths = np.asarray(x[0]), np.asarray(x[1])
    if padded.ndim != 2 or lengths.shape != (padded.shape[0],) or lengths.dtype.kind not in "iu":
      raise ValueError(f"{what}: ragged leaf {name} as (padded, lengths) needs padded [B, L] "
                       f"and int lengths [B], got {padded.dtype.name}{list(padded.shape)} and "
                       f"{lengths.dtype.name}{list(lengths.shape)}.")
    if lengths.size and (lengths.min() < 0 or lengths.max() > padded.shape[1]):
      raise ValueError(f"{what}: ragged leaf {name}: lengths must lie in [0, "
                       f"{padded.shape[1]}] (the padded width).")
    _dtype_ok(r, padded.dtype, name, what)
    flat = padded[np.arange(padded.shape[1])[None, :] < lengths[:, None]]
  elif isinstance(x, list):
    rows = []
    for i, v in enumerate(x):
      a = np.asarray(v)
      if a.ndim != 1:
        raise ValueError(f"{what}: ragged leaf {name} row {i}: expected a 1-D array, got "
                         f"shape {list(a.shape)}.")
      if a.size:
        _dtype_ok(r, a.dtype, name, what, row=i)
      rows.append(a)
    lengths = np.asarray([a.shape[0] for a in rows], np.int64)
    flat = (np.concatenate(rows).astype(r.dtype, copy=False) if rows and lengths.sum()
            else np.zeros((0,), r.dtype))
  else:
    raise TypeError(f"{what}: ragged leaf {name} takes a list of 1-D arrays, (padded [B, L], "
                    f"lengths [B]) or a fr.RaggedBatch, got {type(x).__name__}.")
  lengths = np.asarray(lengths)
  if b is not None and lengths.shape[0] != b:
    raise ValueError(f"{what}: ragged leaf {name} has {lengths.shape[0]} rows, the batch {b}.")
  if lengths.size and lengths.max() > r.max_len:
    i = int(np.argmax(lengths))
    raise ValueError(f"{what}: ragged leaf {name} row {i} has {int(lengths[i])} values, over "
                     f"max_len={r.max_len}. Truncate it or raise max_len.")
  _dtype_ok(r, np.asarray(flat).dtype, name, what)
  return np.ascontiguousarray(flat, r.dtype), lengths.astype(np.int32)


def _dtype_ok(r: Ragged, got, name, what, row=None):
  if np.dtype(got) != r.dtype:
    where = "" if row is None else f" row {row}"
    raise TypeError(f"{what}: ragged leaf {name}{where}: expected dtype {r.dtype.name}, got "
                    f"{np.dtype(got).name}. Cast it (e.g. x.astype(np.{r.dtype.name})).")


@dataclasses.dataclass(frozen=True)
class HostSample(Sample):
  """A ``Sample`` from a host ``Table`` with host-side extras (an ``fr.Sample`` too).

  Attributes (besides ``Sample``'s):
    payload: a tuple with the payload of each row (None for invalid rows or items
      without one); None when the table keeps no payloads.
    metadata: dict column -> numpy array [B] of the rows' values (strings for a
      vocabulary column, float32 for a float column); None when not read.
  Ragged leaves of ``data`` are ``RaggedBatch`` values.
  """

  payload: Optional[tuple] = None
  metadata: Optional[dict] = None


class _Opaque:
  """Host extras as pytree aux data: compared by identity (payloads need not be hashable)."""

  __slots__ = ("value",)

  def __init__(self, value):
    self.value = value

  def __hash__(self):
    return id(self.value)

  def __eq__(self, other):
    return isinstance(other, _Opaque) and other.value is self.value


jax.tree_util.register_pytree_node(
    HostSample,
    lambda s: ((s.data, s.valid, s.info, s.num_eligible), (_Opaque(s.payload),
                                                           _Opaque(s.metadata))),
    lambda aux, ch: HostSample(*ch, payload=aux[0].value, metadata=aux[1].value))
