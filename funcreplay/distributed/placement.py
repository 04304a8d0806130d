"""Moving sharded states and items on and off the mesh (what checkpoints and feeders need)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from funcreplay.core.state import TableState
from funcreplay.distributed.mesh import check_leading as _leading


def shard_state(state: TableState, mesh: Mesh, axis: str = "data") -> TableState:
  """Lay out a host (numpy) or device sharded state ``[S, ...]`` on ``mesh``.

  Every process passes the *whole* state (e.g. from ``gather_state`` or a
  checkpoint); each keeps only its addressable shards. The inverse of
  ``gather_state``.
  """
  sharding = NamedSharding(mesh, P(axis))
  n = int(mesh.shape[axis])
  _leading(state, n, "shard_state")

  def put(x):
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

  return jax.tree_util.tree_map(put, state)


def gather_state(state: TableState) -> TableState:
  """The whole sharded state as numpy arrays on the host (every process gets it all)."""
  leaves = jax.tree_util.tree_leaves(state)
  if all(getattr(x, "is_fully_addressable", True) for x in leaves):
    return jax.device_get(state)
  from jax.experimental import multihost_utils  # only needed across processes
  return multihost_utils.process_allgather(state, tiled=True)


def shard_items(items, mesh: Mesh, axis: str = "data"):
  """Global ``[S, B, ...]`` items from each process's local shards ``[S_local, B, ...]``.

  In one process ``S_local = S``. Across processes each passes the rows of
  the shards on its own devices, in mesh order.
  """
  sharding = NamedSharding(mesh, P(axis))
  return jax.tree_util.tree_map(
      lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), items)
