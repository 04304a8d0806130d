"""Sampled batches as torch tensors (``TorchBatch``) and priority write-back from torch."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import jax
import numpy as np
import torch

from funcreplay.core import numerics
from funcreplay.core.state import Sample
from funcreplay.interop.torch.dlpack import (
    OnCopy,
    handle_copies,
    move,
    same_device,
    to_torch_with_report,
)

# --- batches for a torch learner ---------------------------------------------------

@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["slot", "key", "probability", "priority", "times_sampled",
                                "version"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class TorchInfo:
  """Per-row metadata of a ``TorchBatch`` (B rows; invalid rows hold slot -1).

  Attributes:
    slot: int32[B]. key: uint32[B] (pass both back to ``update_priorities``).
    probability: float32[B] single-draw probability. priority: float32[B].
    times_sampled: int32[B]. version: int32[B] policy version of each item.
  """

  slot: torch.Tensor
  key: torch.Tensor
  probability: torch.Tensor
  priority: torch.Tensor
  times_sampled: torch.Tensor
  version: torch.Tensor

  @classmethod
  def lazy(cls, make: Callable[[str], torch.Tensor]) -> "TorchInfo":
    """An info whose fields are built by ``make(name)`` when first read.

    A packed batch's info columns are views of its buffer, ~1.2 us of torch
    dispatch each; a learner that never writes priorities back reads none of
    them, so they are made on demand (one batch costs ~50 us in all). Reading
    a field, flattening the info as a pytree, ``dataclasses.replace``, copying
    or pickling build them; the result is then an ordinary ``TorchInfo``.
    """
    info = object.__new__(cls)
    object.__setattr__(info, "_make", make)
    return info

  def __getattr__(self, name: str):
    # Only reached for attributes not set yet, i.e. the fields of a lazy info.
    make = self.__dict__.get("_make")
    if make is None or name not in _INFO_NAMES:
      raise AttributeError(f"'TorchInfo' object has no attribute {name!r}")
    value = make(name)
    object.__setattr__(self, name, value)  # concurrent first reads build equal views
    return value

  def __copy__(self) -> "TorchInfo":
    return TorchInfo(**{name: getattr(self, name) for name in _INFO_ORDER})

  def __getstate__(self) -> dict:
    # Pickling (torch.save, deepcopy) stores copies: the columns of a packed
    # batch view one buffer as several dtypes, which torch refuses to save.
    return {name: _own(getattr(self, name)) for name in _INFO_ORDER}


_INFO_ORDER = tuple(f.name for f in dataclasses.fields(TorchInfo))
_INFO_NAMES = frozenset(_INFO_ORDER)


def _own(x):
  """A tensor with memory of its own (a copy); anything else as it is."""
  return x.clone() if isinstance(x, torch.Tensor) else x


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["data", "valid", "info", "weights"],
                   meta_fields=["num_eligible"])
@dataclasses.dataclass(frozen=True)
class TorchBatch:
  """A sampled batch as torch tensors (a JAX pytree: ``jax.tree_util.tree_map`` works on it).

  Attributes:
    data: the item pytree (dicts, tuples, ...) of tensors with leading [B].
    valid: bool[B]; rows with False are padding (zeros) and must be ignored.
    info: ``TorchInfo`` for priority write-back and staleness checks.
    weights: float32[B] PER importance weights ``(N P(i))**-beta / max``
      (0 on invalid rows), or None when no ``beta`` was given.
    num_eligible: N, the number of eligible items when sampled.

  The tensors of a sampled batch are views of one buffer (zero copy), so
  ``torch.save(batch.data)`` refuses them ("view the same data as different
  types"): save ``batch.clone().data``, or the batch itself (``torch.save``
  and ``copy.deepcopy`` of a ``TorchBatch`` or ``TorchInfo`` store copies;
  load it with ``torch.load(..., weights_only=False)``).
  """

  data: Any
  valid: torch.Tensor
  info: TorchInfo
  weights: Optional[torch.Tensor]
  num_eligible: int

  def _map(self, fn) -> "TorchBatch":
    return jax.tree_util.tree_map(fn, self)

  def to(self, device, non_blocking: bool = False) -> "TorchBatch":
    """Every tensor moved to ``device``."""
    dev = torch.device(device)
    return self._map(lambda t: t if same_device(t, dev) else move(t, dev, non_blocking))

  def clone(self) -> "TorchBatch":
    """A copy whose tensors have memory of their own (e.g. to ``torch.save`` its fields)."""
    return self._map(torch.Tensor.clone)

  def __copy__(self) -> "TorchBatch":
    return dataclasses.replace(self)

  def __getstate__(self) -> dict:
    return {f.name: _own(getattr(self, f.name)) if f.name != "data" else
            jax.tree_util.tree_map(_own, self.data) for f in dataclasses.fields(self)}

  def pin_memory(self) -> "TorchBatch":
    """Pinned copies (``torch.utils.data.DataLoader(pin_memory=True)`` calls this)."""
    return self._map(lambda t: t.pin_memory())

  def __len__(self) -> int:
    return int(self.valid.shape[0])


def beta_at(beta, index: int, who: str, after: str = "") -> Optional[float]:
  """The importance-weight exponent of batch ``index``: ``beta`` itself, or the value of a
  schedule (a callable of the index), checked to be a finite number >= 0."""
  if not callable(beta):
    return beta
  b = beta(index)
  try:
    ok = b is not None and not isinstance(b, bool) and math.isfinite(b) and b >= 0
  except TypeError:
    ok = False
  if not ok:
    raise ValueError(f"{who}: beta({index}) returned {b!r}; the importance-weight exponent "
                     f"must be a finite number >= 0. Fix the beta schedule{after}.")
  return float(b)


def importance_weights(probability: torch.Tensor, valid: torch.Tensor, num_eligible: int,
             beta: float) -> torch.Tensor:
  """float32[B] ``(N * P(i))**-beta`` normalised by the batch max; 0 on invalid rows."""
  p = torch.where(valid, probability, torch.ones_like(probability)).clamp_min(numerics.TINY)
  w = torch.pow(p * float(max(num_eligible, 1)), -float(beta))
  w = torch.where(valid, w, torch.zeros_like(w))
  return w / w.max().clamp_min(numerics.TINY)


def sample_to_torch(sample: Sample, *, device=None, beta: Optional[float] = None,
                    on_copy: OnCopy = "warn", non_blocking: bool = False) -> TorchBatch:
  """A ``TorchBatch`` from a ``fr.Sample`` (zero copy on the sample's device).

  Args:
    sample: e.g. ``Table.sample(B)``.
    device: torch device (None: the sample's device).
    beta: importance-weight exponent; None: ``weights`` is None.
  """
  if not isinstance(sample, Sample):
    raise TypeError(f"sample_to_torch expects a funcreplay Sample, got {type(sample).__name__}.")
  tree = (sample.data, sample.valid, sample.info)
  # A Sample's leaves are fresh outputs of the sampling call: no TableState inside.
  (data, valid, info), report = to_torch_with_report(tree, device=device,
                                                     non_blocking=non_blocking, _no_state=True)
  # Device transfers were asked for; any other copy is a surprise worth reporting.
  surprises = tuple(c for c in report.copies if not c[1].startswith("device transfer"))
  handle_copies(dataclasses.replace(report, copies=surprises), on_copy, "sample_to_torch")
  info = TorchInfo(**{f.name: getattr(info, f.name) for f in dataclasses.fields(TorchInfo)})
  n = int(sample.num_eligible)
  w = None if beta is None else importance_weights(info.probability, valid, n, beta)
  return TorchBatch(data, valid, info, w, n)


# --- priority write-back -------------------------------------------------------------

def priorities_to_numpy(x, what: str = "priorities") -> np.ndarray:
  """A host numpy array from a torch tensor (detached; GPU -> host; bf16/f16 -> f32).

  Also accepts numpy / JAX arrays and numbers.
  """
  if isinstance(x, torch.Tensor):
    t = x.detach()
    if t.device.type != "cpu":
      t = t.cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
      t = t.float()
    return t.resolve_conj().resolve_neg().numpy()
  try:
    return np.asarray(x)
  except Exception as e:  # noqa: BLE001
    raise TypeError(f"{what}: cannot convert {type(x).__name__} to an array ({e}).") from None


def update_priorities(table, info_or_slots, keys=None, priorities=None) -> None:
  """Write priorities computed in torch back into ``table`` (stale keys are ignored).

  Forms::

    update_priorities(table, batch.info, td.abs() + eps)     # info (or batch) + priorities
    update_priorities(table, batch, priorities=p)
    update_priorities(table, slots, keys, priorities)        # explicit columns

  Args:
    table: a ``fr.Table`` (anything with ``update_priorities(slots, keys, p)``).
    info_or_slots: a ``TorchInfo`` / ``TorchBatch`` / ``fr.SampleInfo`` /
      ``fr.Sample``, or int[K] slots.
    keys: uint32/int[K] keys, or the priorities in the info form.
    priorities: float[K] or a scalar; torch tensors may require grad and live
      on any device (detached and copied to the host: B floats).

  Rows whose slot now holds another item (evicted since sampling), and rows
  with slot -1 (invalid rows), are left alone by the table. Priorities must be
  finite and >= 0 on the other rows (``ValueError`` otherwise).
  """
  obj = info_or_slots.info if hasattr(info_or_slots, "info") else info_or_slots
  if hasattr(obj, "slot") and hasattr(obj, "key"):
    if priorities is None:
      priorities, keys = keys, None
    if keys is not None:
      raise TypeError("update_priorities: with an info/batch, pass only the priorities "
                      "(third argument or priorities=).")
    slots, keys = obj.slot, obj.key
  else:
    slots = obj
    if keys is None:
      raise TypeError("update_priorities: keys are required with explicit slots "
                      "(update_priorities(table, slots, keys, priorities)).")
  if priorities is None:
    raise TypeError("update_priorities: priorities are required.")
  table.update_priorities(priorities_to_numpy(slots, "update_priorities slots"),
                          priorities_to_numpy(keys, "update_priorities keys"),
                          priorities_to_numpy(priorities, "update_priorities priorities"))
