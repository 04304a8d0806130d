"""Sampling on the host ``Table``: ``sample``, ``sample_packed`` and the in-place path.

``SamplingMixin`` is a mixin of ``Table`` (``funcreplay.host.table``). A
CPU table on the native kernels can sample straight into a caller's buffer
through its in-place sampler strategy (``funcreplay.host.direct.DirectSampler``,
chosen once per table in ``_direct_sampler``); otherwise the jitted sample
program (``funcreplay.host.programs``) runs.
"""

from __future__ import annotations

import time
from typing import Optional

import jax
import numpy as np

from funcreplay import native as native_lib
from funcreplay.core import indexes, packing
from funcreplay.core import selectors as sel
from funcreplay.core.packing import is_torch_tensor
from funcreplay.core.state import Sample
from funcreplay.host import direct as direct_lib
from funcreplay.host.rollout.batch import HostSample, check_format
from funcreplay.host.rollout.mixin import sidecar_rows
from funcreplay.host.validation import I32, Where
from funcreplay.host.validation import check_int as _check_int
from funcreplay.host.validation import check_timeout as _check_timeout
from funcreplay.host.validation import describe_limiter as _describe_limiter

MAX_BATCH_SIZE = int(I32.max)  # sample rows are indexed with int32


class SamplingMixin:
  """``Table.sample`` / ``sample_packed`` and the in-place sampler strategy."""

  # -- sample ---------------------------------------------------------------------
  def sample(self, batch_size: int, *, version: Optional[int] = None, where: Where = None,
             timeout: Optional[float] = None, replace: bool = False,
             min_valid: Optional[int] = None, ragged: str = "padded") -> Sample:
    """Sample ``batch_size`` items, waiting until enough are available.

    Args:
      batch_size: B (<= capacity unless ``replace``).
      version: current policy version for the staleness mask and the
        staleness stats (default: ``self.version``).
      where: bool[C] mask over slots, or dict ``{column: int | sequence of
        ints}`` (items whose column equals the int / is in the sequence; all
        columns must match).
      timeout: seconds to wait (None: forever).
      replace: sample with replacement.
      min_valid: wait until at least this many eligible items exist (default
        ``batch_size``; 1 with ``replace=True``). With fewer than B eligible
        items the extra rows have ``valid=False``.
      ragged: on a table with ``Ragged`` leaves or payloads the result is an
        ``fr.HostSample`` whose ragged leaves are ``RaggedBatch`` values,
        ``"padded"`` ([B, max_len] + lengths) or ``"packed"`` ([sum_len] + offsets).

    Blocks while fewer than ``min_valid`` items are eligible (occupied, fresh
    enough, matching ``where``) or while the rate limiter forbids sampling the
    rows this call would return (``min(B, eligible)``; B with replacement).

    One call is one limiter decision for the whole batch (Reverb decides per
    item): ``min_size_to_sample`` and the ``SampleToInsertRatio`` window are
    checked once, before the draw, for all ``n`` rows together (the window
    must admit ``samples + n``), and then all ``n`` rows are sampled. Items
    reaching ``max_times_sampled`` are freed after the batch, so with
    ``max_times_sampled=1`` a batch of ``n`` distinct items leaves ``size -
    n`` items, possibly below ``min_size_to_sample``, where Reverb, sampling
    item by item, would have stopped at the minimum; with ``replace=True``
    an item may appear more often in one batch than its remaining allowance.

    Returns:
      ``fr.Sample`` of fresh JAX arrays: ``data`` (item pytree, leading [B]),
      ``valid`` bool[B], ``info`` (slot int32[B], key uint32[B], probability
      float32[B], priority, times_sampled, version), ``num_eligible`` int32[].
    """
    check_format(ragged, "Table.sample")
    return self._sample("Table.sample", batch_size, version, where, timeout, replace, min_valid,
                        packed=False, ragged=ragged)

  def sample_packed(self, batch_size: int, *, version: Optional[int] = None,
                    where: Where = None, timeout: Optional[float] = None, replace: bool = False,
                    min_valid: Optional[int] = None, out=None) -> packing.PackedSample:
    """``sample``, returning the batch as one contiguous buffer (``fr.PackedSample``).

    Same arguments, semantics and random stream as ``sample`` (a table with
    the same seed and history hands out the same items either way). The
    fields lie in ``uint8[N]`` at the offsets of ``PackedSample.layout``,
    written by the sampling program itself: a consumer outside JAX takes the
    whole batch with one export (``funcreplay.torch`` does, then views each
    field), instead of one per array, which costs ~10 us each on a CPU.
    Items with sub-byte dtypes (int4, ...) cannot be packed (ValueError).

    ``out``: a writable, C-contiguous ``uint8[N]`` numpy array or CPU torch
    tensor (pinned or not; N = ``packing.layout(spec.signature,
    batch_size).nbytes``) to write the batch into; the result's ``buffer`` is
    then ``out`` itself. A CPU table using the
    native kernels writes it in place, without a jitted call (no dispatch,
    no XLA buffer to import: ``funcreplay.host.direct``), when ``where`` is
    None (and the sampler is not prioritized with ``max_staleness``); the
    draw, the state update and the key advance are those of the jitted path.
    Otherwise the jitted sample runs and its buffer is copied into ``out``.
    """
    view = None
    if out is not None:
      view = self._check_out(out, batch_size, "Table.sample_packed")
    return self._sample("Table.sample_packed", batch_size, version, where, timeout, replace,
                        min_valid, packed=True, out=view, out_owner=out)

  def _check_out(self, out, batch_size, what) -> np.ndarray:
    """A numpy view of ``out`` if it is a writable C-contiguous uint8 buffer of the packed
    size (a numpy array, or a CPU torch tensor, which ``numpy()`` views without a copy)."""
    if not isinstance(out, np.ndarray):
      if not is_torch_tensor(out):
        raise TypeError(f"{what}: out must be a numpy array or a CPU torch tensor of uint8, "
                        f"got {type(out).__name__}.")
      if out.device.type != "cpu" or out.requires_grad:
        raise ValueError(f"{what}: a torch out must be a CPU tensor without requires_grad, got "
                         f"one on {out.device} (requires_grad={out.requires_grad}).")
      out = out.numpy()
    why = packing.packable(self.spec.signature)
    if why is not None:
      raise ValueError(f"{what}: cannot pack this table's items: {why}. Use Table.sample.")
    if isinstance(batch_size, (int, np.integer)) and not isinstance(batch_size, (bool, np.bool_)) \
        and batch_size >= 1:
      n = packing.layout(self.spec.signature, int(batch_size)).nbytes
      if out.dtype != np.uint8 or out.shape != (n,):
        raise ValueError(f"{what}: out must be uint8[{n}] for {int(batch_size)} rows of this "
                         f"table, got {out.dtype.name}{list(out.shape)}.")
    if not out.flags.c_contiguous or not out.flags.writeable:
      raise ValueError(f"{what}: out must be C-contiguous and writable.")
    return out

  @property
  def native(self) -> bool:
    """True if this table runs the native CPU kernels' programs (its ``native``
    argument, None resolved by ``FUNCREPLAY_NATIVE``); ``Table(spec, native=t.native)``
    shares them."""
    return self._ops.native

  @property
  def samples_in_place(self) -> bool:
    """True if ``sample_packed(..., out=buf)`` writes the batch straight into ``buf``
    without a jitted call (a CPU table on the native kernels; ``where=None``;
    ``funcreplay.host.direct``). Otherwise ``out`` receives a copy."""
    with self._cond:
      self._check_open("samples_in_place")
      return self._direct_sampler() is not None

  def _direct_sampler(self):
    """The table's ``DirectSampler``, or None where the direct path does not apply."""
    if self._direct is None:
      why = direct_lib.unsupported(self.spec, self._ops.native)
      if why is None and not direct_lib.on_cpu(self._state):
        why = "the table's state is not on the CPU"
      self._direct = False if why is not None else direct_lib.DirectSampler(
          self.spec, native_lib.ledger_attr(self.spec))
    return self._direct or None

  def _settle(self, direct) -> None:
    """Before a direct sample: no XLA program may still write the state (read-only ones
    finished in ``_reading``); the key is numpy. Lock held."""
    direct.bind(self._state)
    if not (isinstance(self._rng, np.ndarray) and self._rng.flags.writeable):
      self._rng = np.array(self._rng, dtype=np.uint32)

  def _reading(self, result):
    """The output of a read-only program on the state, finished before the lock is released
    when this table may sample in place: a direct sample writes the buffers that program
    reads, and only the program's outputs tell when it is done. Lock held."""
    if self._direct_sampler() is not None:
      jax.block_until_ready(result)
    return result

  def _sample(self, what, batch_size, version, where, timeout, replace, min_valid, *, packed,
              out=None, out_owner=None, ragged="padded"):
    self._check_open("sample")
    spec = self.spec
    if packed and self._sidecars is not None:
      raise ValueError(f"{what}: this table keeps ragged values or payloads on the host, which "
                       "a packed buffer cannot carry; use Table.sample.")
    timeout = _check_timeout(timeout)
    if isinstance(batch_size, (bool, np.bool_)) or not isinstance(batch_size, (int, np.integer)) \
        or batch_size < 1:
      raise ValueError(f"{what}: batch_size must be an int >= 1, got {batch_size!r}.")
    batch_size = int(batch_size)
    if batch_size > MAX_BATCH_SIZE:
      raise ValueError(f"{what}: batch_size {batch_size} is too large: rows are indexed with "
                       f"int32, so at most {MAX_BATCH_SIZE} (and, without replace, at most the "
                       f"capacity {spec.capacity}). Sample in smaller batches.")
    replace = bool(replace)
    if not replace and batch_size > spec.capacity:
      raise ValueError(f"{what}: batch_size {batch_size} exceeds the capacity "
                       f"{spec.capacity}; use replace=True or a smaller batch.")
    if replace and sel.is_ordered(spec.sampler):
      raise ValueError(f"{what}: replace=True is not supported by the deterministic "
                       f"{type(spec.sampler).__name__} sampler.")
    if min_valid is None:
      min_valid = 1 if replace else batch_size
    limit = min(batch_size, spec.capacity) if not replace else spec.capacity
    min_valid = _check_int(min_valid, f"{what} min_valid", 0, limit)
    ver_int = _check_int(self._version if version is None else version, f"{what} version")
    mask, cols = self._where(where, what)
    if packed:
      why = packing.packable(spec.signature)
      if why is not None:
        raise ValueError(f"{what}: cannot pack this table's items: {why}. Use Table.sample.")
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cond:
      direct = self._direct_sampler() if out is not None and where is None else None
      while True:
        self._check_open("sample")
        if version is None:
          # The table's version now: a ``set_version`` while this call waits (it wakes
          # the waiters) makes the items it leaves behind stale for this call too.
          ver_int = self._version
        if direct is None:
          ver = self._device_int("version", ver_int)
        if direct is not None:
          self._settle(direct)
          ok, limiter_ok, cnt = direct.sample(
              self._rng, batch_size, replace, ver_int, min_valid,
              out.ctypes.data if out_owner is out else out_owner.data_ptr())
          result = packing.PackedSample(out_owner, direct.layout(batch_size))
        else:
          self._state, self._rng, result, flags = self._ops.sample(
              self._state, self._rng, ver, mask, cols, self._device_int("min_valid", min_valid),
              batch_size=batch_size, replace=replace, packed=packed)
          ok, limiter_ok, cnt = (int(x) for x in np.asarray(flags))
          if ok and out is not None:  # the jitted batch, copied into the caller's buffer
            np.copyto(out, np.asarray(result.buffer))
            result = packing.PackedSample(out_owner, result.layout)
        if ok:
          if self._sidecars is not None:  # read the rows' host values before they may go
            data, payload = sidecar_rows(spec, self._sidecars, result.data,
                                         np.asarray(result.info.slot), ragged)
            self._sidecars.sync(self._state)
            result = HostSample(data=data, valid=result.valid, info=result.info,
                                num_eligible=result.num_eligible, payload=payload)
          self._cond.notify_all()
          return result
        if not self._wait(deadline):
          why = []
          if not limiter_ok:
            why.append(f"the rate limiter {_describe_limiter(spec)} forbids sampling now "
                       f"(table size {int(self._state.size)}); insert more items"
                       + _batch_beyond_window(spec, batch_size, replace, cnt))
          if cnt < min_valid:
            why.append(f"only {int(cnt)} eligible items (need min_valid={min_valid}"
                       + (f"; max_staleness={spec.max_staleness} at version {ver_int}"
                          if spec.max_staleness is not None else "")
                       + ("; restricted by where" if where is not None else "")
                       + _zero_weights(spec, self._state)
                       + "); insert more (fresh) items or lower min_valid")
          why = "; and ".join(why)
          raise TimeoutError(f"{what}({batch_size}) timed out after {timeout} s: {why}, "
                             "or pass a larger timeout.")


def _zero_weights(spec, state) -> str:
  """Names the stored items a ``Prioritized`` sampler never draws (weight 0), if any."""
  n = int(indexes.zero_weight_count(spec, state))
  if not n:
    return ""
  return (f"; {n} stored item{'s' if n > 1 else ''} of priority 0 (weight 0), which the "
          f"Prioritized sampler never draws: update their priorities")


def _batch_beyond_window(spec, batch_size: int, replace: bool, cnt: int) -> str:
  """A hint when the batch needs more limiter room than inserts can ever make: a batch is
  one limiter decision for all its valid rows (Reverb fills a flexible batch instead), and
  inserts stop at ``max_diff``, so such a batch waits until fewer items are eligible."""
  lim = spec.rate_limiter
  if lim.q_min is None or lim.q_max is None:
    return ""
  rows = (batch_size if cnt > 0 else 0) if replace else min(cnt, batch_size)
  most = (lim.q_max - lim.q_min) // lim.ratio[1]  # samples the window holds at once
  if rows <= most:
    return ""
  return (f"; but a batch of {rows} valid rows needs room for {rows} samples at once, and "
          f"this limiter's window holds at most {most} between inserts (inserts stop at "
          f"max_diff): sample at most {most} rows per call, or widen the window")
