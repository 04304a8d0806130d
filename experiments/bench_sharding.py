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

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from funcreplay import sharding as frs  # noqa: E402

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


def _time(fn, state, steps, repeats):
  """Median seconds per call of ``state = fn(state, i)`` (state donated)."""
  state = fn(state, 0)  # compile + warm up
  jax.block_until_ready(state)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for i in range(steps):
      state = fn(state, i + 1)
    jax.block_until_ready(state)
    times.append((time.perf_counter() - t0) / steps)
  return float(np.median(times)), state


def _spec():
  item = {"obs": jnp.zeros((FLAGS.obs_dim,), jnp.float32), "reward": jnp.zeros((), jnp.float32)}
  sampler = fr.Prioritized(0.6) if FLAGS.prioritized else fr.Uniform()
  return fr.TableSpec(FLAGS.capacity, item, sampler=sampler)


def _items(lead):
  rng = np.random.default_rng(0)
  return {"obs": rng.standard_normal((*lead, FLAGS.obs_dim), dtype=np.float32),
          "reward": rng.standard_normal(lead, dtype=np.float32)}


def bench_unsharded(spec):
  t = fr.make_table(spec)
  items = jax.device_put(_items((FLAGS.insert_batch,)))
  insert = jax.jit(lambda s, i: t.insert(s, items, version=i), donate_argnums=0)
  sample = jax.jit(lambda s, i: t.sample(s, jax.random.PRNGKey(i),
                                         batch_size=FLAGS.sample_batch)[0], donate_argnums=0)
  state = t.init()
  ins, state = _time(insert, state, FLAGS.steps, FLAGS.repeats)
  smp, state = _time(sample, state, FLAGS.steps, FLAGS.repeats)
  return dict(insert_s=ins, sample_s=smp)


def bench_sharded(spec, n):
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
  state = jax.jit(t.init)()
  ins, state = _time(insert, state, FLAGS.steps, FLAGS.repeats)
  smp, state = _time(local, state, FLAGS.steps, FLAGS.repeats)
  gsm, state = _time(glob, state, FLAGS.steps, FLAGS.repeats)
  return dict(insert_s=ins, sample_s=smp, sample_global_s=gsm)


def main(_):
  spec = _spec()
  print(f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"capacity {spec.capacity}, item {FLAGS.obs_dim * 4 + 4} B, insert batch "
        f"{FLAGS.insert_batch}, sample batch {FLAGS.sample_batch}, "
        f"{'prioritized' if FLAGS.prioritized else 'uniform'}")
  base = bench_unsharded(spec)
  rows = [dict(config="unsharded", shards=1, **base)]
  for n in [int(x) for x in FLAGS.devices.split(",")]:
    rows.append(dict(config="sharded", shards=n, **bench_sharded(spec, n)))
  print(f"{'config':>10} {'shards':>6} {'insert items/s':>15} {'sample items/s':>15} "
        f"{'global items/s':>15} {'insert ovh':>10} {'sample ovh':>10} {'global ovh':>10}")
  for r in rows:
    ins = FLAGS.insert_batch / r["insert_s"]
    smp = FLAGS.sample_batch / r["sample_s"]
    g = r.get("sample_global_s")
    r["insert_items_per_s"], r["sample_items_per_s"] = ins, smp
    r["insert_overhead"] = r["insert_s"] / base["insert_s"] - 1
    r["sample_overhead"] = r["sample_s"] / base["sample_s"] - 1
    if g:
      r["sample_global_items_per_s"] = FLAGS.sample_batch / g
      r["sample_global_overhead"] = g / base["sample_s"] - 1
    print(f"{r['config']:>10} {r['shards']:>6} {ins:>15,.0f} {smp:>15,.0f} "
          f"{(FLAGS.sample_batch / g) if g else float('nan'):>15,.0f} "
          f"{r['insert_overhead']:>+10.1%} {r['sample_overhead']:>+10.1%} "
          f"{r.get('sample_global_overhead', float('nan')):>+10.1%}")
  if FLAGS.out:
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump(dict(jax=jax.__version__, platform=jax.devices()[0].platform,
                     flags={k: FLAGS[k].value for k in ("capacity", "obs_dim", "insert_batch",
                                                         "sample_batch", "steps", "repeats",
                                                         "prioritized")},
                     rows=rows), f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
