"""Kernels a step of issue 25's in-scan programs on XLA:GPU, counted without a GPU.

JAX compiles for a GPU it does not have: a PJRT topology made from a description of the
device (``jax.experimental.topologies``, "deviceless" ahead-of-time compilation) needs
only the CUDA plugin and ``ptxas``, and nothing runs. The loop body of a step's optimized
HLO is then what the GPU launches each step: every fusion, copy, sort or custom call a
kernel, and on an H100 / H200 each costs ~1 us whatever its work (BUILD.md "On XLA:GPU":
the profile of the first GPU session). So the count is the GPU's lever, measured on any
machine; times still need a GPU (``bench_scan.py --platform=gpu``).

Counted for ours (portable programs) and flashbax's, the same programs ``bench_scan.py``
times (``scan_steps``), with the big copies (a donated buffer not updated in place) of
each whole program.

The CUDA plugin makes JAX look for a GPU, so it lives in a venv of its own (``make
gpu-hlo`` builds ``.venv-gpu-hlo`` and runs this); run there:

  JAX_PLATFORMS=cpu JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python experiments/gpu_hlo.py --show
"""

from __future__ import annotations

import os
import sys

# Before jax: JAX's own backend stays the CPU (the plugin then skips its search for CUDA
# libraries and a device), and the plugin registers without cuDNN (nothing runs).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
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
class Target:
  """Compiles jitted functions for one GPU that is not there."""

  def __init__(self, config: str = H200):
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(platform="cuda", target_config=config,
                                        topology="1x1x1")
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    self.sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def text(self, fn, *shapes) -> str:
    """Optimized HLO of ``jax.jit(fn, donate_argnums=0)`` for ``shapes`` (pytrees of
    arrays or shape structs)."""
    specs = [jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.sharding), x)
        for x in shapes]
    return jax.jit(fn, donate_argnums=0).lower(*specs).compile().as_text()


def programs(fbx):
  """``{case: (ours, flashbax's)}``, each ``(fn, state, *args)``."""
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
  for label, s in (("", spec), (", holes=False", spec.replace(holes=False))):
    t = fr.make_table(s, native=False)
    ours, theirs = scan_steps.table_uniform_steps(t), scan_steps.flashbax_uniform_steps(buf)
    state = jax.eval_shape(t.init)
    cases = (("insert 16 + uniform sample 256", "scan", xs16),
             ("uniform sample 256 + insert 16", "smp-ins", xs16), ("insert 1", "insert1", xs1))
    for case, kind, xs in cases[:1] if label else cases:
      out[case + label] = ((ours[kind], state, i0, xs), (theirs[kind], fstate, i0, xs))
  pt = fr.make_table(spec.replace(sampler=fr.Prioritized(0.6)), native=False)
  # flashbax picks its sum-tree update by device ("gpu": a bincount), after checking that
  # JAX has such a device; the program is compiled for a GPU, so its GPU choice.
  from flashbax.buffers import prioritised_item_buffer, prioritised_trajectory_buffer
  for module in (prioritised_item_buffer, prioritised_trajectory_buffer):
    module.validate_device = lambda device: True
  pbuf = fbx.make_prioritised_item_buffer(max_length=CAPACITY, min_length=1,
                                          sample_batch_size=scan_steps.SMP, add_batches=True,
                                          priority_exponent=0.6, device="gpu")
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
  target = Target()
  print(f"XLA:GPU kernels a step (deviceless compile for an H200, jax {jax.__version__}), "
        f"capacity {CAPACITY:,}; ratio: ours / flashbax")
  for case, pair in programs(fbx).items():
    counted = []
    for fn, *shapes in pair:
      text = target.text(fn, *shapes)
      counted.append((hlo.scan_step_ops(text), hlo.text_counts(text)))
    (ops, c), (fops, fc) = counted
    n, fn_ = len(ops), len(fops)
    # Loops inside a step (beside the scan's own): each runs its body's kernels per trip.
    print(f"{case:<44} ours {n:3d}  flashbax {fn_:3d}  ratio {n / fn_:4.2f}  "
          f"conditionals {c['conditional']} / {fc['conditional']}  "
          f"loops in a step {c['while'] - 1} / {fc['while'] - 1}  "
          f"big copies {c['big_copies']} / {fc['big_copies']}")
    if show:
      for who, listed in (("ours", ops), ("flashbax", fops)):
        print(f"  {who}:", *(f"    {o:<8} {shape[:44]:<44} {name}" for o, shape, name in listed),
              sep="\n")


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_bool("show", False, "list each program's loop-body operations")
  app.run(main)
