"""A replay service on Ray: one host ``Table`` shared by producers and learners on many
processes and machines (optional extra ``funcreplay[ray]``).

::

  import funcreplay as fr
  import funcreplay.ray as frr

  table = frr.connect("replay", spec, namespace="rl", checkpoint_dir="/ckpt/replay",
                      checkpoint_every_s=300, max_restarts=3)      # get-or-create
  # producers (Ray tasks / actors / other drivers):
  with frr.connect("replay", namespace="rl").writer(batch_size=1024) as w:
    w.put(transition, version=policy_version)
  # the learner:
  smp = table.sample(256, timeout=10.0)          # fr.Sample of numpy arrays
  table.update_priorities(smp.info.slot, smp.info.key, new_priorities)
  for smp in table.prefetch(256, prefetch=4):     # k samples in flight
    ...

* ``server``: the actor (``TableServer``) -- a threaded Ray actor whose concurrency
  groups keep blocked samples from blocking inserts and queries; the host ``Table``
  does the waiting (rate limiters block remote callers as they block local ones).
* ``client``: ``connect`` and ``RemoteTable`` (timeouts everywhere; the actor's
  errors re-raised as they were; ``TableUnavailableError`` when it is gone).
* ``writer``: ``RemoteWriter``, the batching producer client (back-pressure).
* ``prefetch``: ``Prefetcher``, the learner's iterator. Torch batches:
  ``funcreplay.torch.RemoteTorchSampler``.

Importing this package does not import Ray; ``connect`` does (``ImportError`` naming
the extra if it is missing).
"""

from funcreplay.ray.calls import RPC_SLACK_S, RPC_TIMEOUT_S, SAVE_TIMEOUT_S
from funcreplay.ray.client import RemoteTable, connect
from funcreplay.ray.errors import (
    TableUnavailableError,
    WriterClosedError,
    WriterError,
    WriterFullError,
    WriterStats,
)
from funcreplay.ray.prefetch import Prefetcher
from funcreplay.ray.server import CONCURRENCY_GROUPS, TableServer
from funcreplay.ray.writer import RemoteWriter

__all__ = [
    "CONCURRENCY_GROUPS", "Prefetcher", "RPC_SLACK_S", "RPC_TIMEOUT_S", "RemoteTable",
    "RemoteWriter", "SAVE_TIMEOUT_S", "TableServer", "TableUnavailableError",
    "WriterClosedError", "WriterError", "WriterFullError", "WriterStats", "connect",
]
