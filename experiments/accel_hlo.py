"""Issue 25's in-scan programs compiled for a GPU and a TPU on a machine with neither.

JAX compiles for an accelerator it does not have: a PJRT topology made from a
description of the device (``jax.experimental.topologies``, "deviceless" ahead-of-time
compilation) needs only the backend's compiler (the CUDA plugin and ``ptxas``; libtpu),
and nothing runs. The loop body of a step's optimized HLO is then what the device runs
each step:

- **H200** (XLA:GPU): every fusion, copy or sort of the step is a kernel, and on an H100 /
  H200 each costs ~1 us whatever its work (BUILD.md "On XLA:GPU": the first GPU
  session's profile, whose 37-38 kernels this count matched). So the count is the GPU's
  lever; times still need a GPU (``bench_scan.py --platform=gpu``).
- **TPU v5e** (XLA:TPU): the step's operations, and the sum of XLA:TPU's own cost-model
  estimate of each (``estimated_cycles`` in its backend config): the compiler's forecast,
  not a measurement.

Counted for ours (portable programs) and flashbax's, the same programs ``bench_scan.py``
times (``scan_steps``), with the big copies (a buffer copied whole; those in the entry,
once a call, are layout changes at the program's edges) of each whole program. BUILD.md
findings 27 and 28.

The plugins make JAX look for devices, so they live in a venv of their own (``make
accel-hlo`` builds ``.venv-accel-hlo`` and runs this); run there:

  python experiments/accel_hlo.py --show --targets=h200
"""

from __future__ import annotations

import os
import re
import sys

# Before jax: JAX's own backend stays the CPU (the CUDA plugin then skips its search for
# CUDA libraries and a device), and the plugin registers without cuDNN (nothing runs).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments import bench_scan_queue as queue  # noqa: E402
from experiments import scan_steps  # noqa: E402
from experiments.timing import example  # noqa: E402
from funcreplay.core import hlo  # noqa: E402

CAPACITY = 1 << 18  # bench_scan.CAPACITY
# The device description (xla's GpuTargetConfig, text format). What XLA:GPU's fusion and
# scheduling read: the compute capability, core and memory figures of an H200 (the GPU of
# the first GPU session's figures).
H200 = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 4800000000000 l2_cache_size: 52428800
  clock_rate_ghz: 1.98 device_memory_size: 150000000000
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 10 }
runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H200"
"""
# Deviceless topologies: (platform, keyword arguments of get_topology_desc).
TARGETS = {
    "h200": ("cuda", dict(target_config=H200, topology="1x1x1")),
    "v5e": ("tpu", dict(topology_name="v5e:2x2")),  # one chip of it is used
}
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')


class Target:
  """Compiles jitted functions for one accelerator that is not there (``TARGETS``)."""

  def __init__(self, name: str):
    from jax.experimental import topologies
    platform, kwargs = TARGETS[name]
    topo = topologies.get_topology_desc(platform=platform, **kwargs)
    mesh = jax.sharding.Mesh(topo.devices[:1], ("x",))
    self.sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def text(self, fn, *shapes) -> str:
    """Optimized HLO of ``jax.jit(fn, donate_argnums=0)`` for ``shapes`` (pytrees of
    arrays or shape structs)."""
    specs = [jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.sharding), x)
        for x in shapes]
    return jax.jit(fn, donate_argnums=0).lower(*specs).compile().as_text()


def step_estimated_cycles(text: str) -> int:
  """The sum of XLA:TPU's ``estimated_cycles`` over the scan step's operations (0 on
  backends that give none)."""
  body = re.search(r"while\(.*?body=%([\w.\-]+)", hlo.entry(text)).group(1)
  comp = re.search(r"^%" + re.escape(body) + r" .*?^}", text, re.S | re.M).group(0)
  return sum(int(c) for c in _CYCLES.findall(comp))


def programs(fbx, device: str = "gpu"):
  """``{case: (ours, flashbax's)}``, each ``(fn, state, *args)``; ``device``: flashbax's
  (it picks its sum-tree update by it)."""
  spec = fr.TableSpec(CAPACITY, example())
  item = jax.tree_util.tree_map(jnp.asarray, example())
  rows = lambda *lead: jax.tree_util.tree_map(  # noqa: E731
      lambda v: jax.ShapeDtypeStruct(lead + v.shape, v.dtype), item)
  xs16, xs1 = rows(scan_steps.STEPS, scan_steps.INS), rows(scan_steps.STEPS, 1)
  buf = fbx.make_item_buffer(max_length=CAPACITY, min_length=1,
                             sample_batch_size=scan_steps.SMP, add_batches=True)
  fstate = jax.eval_shape(lambda: buf.init(example()))
  i0 = jax.ShapeDtypeStruct((), jnp.int32)  # the first step's key
  out = {}
  variants = (("", spec), (", holes=False", spec.replace(holes=False)),
              (", position_index=True", spec.replace(position_index=True)))
  for label, s in variants:
    t = fr.make_table(s, native=False)
    ours, theirs = scan_steps.table_uniform_steps(t), scan_steps.flashbax_uniform_steps(buf)
    state = jax.eval_shape(t.init)
    cases = (("insert 16 + uniform sample 256", "scan", xs16),
             ("uniform sample 256 + insert 16", "smp-ins", xs16), ("insert 1", "insert1", xs1))
    # The other tables: the step with the sample, and the index's one-row insert (it appends).
    picked = (cases if not label else cases[::2] if s.position_index else cases[:1])
    for case, kind, xs in picked:
      out[case + label] = ((ours[kind], state, i0, xs), (theirs[kind], fstate, i0, xs))
  pt = fr.make_table(spec.replace(sampler=fr.Prioritized(0.6)), native=False)
  # flashbax picks its sum-tree update by device (a bincount on "gpu" and "tpu"), after
  # checking that JAX has such a device; the program is compiled for one, so its choice.
  from flashbax.buffers import prioritised_item_buffer, prioritised_trajectory_buffer
  for module in (prioritised_item_buffer, prioritised_trajectory_buffer):
    module.validate_device = lambda device: True
  pbuf = fbx.make_prioritised_item_buffer(max_length=CAPACITY, min_length=1,
                                          sample_batch_size=scan_steps.SMP, add_batches=True,
                                          priority_exponent=0.6, device=device)
  # Reverb's queue (bench_scan_queue.py: C = 65,536, take 64 then insert 64 a step).
  qxs = rows(queue.STEPS, queue.BATCH)
  fq = queue.flashbax_queue(fbx)
  qstate = jax.eval_shape(lambda: fq.init(example()))
  for label, holes in (("", True), (", holes=False", False)):
    qt = fr.make_table(fr.queue(queue.CAPACITY, example(), holes=holes), native=False)
    out["queue (C = 65,536) take 64 + insert 64" + label] = (
        (queue.table_step(qt, False), jax.eval_shape(qt.init), i0, qxs),
        (queue.flashbax_step(fq, False), qstate, i0, qxs))
  out["prioritized sample 256 + update"] = (
      (scan_steps.table_prioritized_step(pt), jax.eval_shape(pt.init), i0),
      (scan_steps.flashbax_prioritized_step(pbuf), jax.eval_shape(lambda: pbuf.init(example())),
       i0))
  return out


def main(argv):
  del argv
  import flashbax as fbx
  from absl import flags
  show = flags.FLAGS.show
  for name in flags.FLAGS.targets.split(","):
    target = Target(name)
    tpu = TARGETS[name][0] == "tpu"
    print(f"{name}: operations a step (deviceless compile, jax {jax.__version__}), capacity "
          f"{CAPACITY:,}; ratio: ours / flashbax"
          + ("; cycles: XLA:TPU's estimate for a step" if tpu else ""))
    for case, pair in programs(fbx, "tpu" if tpu else "gpu").items():
      counted = []
      for fn, *shapes in pair:
        text = target.text(fn, *shapes)
        counted.append((hlo.scan_step_ops(text), hlo.text_counts(text),
                        step_estimated_cycles(text)))
      (ops, c, cyc), (fops, fc, fcyc) = counted
      n, fn_ = len(ops), len(fops)
      # Loops inside a step (beside the scan's own): each runs its body's ops per trip.
      print(f"  {case:<52} ours {n:3d}  flashbax {fn_:3d}  ratio {n / fn_:4.2f}  "
            + (f"cycles {cyc:,} / {fcyc:,} ({cyc / fcyc:.2f})  " if tpu else "")
            + f"conditionals {c['conditional']} / {fc['conditional']}  "
            f"loops in a step {c['while'] - 1} / {fc['while'] - 1}  "
            f"big copies {c['big_copies']} / {fc['big_copies']}")
      if show:
        for who, listed in (("ours", ops), ("flashbax", fops)):
          print(f"    {who}:", *(f"      {o:<8} {shape[:44]:<44} {nm}"
                                 for o, shape, nm in listed), sep="\n")


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_bool("show", False, "list each program's loop-body operations")
  flags.DEFINE_string("targets", "h200,v5e", f"comma-separated, of {sorted(TARGETS)}")
  app.run(main)
