"""Insert / sample throughput of a sharded table on 1, 2, 4, 8 (fake CPU) devices.

Compares ``make_sharded_table`` over meshes of the first ``n`` devices with
the plain unsharded table on one device, at the same *global* capacity and
batch sizes (each of the ``n`` shards inserts ``batch / n`` rows). On a CPU
host the fake devices share the same cores, so this measures the overhead
of the sharded formulation (shard_map, collectives, the global-sampling
merge), not a speed-up; on a GPU/TPU slice each shard has its own device.

  python experiments/bench_sharding.py --devices=1,2,4,8 --out=results/bench_sharding.json
"""

import json
import os
import sys
import time

# Must precede the first jax import: XLA reads it when the backend starts.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from funcreplay import distributed as frs  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("devices", "1,2,4,8", "comma-separated shard counts")
flags.DEFINE_integer("capacity", 1 << 16, "global capacity (multiple of every shard count)")
flags.DEFINE_integer("obs_dim", 64, "float32 observation size per item")
flags.DEFINE_integer("insert_batch", 512, "global insert batch")
flags.DEFINE_integer("sample_batch", 256, "global sample batch")
flags.DEFINE_integer("steps", 50, "timed calls per measurement")
flags.DEFINE_integer("repeats", 5, "measurements; the median is reported")
flags.DEFINE_bool("prioritized", False, "Prioritized(0.6) sampler instead of Uniform")
flags.DEFINE_string("out", "results/bench_sharding.json", "JSON output ('' = none)")


class _Runner:
  """One timed operation ``state = fn(state, i)`` with its own (donated) state."""

  def __init__(self, fn, state):
    self.fn, self.state, self.i, self.times = fn, fn(state, 0), 1, []  # compile + warm up
    jax.block_until_ready(self.state)

  def run(self, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
      # One call in flight at a time, for every configuration alike: with 8 fake
      # devices on 2 cores, many queued executions starve XLA's in-process
      # collective rendezvous (it aborts after 40 s waiting for a participant).
      self.state = jax.block_until_ready(self.fn(self.state, self.i))
      self.i += 1
    self.times.append((time.perf_counter() - t0) / steps)


def _measure(runners, steps, repeats):
  """Median s/call of each runner, measured round-robin so that load changes on a
  shared machine hit every configuration alike."""
  for _ in range(repeats):
    for r in runners.values():
      r.run(steps)
  return {k: float(np.median(r.times)) for k, r in runners.items()}


def _spec():
  item = {"obs": jnp.zeros((FLAGS.obs_dim,), jnp.float32), "reward": jnp.zeros((), jnp.float32)}
  sampler = fr.Prioritized(0.6) if FLAGS.prioritized else fr.Uniform()
  return fr.TableSpec(FLAGS.capacity, item, sampler=sampler)


def _items(lead):
  rng = np.random.default_rng(0)
  return {"obs": rng.standard_normal((*lead, FLAGS.obs_dim), dtype=np.float32),
          "reward": rng.standard_normal(lead, dtype=np.float32)}


def unsharded_runners(spec):
  t = fr.make_table(spec)
  items = jax.device_put(_items((FLAGS.insert_batch,)))
  insert = jax.jit(lambda s, i: t.insert(s, items, version=i), donate_argnums=0)
  sample = jax.jit(lambda s, i: t.sample(s, jax.random.PRNGKey(i),
                                         batch_size=FLAGS.sample_batch)[0], donate_argnums=0)
  state = _Runner(insert, t.init()).state  # fill a little before sampling
  return {("unsharded", 1, "insert"): _Runner(insert, t.init()),
          ("unsharded", 1, "sample"): _Runner(sample, state)}


def sharded_runners(spec, n):
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:n])
  t = frs.make_sharded_table(spec, mesh)
  if FLAGS.insert_batch % n or FLAGS.sample_batch % n:
    raise ValueError(f"batches must divide by {n} shards")
  items = t.shard_items(_items((n, FLAGS.insert_batch // n)))
  insert = jax.jit(lambda s, i: t.insert(s, items, version=i), donate_argnums=0)
  local = jax.jit(lambda s, i: t.sample(s, jax.random.PRNGKey(i),
                                        batch_size=FLAGS.sample_batch // n)[0], donate_argnums=0)
  glob = jax.jit(lambda s, i: t.sample_global(s, jax.random.PRNGKey(i),
                                              batch_size=FLAGS.sample_batch)[0], donate_argnums=0)
  init = jax.jit(t.init)
  filled = lambda: _Runner(insert, init()).state  # noqa: E731
  return {("sharded", n, "insert"): _Runner(insert, init()),
          ("sharded", n, "sample"): _Runner(local, filled()),
          ("sharded", n, "sample_global"): _Runner(glob, filled())}


def main(_):
  spec = _spec()
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"capacity {spec.capacity}, item {FLAGS.obs_dim * 4 + 4} B, insert batch "
        f"{FLAGS.insert_batch}, sample batch {FLAGS.sample_batch}, "
        f"{'prioritized' if FLAGS.prioritized else 'uniform'}")
  runners = unsharded_runners(spec)
  shard_counts = [int(x) for x in FLAGS.devices.split(",")]
  for n in shard_counts:
    runners.update(sharded_runners(spec, n))
  secs = _measure(runners, FLAGS.steps, FLAGS.repeats)
  base = {op: secs[("unsharded", 1, op)] for op in ("insert", "sample")}
  rows = []
  for config, n in [("unsharded", 1)] + [("sharded", n) for n in shard_counts]:
    r = dict(config=config, shards=n)
    for op in ("insert", "sample", "sample_global"):
      if (config, n, op) not in secs:
        continue
      s = secs[(config, n, op)]
      batch = FLAGS.insert_batch if op == "insert" else FLAGS.sample_batch
      r[f"{op}_s"] = s
      r[f"{op}_items_per_s"] = batch / s
      r[f"{op}_overhead"] = s / base["insert" if op == "insert" else "sample"] - 1
    rows.append(r)
  print(f"{'config':>10} {'shards':>6} {'insert items/s':>15} {'sample items/s':>15} "
        f"{'global items/s':>15} {'insert ovh':>10} {'sample ovh':>10} {'global ovh':>10}")
  nan = float("nan")
  for r in rows:
    print(f"{r['config']:>10} {r['shards']:>6} {r['insert_items_per_s']:>15,.0f} "
          f"{r['sample_items_per_s']:>15,.0f} {r.get('sample_global_items_per_s', nan):>15,.0f} "
          f"{r['insert_overhead']:>+10.1%} {r['sample_overhead']:>+10.1%} "
          f"{r.get('sample_global_overhead', nan):>+10.1%}")
  if FLAGS.out:
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump(dict(jax=jax.__version__, platform=jax.devices()[0].platform,
                     flags={k: FLAGS[k].value for k in ("capacity", "obs_dim", "insert_batch",
                                                         "sample_batch", "steps", "repeats",
                                                         "prioritized")},
                     rows=rows), f, indent=1)
    print(f"wrote {FLAGS.out}")


def run(small: bool) -> list:
  """The ``sharding`` section of ``experiments/benchmark.py``.

  Runs this script in a subprocess (XLA fixes the device count when the
  backend starts, and the driver's process has already started it) and
  returns one row per (shards, op): funcreplay = sharded items/s, peer = the
  unsharded table in the same run, ratio = sharded / unsharded.
  """
  import subprocess
  import tempfile
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "sharding.json")
    cmd = [sys.executable, os.path.abspath(__file__), f"--out={out}"]
    if small:
      cmd += ["--capacity=16384", "--steps=10", "--repeats=3"]
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=8").strip()
    subprocess.run(cmd, check=True, env=env, timeout=1800)
    with open(out) as f:
      rows = json.load(f)["rows"]
  base = rows[0]
  results = []
  for r in rows[1:]:
    for op, base_op in (("insert", "insert"), ("sample", "sample"), ("sample_global", "sample")):
      if f"{op}_items_per_s" not in r:
        continue
      ours, peer = r[f"{op}_items_per_s"], base[f"{base_op}_items_per_s"]
      results.append(dict(section="sharding", case=f"{op} {r['shards']} shard(s)", funcreplay=ours,
                          peer=peer, peer_name="unsharded table", unit="items/s",
                          ratio=ours / peer))
  return results


if __name__ == "__main__":
  app.run(main)
