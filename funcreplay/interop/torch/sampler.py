"""``TorchSampler``: a torch iterator / ``IterableDataset`` over a host ``fr.Table``."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import weakref
from typing import Callable, Optional, Union

import jax
import numpy as np
import torch
from torch.utils import data as torch_data

from funcreplay.core import packing
from funcreplay.core.packing import PackedSample
from funcreplay.host.validation import retimed
from funcreplay.interop.torch.batches import (
    TorchBatch,
    beta_at,
    importance_weights,
    sample_to_torch,
)
from funcreplay.interop.torch.dlpack import OnCopy, check_on_copy
from funcreplay.interop.torch.packed import host_batches, packed_batches, unsupported


def _check_device(device) -> torch.device:
  """``torch.device(device)``, or a clear error naming the bad device."""
  try:
    dev = torch.device(device)
  except (RuntimeError, TypeError, ValueError) as e:
    raise ValueError(f"TorchSampler: device {device!r} is not a torch device ({e}); pass "
                     "'cpu', 'cuda', 'cuda:0', a torch.device, or None (the table's "
                     "device).") from None
  if dev.type == "cuda" and not torch.cuda.is_available():
    raise ValueError(f"TorchSampler: device {device!r} needs CUDA, which this torch build / "
                     "machine does not have (torch.cuda.is_available() is False); pass "
                     "device='cpu'.")
  return dev


# --- the iterator ------------------------------------------------------------------------

class _Stop:
  """Marker put on the queue when a producer thread ends."""


class _BatchIterator:
  """One pass over a ``TorchSampler``: synchronous, or fed by a prefetch thread."""

  def __init__(self, owner: "TorchSampler"):
    self._owner = owner
    self._count = 0
    self._pending: list = []  # the other batches of a batches_per_call > 1 sample
    self._done = False
    self._error: Optional[BaseException] = None
    self._stop = threading.Event()
    self._queue: Optional[queue.Queue] = None
    self._thread: Optional[threading.Thread] = None
    if owner.prefetch > 0:
      self._queue = queue.Queue(maxsize=owner.prefetch)
      # The thread holds no reference to this iterator: one dropped without close() (a
      # `break`, `zip(range(n), sampler)`) is collected, and __del__ stops its thread.
      self._thread = threading.Thread(
          target=_produce, args=(owner, self._stop, self._queue, self._pending),
          name="funcreplay-torch-prefetch", daemon=True)
      self._thread.start()

  def __iter__(self):
    return self

  def __del__(self):
    # No join: the last reference may go on any thread. The thread ends at its next check
    # (within one sample's wait and 50 ms); the batches it had prefetched were sampled.
    self._stop.set()

  def _limit_reached(self, produced: int) -> bool:
    return _limit_reached(self._owner, produced)

  def __next__(self) -> TorchBatch:
    if self._error is not None:
      raise self._error
    if self._done or self._limit_reached(self._count):
      self.close()
      raise StopIteration
    if self._queue is None:
      batch = self._owner._next_batch(None, self._pending, _left(self._owner, self._count))  # noqa: SLF001
    else:
      while True:
        try:
          batch = self._queue.get(timeout=0.1)
          break
        except queue.Empty:
          if not self._thread.is_alive() and self._queue.empty():
            self._done = True
            raise StopIteration from None
      if isinstance(batch, _Stop):
        self.close()
        raise StopIteration
      if isinstance(batch, BaseException):
        self._error = batch
        self.close()
        raise batch
    self._count += 1
    return batch

  def close(self) -> None:
    """Stop the prefetch thread (waits for it); idempotent."""
    self._done = True
    self._stop.set()
    t = self._thread
    if t is not None and t is not threading.current_thread():
      t.join()
    self._owner._forget(self)  # noqa: SLF001


def _limit_reached(owner: "TorchSampler", produced: int) -> bool:
  n = owner.num_batches
  return n is not None and produced >= n


def _left(owner: "TorchSampler", produced: int) -> Optional[int]:
  """Batches an iterator still hands out (None: no ``num_batches``)."""
  return None if owner.num_batches is None else owner.num_batches - produced


def _produce(owner: "TorchSampler", stop: threading.Event, out: queue.Queue,
             pending: list) -> None:
  """The prefetch thread of one ``_BatchIterator`` (which it does not reference)."""
  produced = 0
  try:
    while not stop.is_set() and not _limit_reached(owner, produced):
      batch = owner._next_batch(stop, pending, _left(owner, produced))  # noqa: SLF001
      if batch is None:  # stopped while waiting
        return
      if not _put(stop, out, batch):
        return
      produced += 1
    _put(stop, out, _Stop())
  except BaseException as e:  # noqa: BLE001 (handed to the consumer, re-raised there)
    _put(stop, out, e)


def _put(stop: threading.Event, out: queue.Queue, item) -> bool:
  while not stop.is_set():
    try:
      out.put(item, timeout=0.05)
      return True
    except queue.Full:
      continue
  return False


class TorchSampler(torch_data.IterableDataset):
  """Batches of torch tensors sampled from a host ``fr.Table``.

  Iterating yields ``TorchBatch`` objects (``data``, ``valid``, ``info`` with
  slot/key/probability/..., ``weights`` when ``beta`` is given). With
  ``prefetch > 0`` a background thread samples and converts the next batches
  while the learner works on the current one; errors in that thread are
  re-raised in the consumer, and ``close()`` (or leaving a ``with`` block, or
  exhausting ``num_batches``) stops it.

  It is also a ``torch.utils.data.IterableDataset``: use
  ``DataLoader(sampler, batch_size=None, num_workers=0)`` (the table lives in
  this process, so worker processes are refused).

  Args:
    table: a ``fr.Table``.
    batch_size: B rows per batch.
    device: torch device of the batches ("cpu": zero copy from a CPU table;
      "cuda" from a CPU table: pinned, non-blocking copies on the prefetch
      thread; None: wherever the table's arrays live, zero copy). A string
      torch does not know, or "cuda" without CUDA, is a ``ValueError`` here.
    version_fn: called before every sample; returns the learner's current
      policy version (staleness mask + stats). None: the table's version.
    where: passed to ``Table.sample`` (slot mask or metadata filter).
    prefetch: batches sampled ahead on a background thread (0: sample
      synchronously in ``next``).
    timeout: seconds to wait for one batch (None: forever) -> TimeoutError.
    beta: PER importance-weight exponent, a float or a function of the batch
      index (annealing); None: no weights. A function's result is checked
      before each sample: NaN, inf, negative or non-numbers raise
      ``ValueError`` and nothing is sampled.
    replace, min_valid: passed to ``Table.sample`` (``min_valid`` counts rows
      of the whole call).
    num_batches: stop after this many batches (None: never).
    batches_per_call: sample ``batches_per_call * batch_size`` rows per
      ``Table.sample`` call and hand them out as that many batches (zero-copy
      slices). Amortises the per-call cost (dispatch, host sync, export) on
      CPU; the batches of one call are drawn together (jointly without
      replacement, from the priorities and version of that moment), as with
      Reverb's in-flight samples. A ``SampleToInsertRatio`` window must admit
      a whole call.
    on_copy: what to do when a batch leaf could not be shared zero copy.
  """

  def __init__(self, table, batch_size: int, *, device="cpu", version_fn=None, where=None,
               prefetch: int = 1, timeout: Optional[float] = None,
               beta: Union[None, float, Callable[[int], float]] = None, replace: bool = False,
               min_valid: Optional[int] = None, num_batches: Optional[int] = None,
               batches_per_call: int = 1, on_copy: OnCopy = "warn"):
    super().__init__()
    if not hasattr(table, "sample") or not hasattr(table, "update_priorities"):
      raise TypeError(f"TorchSampler expects a funcreplay Table, got {type(table).__name__}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f"TorchSampler: batch_size must be an int >= 1, got {batch_size!r}.")
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
      raise ValueError(f"TorchSampler: prefetch must be an int >= 0, got {prefetch!r}.")
    if isinstance(batches_per_call, bool) or not isinstance(batches_per_call, int) \
        or batches_per_call < 1:
      raise ValueError(f"TorchSampler: batches_per_call must be an int >= 1, "
                       f"got {batches_per_call!r}.")
    if num_batches is not None and (isinstance(num_batches, bool)
                                    or not isinstance(num_batches, int) or num_batches < 0):
      raise ValueError(f"TorchSampler: num_batches must be None or an int >= 0, "
                       f"got {num_batches!r}.")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout < 0):
      raise ValueError(f"TorchSampler: timeout must be None or seconds >= 0, got {timeout!r}.")
    if version_fn is not None and not callable(version_fn):
      raise TypeError("TorchSampler: version_fn must be a callable returning an int.")
    if beta is not None and not callable(beta) and (not isinstance(beta, (int, float))
                                                    or not np.isfinite(beta) or beta < 0):
      raise ValueError(f"TorchSampler: beta must be None, a number >= 0 or a callable, "
                       f"got {beta!r}.")
    check_on_copy(on_copy)
    self.table = table
    self.batch_size = batch_size
    self.device = None if device is None else _check_device(device)
    self.version_fn = version_fn
    self.where = where
    self.prefetch = prefetch
    self.timeout = None if timeout is None else float(timeout)
    self.beta = beta
    self.replace = bool(replace)
    self.min_valid = min_valid
    self.num_batches = num_batches
    self.batches_per_call = batches_per_call
    self.on_copy = on_copy
    self._lock = threading.Lock()
    self._iterators = weakref.WeakSet()  # live iterators (close() stops them); weak: see __del__
    self._default: Optional[_BatchIterator] = None
    self._sampled = 0
    self._packed: Optional[bool] = None  # decided on the first sample
    self._in_place: Optional[bool] = None  # likewise: sample into torch memory directly
    self._out_bytes: dict = {}  # rows -> (bytes of an in-place buffer, pinned)

  # -- sampling --------------------------------------------------------------------------
  def _beta(self, index: int) -> Optional[float]:
    """The exponent for batch ``index``; a callable's result is checked (finite, >= 0)."""
    return beta_at(self.beta, index, "TorchSampler", " (nothing was sampled for this batch)")

  def _next_batch(self, stop: Optional[threading.Event], pending: list,
                  left: Optional[int] = None) -> Optional[TorchBatch]:
    """The next batch (from ``pending``, or a new sample); None if ``stop`` was set meanwhile.
    ``left``: the batches the iterator still hands out (a call samples no more than those:
    the rows of batches it would drop count as sampled, toward reuse limits)."""
    if pending:
      return pending.pop(0)
    k = self.batches_per_call if left is None else max(1, min(self.batches_per_call, left))
    # The betas of the batches this call hands out are checked before sampling,
    # so a bad schedule leaves the table as it was (indexes as reserved below,
    # unless another iterator of this sampler samples in between).
    with self._lock:
      first = self._sampled
    betas = [self._beta(first + i) for i in range(k)]
    deadline = None if self.timeout is None else time.monotonic() + self.timeout
    while True:
      # Wait in short slices so that close() is noticed promptly.
      wait = 0.1 if stop is not None else None
      if deadline is not None:
        left = max(0.0, deadline - time.monotonic())
        wait = left if wait is None else min(wait, left)
      version = None if self.version_fn is None else self.version_fn()
      try:
        smp = self._sample(self.batch_size * k, version=version,
                           where=self.where, timeout=wait, replace=self.replace,
                           min_valid=self.min_valid)
        break
      except TimeoutError as e:
        if deadline is not None and time.monotonic() >= deadline:
          # The table's message names the last slice's wait: the caller's timeout instead.
          raise retimed(e, self.timeout) from None
        if stop is not None and stop.is_set():
          return None
    with self._lock:
      index = self._sampled
      self._sampled += k
    if index != first:  # raced with another iterator: the schedule at the real indexes
      betas = [self._beta(index + i) for i in range(k)]
    on_dev = self.device is None or self.device.type == "cpu"
    if self._in_place:  # our own buffer, of the layout's size: no checks needed
      parts = host_batches(smp.buffer, smp.layout, k, self.device, not on_dev)
    elif isinstance(smp, PackedSample):
      parts = packed_batches(smp, k, device=self.device, on_copy=self.on_copy,
                             non_blocking=not on_dev)
    else:
      big = sample_to_torch(smp, device=self.device, beta=None, on_copy=self.on_copy,
                            non_blocking=not on_dev)
      b = self.batch_size
      parts = [big if k == 1 else jax.tree_util.tree_map(lambda t, i=i: t[i * b:(i + 1) * b], big)
               for i in range(k)]
    if not on_dev and self.device.type == "cuda" and stop is not None:
      # The copies were issued on this thread's stream; finish them before handing over.
      torch.cuda.current_stream(self.device).synchronize()
    for part, beta in zip(parts, betas, strict=True):
      if beta is not None:
        w = importance_weights(part.info.probability, part.valid, part.num_eligible, beta)
        part = dataclasses.replace(part, weights=w)
      pending.append(part)
    return pending.pop(0)

  def _sample(self, rows: int, **kwargs):
    """A ``PackedSample`` where the table and the item dtypes allow it, else a ``Sample``.

    Packed, a CPU table writes the batch straight into a fresh torch tensor
    (``Table.sample_packed(out=...)``, no jitted call and no export; pinned
    when the batches go to a GPU); other tables return one XLA buffer, which
    crosses with one DLPack export.
    """
    if self._packed is None:
      spec = getattr(self.table, "spec", None)
      # Ragged values and payloads live on the host beside the state: only
      # ``Table.sample`` returns them (``sample_packed`` refuses such tables).
      self._packed = (hasattr(self.table, "sample_packed") and spec is not None
                      and not spec.ragged and not getattr(self.table, "keeps_payloads", False)
                      and packing.packable(spec.signature) is None
                      and unsupported(packing.layout(spec.signature, rows)) is None)
      self._in_place = (self._packed and self.where is None
                        and getattr(self.table, "samples_in_place", False))
    if self._in_place:
      got = self._out_bytes.get(rows)
      if got is None:
        pin = (self.device is not None and self.device.type == "cuda"
               and torch.cuda.is_available())
        got = self._out_bytes[rows] = (packing.layout(self.table.spec.signature, rows).nbytes,
                                       pin)
      nbytes, pin = got
      out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
      return self.table.sample_packed(rows, out=out, **kwargs)
    if self._packed:
      return self.table.sample_packed(rows, **kwargs)
    return self.table.sample(rows, **kwargs)

  # -- iteration ---------------------------------------------------------------------------
  def __iter__(self) -> _BatchIterator:
    if torch_data.get_worker_info() is not None:
      raise RuntimeError("TorchSampler cannot run in DataLoader worker processes (the table "
                         "lives in this process): use num_workers=0 and prefetch= instead.")
    it = _BatchIterator(self)
    with self._lock:
      self._iterators.add(it)
    return it

  def __next__(self) -> TorchBatch:
    if self._default is None:
      self._default = iter(self)
    return next(self._default)

  def _forget(self, it) -> None:
    with self._lock:
      self._iterators.discard(it)

  def close(self) -> None:
    """Stop every prefetch thread of this sampler (waits for them)."""
    with self._lock:
      its = list(self._iterators)
    for it in its:
      it.close()
    self._default = None

  def __enter__(self) -> "TorchSampler":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    return (f"TorchSampler(batch_size={self.batch_size}, device={self.device}, "
            f"prefetch={self.prefetch}, beta={self.beta!r})")
