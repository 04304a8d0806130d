"""DLPack conversion between JAX arrays and torch tensors, with every copy detected.

``to_torch`` / ``from_torch`` share memory where the layout allows and record
each leaf that had to be copied, and why, in a ``TransferReport`` (pointer
comparison: ``unsafe_buffer_pointer()`` vs ``data_ptr()``). See the package
docstring (``funcreplay.torch``) for the pitfalls handled.
"""

from __future__ import annotations

import dataclasses  # noqa: F401
import warnings
from typing import Any, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from funcreplay.core.state import TableState
from funcreplay.host.rollout.batch import RaggedBatch

OnCopy = str  # "ignore" | "warn" | "raise"
_ON_COPY = ("ignore", "warn", "raise")
_X64_NARROW = {torch.int64: torch.int32, torch.uint64: torch.uint32,
               torch.float64: torch.float32, torch.complex128: torch.complex64}


class TorchRaggedBatch(RaggedBatch):
  """A ``RaggedBatch`` of torch tensors: what a ragged leaf becomes in torch (``to_torch``,
  ``TorchSampler``). ``mask`` and ``rows`` are tensors on the values' device (the
  numpy ``RaggedBatch``'s would be numpy arrays, and fail for a GPU tensor)."""

  __slots__ = ()

  @property
  def mask(self) -> torch.Tensor:
    """bool[B, max_len]: True on the real values of a padded batch."""
    if self.packed:
      raise ValueError("RaggedBatch.mask: a packed batch has no padding; use offsets.")
    at = torch.arange(self.values.shape[1], device=self.values.device)
    return at[None, :] < self.lengths.to(self.values.device)[:, None]

  def rows(self) -> list:
    """The rows as a list of 1-D tensors (views of packed values; copies for padded ones)."""
    if self.packed:
      bounds = self.offsets.tolist()
      return [self.values[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return [v[:n].clone() for v, n in zip(self.values, self.lengths.tolist())]


def _torch_ragged(tree):
  """``tree`` with each ``RaggedBatch`` (of tensors) as a ``TorchRaggedBatch``."""
  is_ragged = lambda x: isinstance(x, RaggedBatch)  # noqa: E731
  return jax.tree_util.tree_map(lambda x: TorchRaggedBatch(*x) if is_ragged(x) else x, tree,
                                is_leaf=is_ragged)


class BridgeCopyWarning(UserWarning):
  """A conversion promised zero copy but had to copy (see ``TransferReport.copies``)."""


@dataclasses.dataclass(frozen=True)
class TransferReport:
  """What one ``to_torch`` / ``from_torch`` call did.

  Attributes:
    leaves: number of array leaves converted.
    zero_copy: how many of them share memory with their source (pointer-checked).
    copies: ``(leaf path, reason)`` for every leaf that was copied.
  """

  leaves: int
  zero_copy: int
  copies: Tuple[Tuple[str, str], ...]

  @property
  def all_zero_copy(self) -> bool:
    return not self.copies

  def describe(self) -> str:
    return "; ".join(f"{p or '<root>'}: {why}" for p, why in self.copies)


def check_on_copy(on_copy: str) -> None:
  if on_copy not in _ON_COPY:
    raise ValueError(f"on_copy must be one of {_ON_COPY}, got {on_copy!r}.")


def handle_copies(report: TransferReport, on_copy: str, what: str) -> None:
  if report.copies and on_copy != "ignore":
    msg = (f"{what}: {len(report.copies)} of {report.leaves} leaves were copied instead of "
           f"shared: {report.describe()}.")
    if on_copy == "raise":
      raise ValueError(msg + " Pass on_copy='warn' or 'ignore' to allow copies.")
    warnings.warn(msg, BridgeCopyWarning, stacklevel=3)


def _is_state(x) -> bool:
  return isinstance(x, TableState)


def as_device(device) -> Optional[torch.device]:
  return None if device is None else torch.device(device)


def same_device(t: torch.Tensor, device: Optional[torch.device]) -> bool:
  if device is None or t.device.type != device.type:
    return device is None
  return device.index is None or t.device.index == device.index


def move(t: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
  """Copy ``t`` to ``device``; host->GPU goes through pinned memory when non_blocking."""
  if non_blocking and t.device.type == "cpu" and device.type == "cuda":
    t = t.pin_memory()
  return t.to(device, non_blocking=non_blocking)


def jax_pointer(x: jax.Array) -> Optional[int]:
  try:
    return x.unsafe_buffer_pointer()
  except Exception:  # noqa: BLE001 (multi-device or exotic platforms: no single pointer)
    return None


# --- JAX -> torch ------------------------------------------------------------------

class _Paths:
  """Leaf paths of a tree for messages, computed on first use (slow; never on the hot path)."""

  def __init__(self, tree):
    self._tree, self._paths = tree, None

  def __getitem__(self, i: int) -> str:
    if self._paths is None:
      self._paths = [jax.tree_util.keystr(kp)
                     for kp, _ in jax.tree_util.tree_flatten_with_path(self._tree)[0]]
    return self._paths[i]


def _jax_leaf_to_torch(x: jax.Array, i: int, paths: _Paths,
                       copies: list) -> Tuple[torch.Tensor, bool]:
  sharding = x.sharding
  if not isinstance(sharding, jax.sharding.SingleDeviceSharding) \
      and len(sharding.device_set) != 1:
    raise ValueError(f"to_torch: leaf {paths[i] or '<root>'} is sharded over "
                     f"{len(sharding.device_set)} devices; DLPack exports single-device arrays. "
                     "Gather it first (jax.device_get or a single-device device_put).")
  try:
    t = torch.from_dlpack(x)
  except (RuntimeError, TypeError, BufferError) as e:
    if x.dtype != jnp.bool_:
      raise TypeError(f"to_torch: leaf {paths[i] or '<root>'} ({x.dtype}{list(x.shape)}) cannot "
                      "cross "
                      f"DLPack: {e}") from None
    # Older torch/JAX pairs do not exchange bool: send bytes, view them back as bool.
    t = torch.from_dlpack(x.astype(jnp.uint8)).view(torch.bool)
    copies.append((i, "bool sent as uint8 (this torch/JAX pair cannot share bool)"))
    return t, False
  if x.size == 0:
    return t, True
  ptr = jax_pointer(x)
  if ptr is not None and ptr != t.data_ptr():
    copies.append((i, "DLPack export copied the buffer"))
    return t, False
  return t, True


def _report(n: int, shared: int, copies: list, paths: _Paths) -> TransferReport:
  return TransferReport(n, shared, tuple((paths[i], why) for i, why in copies))


def to_torch_with_report(tree: Any, *, device=None,
                         non_blocking: bool = False,
                         _no_state: bool = False) -> Tuple[Any, TransferReport]:
  """``to_torch`` that also returns the ``TransferReport`` (never warns)."""
  if not _no_state and any(_is_state(x) for x in
                            jax.tree_util.tree_leaves(tree, is_leaf=_is_state)):
    raise TypeError("to_torch: refusing to export a TableState: the table donates (reuses) "
                    "those buffers on its next mutation. Export a Sample (Table.sample returns "
                    "fresh arrays) or a copy (Table.snapshot()).")
  dev = as_device(device)
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  paths = _Paths(tree)
  arrays = [x for x in leaves if isinstance(x, jax.Array)]
  if any(x.is_deleted() for x in arrays):
    i = next(i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.is_deleted())
    raise ValueError(f"to_torch: leaf {paths[i] or '<root>'} has been deleted (donated to a "
                     "jitted call). Export only fresh outputs (e.g. of Table.sample), never the "
                     "table's state.")
  # Async dispatch: wait until XLA has finished writing every exported buffer.
  jax.block_until_ready(arrays)
  out, copies, shared = [], [], 0
  for i, x in enumerate(leaves):
    if isinstance(x, torch.Tensor):
      t, ok = x, True
    elif isinstance(x, jax.Array):
      t, ok = _jax_leaf_to_torch(x, i, paths, copies)
    elif (isinstance(x, np.ndarray) or np.isscalar(x)) and np.asarray(x).dtype.kind in "biufc":
      a = np.asarray(x)
      try:
        t, ok = torch.from_numpy(a), True
      except (TypeError, ValueError, RuntimeError):  # negative strides, byte order, object
        t, ok = torch.as_tensor(np.ascontiguousarray(a, a.dtype.newbyteorder("="))), False
        copies.append((i, "numpy array with negative strides or non-native byte order"))
      if ok and not isinstance(x, np.ndarray):
        copies.append((i, f"Python scalar {type(x).__name__}"))
        ok = False
    else:
      raise TypeError(f"to_torch: leaf {paths[i] or '<root>'} is a {type(x).__name__}; expected "
                      "JAX / numpy arrays (bool or numeric), torch tensors or numbers.")
    if dev is not None and not same_device(t, dev):
      copies.append((i, f"device transfer {t.device} -> {dev}"))
      t, ok = move(t, dev, non_blocking), False
    out.append(t)
    shared += ok
  return (_torch_ragged(jax.tree_util.tree_unflatten(treedef, out)),
          _report(len(leaves), shared, copies, paths))


def to_torch(tree: Any, *, device=None, on_copy: OnCopy = "warn",
             non_blocking: bool = False) -> Any:
  """Convert a pytree of JAX (or numpy) arrays to torch tensors, zero copy where possible.

  Args:
    tree: pytree whose leaves are ``jax.Array`` (single device), numpy arrays,
      numbers or torch tensors (passed through). Never a ``TableState``.
    device: target torch device; None keeps each array where it is (JAX CPU
      -> torch CPU, JAX GPU k -> torch cuda:k, zero copy). A different device
      is a (reported) copy.
    on_copy: what to do when a leaf had to be copied: "ignore", "warn"
      (``BridgeCopyWarning``) or "raise" (``ValueError``). Device transfers
      asked for through ``device`` count as copies.
    non_blocking: asynchronous host->GPU copies through pinned memory.

  Returns:
    The same tree structure with ``torch.Tensor`` leaves of the same shapes and
    dtypes (bool stays bool). The tensors share memory with the JAX arrays:
    writing into them in place writes into those arrays.
  """
  check_on_copy(on_copy)
  out, report = to_torch_with_report(tree, device=device, non_blocking=non_blocking)
  handle_copies(report, on_copy, "to_torch")
  return out


# --- torch -> JAX ------------------------------------------------------------------

def dense_strides(shape: Sequence[int]) -> Tuple[int, ...]:
  strides, acc = [], 1
  for n in reversed(shape):
    strides.append(acc)
    acc *= max(n, 1)
  return tuple(reversed(strides))


def _is_dense(t: torch.Tensor) -> bool:
  """True when ``t`` covers its storage without gaps or overlaps, in any dimension order."""
  if t.numel() == 0:
    return True
  dims = sorted(((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1), reverse=True)
  acc = 1
  for s, n in reversed(dims):
    if s != acc:
      return False
    acc *= n
  return True


def _prepare_tensor(t: torch.Tensor, path: str, copies: list, sync: bool) -> torch.Tensor:
  if t.requires_grad:
    t = t.detach()  # DLPack cannot export autograd tensors; detach shares memory.
  if t.is_conj() or t.is_neg():
    t = t.resolve_conj().resolve_neg()
    copies.append((path, "conjugate/negative bit resolved"))
  narrow = None if jax.config.jax_enable_x64 else _X64_NARROW.get(t.dtype)
  if narrow is not None:
    where = f"from_torch: leaf {path or '<root>'} ({t.dtype})"
    fix = "(JAX runs with jax_enable_x64=False). Enable x64 or convert the tensor yourself."
    if not t.dtype.is_floating_point and not t.dtype.is_complex and t.numel():
      info = torch.iinfo(narrow)
      # torch has no min / max of uint64: compared as int64, where values of 2**63 and
      # more are negative (outside uint32 all the same).
      v = t.view(torch.int64) if t.dtype == torch.uint64 else t
      lo, hi = int(v.min()), int(v.max())
      if lo < info.min or hi > info.max:
        held = ("values of 2**63 or more" if t.dtype == torch.uint64 and lo < 0
                else f"values in [{lo}, {hi}]")
        raise ValueError(f"{where} holds {held}, outside {narrow} {fix}")
    elif t.numel():
      # Rounding to float32 is the narrowing; a finite value beyond float32's range would
      # become inf, which is not.
      a = torch.view_as_real(t) if t.dtype.is_complex else t
      big = a.isfinite() & (a.abs() > torch.finfo(torch.float32).max)
      if bool(big.any()):
        raise ValueError(f"{where} holds finite values beyond float32's range (largest "
                         f"magnitude {float(a[big].abs().max()):.3g}), which would become "
                         f"inf {fix}")
    copies.append((path, f"{t.dtype} narrowed to {narrow} (jax_enable_x64=False)"))
    t = t.to(narrow)
  if not _is_dense(t):
    copies.append((path, f"non-dense strides {tuple(t.stride())} for shape {tuple(t.shape)} "
                         "(made contiguous)"))
    t = t.contiguous()
  elif t.is_contiguous() and t.numel() and t.stride() != dense_strides(t.shape):
    # Size-1 dimensions may carry any stride; some DLPack importers reject them.
    t = t.as_strided(t.shape, dense_strides(t.shape))
  if sync and t.is_cuda:
    # Explicit ordering: torch's pending kernels on this stream finish first.
    torch.cuda.current_stream(t.device).synchronize()
  return t


def _torch_leaf_to_jax(t: torch.Tensor, path: str, copies: list, sync: bool,
                       device) -> Tuple[jax.Array, bool]:
  n_before = len(copies)
  t = _prepare_tensor(t, path, copies, sync)
  try:
    x = jnp.from_dlpack(t)
  except Exception as e:  # noqa: BLE001 (re-raised with context, or bool fallback)
    if t.dtype != torch.bool:
      raise TypeError(f"from_torch: leaf {path or '<root>'} ({t.dtype}{list(t.shape)}) cannot "
                      f"cross DLPack: {e}") from None
    x = jnp.from_dlpack(t.view(torch.uint8)).astype(jnp.bool_)
    copies.append((path, "bool sent as uint8 (this torch/JAX pair cannot share bool)"))
  ok = len(copies) == n_before
  if ok and t.numel():
    ptr = jax_pointer(x)
    if ptr is not None and ptr != t.data_ptr():
      ok = False
      align = t.data_ptr() % 64
      why = (f"unaligned buffer (data_ptr % 64 == {align}); JAX copied it" if align
             else "JAX copied the buffer on import")
      copies.append((path, why))
  if device is not None and x.devices() != {device}:
    x = jax.device_put(x, device)
    copies.append((path, f"device transfer to {device}"))
    ok = False
  return x, ok


def from_torch_with_report(tree: Any, *, device=None, copy: bool = False,
                           sync: bool = True) -> Tuple[Any, TransferReport]:
  """``from_torch`` that also returns the ``TransferReport`` (never warns)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  out, copies, shared = [], [], 0
  for kp, t in leaves:
    path = jax.tree_util.keystr(kp)
    if isinstance(t, torch.Tensor):
      x, ok = _torch_leaf_to_jax(t, path, copies, sync, device)
      if copy and ok:
        x, ok = jnp.array(x, copy=True), False  # asked for: not reported as a surprise
    elif isinstance(t, (jax.Array, np.ndarray)) or np.isscalar(t):
      x, ok = (jax.device_put(t, device) if device is not None else jnp.asarray(t)), False
    else:
      raise TypeError(f"from_torch: leaf {path or '<root>'} is a {type(t).__name__}; expected "
                      "torch tensors, numpy / JAX arrays or numbers.")
    out.append(x)
    shared += ok
  report = TransferReport(len(leaves), shared, tuple(copies))
  return jax.tree_util.tree_unflatten(treedef, out), report


def from_torch(tree: Any, *, device=None, copy: bool = False, on_copy: OnCopy = "warn",
               sync: bool = True) -> Any:
  """Convert a pytree of torch tensors to JAX arrays, zero copy where possible.

  Args:
    tree: pytree of ``torch.Tensor`` leaves (``requires_grad`` is fine: they
      are detached); numpy / JAX arrays and numbers are converted with
      ``jnp.asarray``.
    device: a ``jax.Device`` to put the arrays on (None: the tensor's own
      device, zero copy).
    copy: return JAX-owned copies instead of views of torch memory (use it
      when torch will keep writing into the tensors, e.g. parameters).
    on_copy: "ignore", "warn" or "raise" when a leaf could not be shared
      (unaligned buffer, non-dense strides, 64-bit narrowing, device move).
    sync: synchronise CUDA tensors' current stream before JAX reads them.

  Returns:
    The same tree with ``jax.Array`` leaves (same shapes; dtypes the same,
    except 64-bit dtypes narrowed to 32 bits when ``jax_enable_x64`` is off).
  """
  check_on_copy(on_copy)
  out, report = from_torch_with_report(tree, device=device, copy=copy, sync=sync)
  handle_copies(report, on_copy, "from_torch")
  return out
