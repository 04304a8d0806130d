"""PyTorch bridge: zero-copy DLPack batches, a torch iterator, priority write-back.

A PyTorch learner trains from a funcreplay ``Table`` without touching JAX::

  import funcreplay.torch as frt

  sampler = frt.TorchSampler(table, 256, beta=0.4, version_fn=lambda: step)
  for batch in sampler:                       # frt.TorchBatch of torch tensors
    td = td_error(batch.data)                 # [B], may require grad
    loss = (batch.weights * td.pow(2)).mean()
    ...
    frt.update_priorities(table, batch.info, td.abs() + 1e-6)

What crosses the boundary, and the pitfalls handled (DESIGN.md section 5):

* **Zero copy through DLPack** (``torch.from_dlpack`` / ``jnp.from_dlpack``)
  on the same device. Every conversion compares the buffer pointers
  (``unsafe_buffer_pointer()`` vs ``data_ptr()``) and records each leaf that
  was copied, and why, in a ``TransferReport``; ``on_copy`` chooses between
  ignoring, warning (``BridgeCopyWarning``) and raising.
* **Only fresh arrays are exported.** ``Table.sample`` returns new buffers (the
  batch is gathered out of the state by the jitted call), never views of the
  donated ``TableState``; ``to_torch`` refuses a ``TableState`` outright, since
  the table donates (reuses) those buffers on its next mutation.
* **Async dispatch.** JAX computes asynchronously; ``to_torch`` blocks until
  every exported array is ready, so torch never reads a buffer XLA is still
  writing. From torch, CUDA tensors are synchronised on their current stream
  before JAX takes them (``sync=True``).
* **bool** leaves travel as bool where both libraries support it, otherwise as
  uint8 (a reported copy) and are viewed back as bool.
* **Strides.** Dense tensors in any dimension order cross without a copy;
  size-1 dimensions with arbitrary strides are normalised (a free
  ``as_strided``); broadcast / sliced (non-dense) tensors are made contiguous
  (a reported copy).
* **Unaligned CPU buffers** (e.g. ``base[1:]``): JAX needs 64-byte aligned
  host buffers and copies the others silently; the pointer check catches it.
* **64-bit dtypes** with ``jax_enable_x64=False``: JAX would narrow int64 /
  float64 silently; the bridge narrows explicitly, raising ``ValueError`` if an
  integer does not fit in 32 bits, and reports the copy.
* **requires_grad** tensors are detached (DLPack cannot export them);
  conjugate / negative bits are resolved.
* **Aliasing.** A zero-copy ``from_torch`` result shares memory with the
  tensor: in-place torch updates (an optimizer step) show through the
  "immutable" JAX array. Pass ``copy=True`` for a snapshot.
* **One export per batch.** A DLPack export of a fresh CPU array costs ~10 us
  and a batch has about a dozen arrays, so ``TorchSampler`` samples with
  ``Table.sample_packed`` (the whole batch in one buffer, written by the
  sampling program) and views each field of the one exported tensor
  (``packed_to_torch`` / ``packed_batches``). Moving to another device is one
  copy of that buffer. On a CPU table there is no export at all: the table
  samples straight into a torch tensor ``TorchSampler`` allocates
  (``Table.sample_packed(out=tensor)``, without a jitted call; pinned when
  the batches go to a GPU).
* **Per-call cost.** On CPU the table call (dispatch, host sync) is the rest
  of a small batch's cost: ``TorchSampler(batches_per_call=k)`` samples
  ``k * B`` rows in one call and hands them out as ``k`` zero-copy batches.
* **Pinned memory.** ``TorchSampler(device="cuda")`` over a host table copies
  each batch through pinned memory with ``non_blocking`` transfers on its
  prefetch thread.

Sharing one GPU between torch and JAX: JAX preallocates 75% of GPU memory by
default; set ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (or
``XLA_PYTHON_CLIENT_MEM_FRACTION=.3``) before importing jax, see BUILD.md.
"""

from funcreplay.interop.torch.batches import (
    TorchBatch,
    TorchInfo,
    priorities_to_numpy,
    sample_to_torch,
    update_priorities,
)
from funcreplay.interop.torch.dlpack import (
    BridgeCopyWarning,
    TorchRaggedBatch,
    TransferReport,
    from_torch,
    from_torch_with_report,
    to_torch,
    to_torch_with_report,
)
from funcreplay.interop.torch.packed import packed_batches, packed_to_torch
from funcreplay.interop.torch.remote import RemoteTorchSampler
from funcreplay.interop.torch.sampler import TorchSampler

__all__ = [
    "BridgeCopyWarning", "TransferReport", "TorchRaggedBatch", "to_torch",
    "to_torch_with_report", "from_torch", "from_torch_with_report", "TorchInfo", "TorchBatch",
    "sample_to_torch", "TorchSampler",
    "update_priorities", "priorities_to_numpy", "packed_to_torch", "packed_batches",
    "RemoteTorchSampler",
]
