"""Subprocess helper of tests/checkpoint/test_checkpoint.py.

Usage:
  python tests/checkpoint/checkpoint_worker.py saves DIR START  # save steps START, START+1, ...
  python tests/checkpoint/checkpoint_worker.py sharded DIR      # sharded round trip, 4 CPU devices

``saves``: checkpoint ``k`` holds a table whose every data row equals ``k``
(so a restored checkpoint proves it is complete and of one step); prints
``saved k`` after each save. The parent SIGKILLs it at random moments.

``sharded``: prints one JSON line with the round-trip checks.
"""

import json
import os
import sys

if sys.argv[1] == "sharded":
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import funcreplay as fr  # noqa: E402
from funcreplay import checkpoint as ck  # noqa: E402
from funcreplay import distributed as frs  # noqa: E402

ROW = 4096  # int32 per item: 16 KiB items, 64 items -> 1 MiB checkpoints


def saves_spec():
  return fr.TableSpec(64, {"x": jnp.zeros((ROW,), jnp.int32)})


def saves(directory: str, start: int):
  spec = saves_spec()
  state = jax.device_get(jax.jit(fr.make_table(spec).init)())
  # Every slot occupied: the rows of free slots are not stored (checkpoint.rows).
  state = state.replace(occupied=np.ones((spec.capacity,), bool))
  step = start
  while True:
    data = {"x": np.full((spec.capacity, ROW), step, np.int32)}
    st = state.replace(data=data, next_key=np.uint32(step))
    ck.save(ck.step_path(directory, step), st, spec)
    ck.prune(directory, keep_last=2)
    print(f"saved {step}", flush=True)
    step += 1


def sharded(directory: str):
  mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  spec = fr.TableSpec(16, {"tag": jnp.zeros((2,), jnp.float32)}, sampler=fr.Prioritized(0.8),
                      max_times_sampled=3)
  t = frs.make_sharded_table(spec, mesh)
  state = jax.jit(t.init)()
  items = {"tag": np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2)}
  prio = np.arange(1, 13, dtype=np.float32).reshape(4, 3)
  insert = jax.jit(t.insert)
  state = insert(state, items, version=1, priority=prio)
  sample = jax.jit(t.sample_global, static_argnames=("batch_size",))
  state, _ = sample(state, jax.random.PRNGKey(1), batch_size=6)
  path = ck.save(os.path.join(directory, "sharded"), state, spec)
  r = ck.restore(path, mesh=mesh, axis="data")
  a, b = jax.tree_util.tree_leaves(frs.gather_state(state)), jax.tree_util.tree_leaves(
      frs.gather_state(r.state))
  leaves_equal = all(np.asarray(x).tobytes() == np.asarray(y).tobytes() and
                     np.asarray(x).dtype == np.asarray(y).dtype for x, y in zip(a, b, strict=True))
  sharded_ok = all(getattr(x, "sharding", None) == t.sharding
                   for x in jax.tree_util.tree_leaves(r.state))
  s1, o1 = sample(state, jax.random.PRNGKey(7), batch_size=6)  # same compiled function
  s2, o2 = sample(r.state, jax.random.PRNGKey(7), batch_size=6)
  same_sample = all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(o1),
                                                         jax.tree_util.tree_leaves(o2),
                                                         strict=True))
  num = ck.restore(path, as_numpy=True)
  errors = {}
  for name, kw in [("no_mesh", {}),
                   ("wrong_mesh", dict(mesh=jax.make_mesh((2,), ("data",),
                                                          devices=jax.devices()[:2]))),
                   ("host_table", None)]:
    try:
      ck.restore_table(path) if kw is None else ck.restore(path, **kw)
      errors[name] = "no error"
    except ck.CheckpointError as e:
      errors[name] = str(e)
  grown = ck.restore(path, spec.replace(capacity=32), allow_capacity_growth=True, mesh=mesh)
  grown_occ = int(np.asarray(frs.gather_state(grown.state).occupied).sum())
  print(json.dumps(dict(devices=jax.device_count(), num_shards=r.num_shards,
                        leaves_equal=leaves_equal, sharded_ok=sharded_ok,
                        same_sample=same_sample,
                        numpy_shape=list(np.shape(num.state.occupied)),
                        size=int(np.asarray(num.state.occupied).sum()), grown_size=grown_occ,
                        grown_shape=list(np.shape(grown.state.occupied)), errors=errors)),
        flush=True)


if __name__ == "__main__":
  if sys.argv[1] == "saves":
    saves(sys.argv[2], int(sys.argv[3]))
  else:
    sharded(sys.argv[2])
