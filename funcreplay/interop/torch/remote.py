"""``RemoteTorchSampler``: torch batches from a replay actor (``funcreplay.ray``).

The learner-side iterator over a ``funcreplay.ray.RemoteTable``: a
``funcreplay.ray.Prefetcher`` keeps ``prefetch`` sample calls in flight; each
reply is one packed ``uint8`` buffer (the actor samples with
``Table.sample_packed(out=...)``), which becomes a ``TorchBatch`` of views of one
tensor (``packed.host_batches``, the ``TorchSampler`` path). Ray hands the
buffer over read-only (a view of its object store), so it is copied once into
memory torch may own and write (one memcpy of ~B * item bytes; a colocated
learner, ``RemoteTable.run``, uses ``TorchSampler`` on the table itself with no
copy at all).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np

from funcreplay.core.packing import PackedSample
from funcreplay.interop.torch.batches import (
    TorchBatch,
    beta_at,
    importance_weights,
    sample_to_torch,
)
from funcreplay.interop.torch.dlpack import as_device
from funcreplay.interop.torch.packed import host_batches
from funcreplay.ray.prefetch import Prefetcher


class RemoteTorchSampler:
  """Iterate ``TorchBatch`` objects sampled by a replay actor, ``prefetch`` calls ahead.

  Args:
    table: a ``funcreplay.ray.RemoteTable``.
    batch_size: rows per batch.
    prefetch: sample calls kept in flight (>= 1).
    device: torch device of the batches (None: CPU).
    beta: PER importance-weight exponent, a float or a function of the batch index
      (annealing); None: ``weights`` is None.
    version_fn / where / timeout: as ``Prefetcher`` (each sample's).
    num_batches: stop after this many (None: never).

  Write priorities back with ``funcreplay.torch.update_priorities(table, batch.info, p)``
  (the ``RemoteTable`` takes them like a ``Table``).
  """

  def __init__(self, table, batch_size: int, *, prefetch: int = 2, device=None,
               beta: Union[None, float, Callable[[int], float]] = None,
               version_fn: Optional[Callable[[], int]] = None, where=None,
               timeout: Optional[float] = 60.0, num_batches: Optional[int] = None):
    if beta is not None and not callable(beta) and (
        isinstance(beta, bool) or not isinstance(beta, (int, float)) or not np.isfinite(beta)
        or beta < 0):
      raise ValueError(f"RemoteTorchSampler: beta must be None, a number >= 0 or a callable, "
                       f"got {beta!r}.")
    self.table = table
    self.batch_size = batch_size
    self.device = as_device(device)
    self.beta = beta
    self._it = Prefetcher(table, batch_size, prefetch=prefetch, timeout=timeout,
                          version_fn=version_fn, where=where, packed=True,
                          max_batches=num_batches)
    self._count = 0

  def __iter__(self) -> "RemoteTorchSampler":
    return self

  def __next__(self) -> TorchBatch:
    res = next(self._it)
    if isinstance(res, PackedSample):
      buf = res.buffer
      if not buf.flags.writeable:  # a read-only view of Ray's object store
        buf = buf.copy()
      batch = host_batches(buf, res.layout, 1, self.device, False)[0]
    else:  # items that cannot be packed (sub-byte dtypes): a Sample of numpy arrays
      batch = sample_to_torch(jax.tree_util.tree_map(jnp.asarray, res), device=self.device,
                              on_copy="ignore")
    beta = beta_at(self.beta, self._count, "RemoteTorchSampler")
    self._count += 1
    if beta is not None:
      batch = dataclasses.replace(batch, weights=importance_weights(
          batch.info.probability, batch.valid, batch.num_eligible, float(beta)))
    return batch

  def close(self) -> None:
    self._it.close()

  def __enter__(self) -> "RemoteTorchSampler":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
