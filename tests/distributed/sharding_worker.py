"""One process of the two-process sharded-table test (run by test_sharding_processes.py).

Usage: python tests/distributed/sharding_worker.py PORT PROCESS_ID NUM_PROCESSES

Each process owns 2 CPU devices of a 4-device mesh, inserts items tagged with
its process id into its own shards, then every process takes the same global
sample and prints one JSON line with what it saw.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402


def main(port: int, pid: int, nproc: int):
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc,
                             process_id=pid, initialization_timeout=60)
  import jax.numpy as jnp
  import numpy as np
  from jax.experimental import multihost_utils

  import funcreplay as fr
  from funcreplay import distributed as frs

  mesh = jax.make_mesh((jax.device_count(),), ("data",))
  n = mesh.shape["data"]
  n_local = jax.local_device_count()
  spec = fr.TableSpec(8 * n, {"tag": jnp.zeros((), jnp.int32)}, sampler=fr.Prioritized(1.0))
  table = frs.make_sharded_table(spec, mesh)
  state = jax.jit(table.init)()
  # Process p inserts tags 1000 * (p + 1) + row into each of its local shards.
  local = {"tag": (1000 * (pid + 1) + np.arange(n_local * 4, dtype=np.int32)).reshape(n_local, 4)}
  items = table.shard_items(local)
  state = jax.jit(table.insert)(state, items, version=0)
  sample = jax.jit(table.sample_global, static_argnames=("batch_size", "replace",
                                                         "max_per_shard"))
  seen = []
  for i in range(4):
    state, batch = sample(state, jax.random.PRNGKey(i), batch_size=8)
    tags = multihost_utils.process_allgather(batch.data["tag"], tiled=True)
    valid = multihost_utils.process_allgather(batch.valid, tiled=True)
    seen.extend(int(t) for t in np.asarray(tags)[np.asarray(valid)])
  count = int(table.count(state))
  st = table.stats(state).to_dict()
  host = frs.gather_state(state)
  print(json.dumps(dict(pid=pid, devices=jax.device_count(), local=n_local, count=count,
                        samples=st["samples"], seen=seen,
                        host_occupied=int(np.asarray(host.occupied).sum()))), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
