"""The kernels of a scan step on a real GPU, read from JAX's profiler trace.

``accel_hlo.py`` counts the kernels of issue 25's in-scan programs without a GPU (a
deviceless compile for an H200, BUILD.md finding 27); ``bench_scan.py --platform=gpu``
times them. This reads what the GPU ran in between: each program (the same
``scan_steps`` programs, ours and flashbax's, on a full table of ``CAPACITY`` slots) runs
once under ``jax.profiler.trace``, and the device's events in the trace (one per kernel,
memcpy or memset on a CUDA stream) are counted. Per step: the events of one
``STEPS``-step call divided by ``STEPS`` (the call's few entry and exit kernels are
spread over the steps, < 0.1 a step), and their summed GPU time (busy time: the gaps
between kernels, the launch cost the step's wall time adds, are not in it). Then the
kernels that took most of our uniform step's time, by name.

  PYTHONPATH=. python experiments/gpu_profile.py            # on a machine with a GPU
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments import scan_steps  # noqa: E402
from experiments.scan_steps import INS, SMP, STEPS  # noqa: E402
from experiments.timing import example, transitions  # noqa: E402

CAPACITY = 1 << 18  # bench_scan.CAPACITY
FILL_CHUNK = 1 << 14
TOP = 25  # kernels listed for a program


def device_events(trace_dir: str, device: str) -> list:
  """``(thread name, event name, microseconds)`` of every complete event that a process
  named like ``device`` (e.g. ``/device:GPU:0``) recorded in the newest trace under
  ``trace_dir``; the threads' names tell streams from derived lines (printed by ``main``)."""
  path = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                          recursive=True))[-1]
  with gzip.open(path) as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  procs = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
           and device in e["args"]["name"]}
  threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  return [(threads.get((e["pid"], e.get("tid")), "?"), e["name"], float(e.get("dur", 0)))
          for e in events if e.get("ph") == "X" and e["pid"] in procs]


def profile(fn, state, *args, device: str):
  """Run the jitted ``fn(state, *args)`` once to compile and warm, then once traced;
  returns the device events of the traced call."""
  jitted = jax.jit(fn, donate_argnums=0)
  state, _ = jax.block_until_ready(jitted(state, *args))
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      state, _ = jax.block_until_ready(jitted(state, *args))
    return device_events(d, device)


def filled(insert, state):
  ins = jax.jit(insert, donate_argnums=0)
  chunk = jax.device_put(transitions(FILL_CHUNK, seed=1))
  for _ in range(CAPACITY // FILL_CHUNK):
    state = ins(state, chunk)
  return state


def programs():
  """``{name: (fn, make_state, *args)}``: ours (portable programs) and flashbax's."""
  import flashbax as fbx
  steps = transitions(STEPS * INS, seed=3)
  xs16 = jax.device_put({k: v.reshape((STEPS, INS) + v.shape[1:]) for k, v in steps.items()})
  xs1 = jax.device_put({k: v[:STEPS, None] for k, v in steps.items()})
  i0 = jnp.int32(7)
  spec = fr.TableSpec(CAPACITY, example())
  out = {}
  buf = fbx.make_item_buffer(max_length=CAPACITY, min_length=1, sample_batch_size=SMP,
                             add_batches=True)
  for name, t in (("ours", fr.make_table(spec, native=False)),
                  ("ours holes=False", fr.make_table(spec.replace(holes=False), native=False))):
    st = scan_steps.table_uniform_steps(t)
    make = lambda t=t: filled(t.insert, t.init())  # noqa: E731
    out[f"{name} | insert 16 + uniform 256"] = (st["scan"], make, i0, xs16)
    out[f"{name} | insert 1"] = (st["insert1"], make, i0, xs1)
  fst = scan_steps.flashbax_uniform_steps(buf)
  fmake = lambda: filled(buf.add, buf.init(example()))  # noqa: E731
  out["flashbax | insert 16 + uniform 256"] = (fst["scan"], fmake, i0, xs16)
  out["flashbax | insert 1"] = (fst["insert1"], fmake, i0, xs1)
  pt = fr.make_table(spec.replace(sampler=fr.Prioritized(0.6)), native=False)
  out["ours | prioritized 256 + update"] = (scan_steps.table_prioritized_step(pt),
                                            lambda: filled(pt.insert, pt.init()), i0)
  pbuf = fbx.make_prioritised_item_buffer(max_length=CAPACITY, min_length=1,
                                          sample_batch_size=SMP, add_batches=True,
                                          priority_exponent=0.6, device="gpu")
  out["flashbax | prioritized 256 + update"] = (
      scan_steps.flashbax_prioritized_step(pbuf),
      lambda: filled(pbuf.add, pbuf.init(example())), i0)
  return out


def main(argv):
  del argv
  from absl import flags
  device = flags.FLAGS.device
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, capacity {CAPACITY:,}, "
        f"{STEPS} steps a call; per step: device events / {STEPS}, their summed time")
  summary = []
  for name, (fn, make, *args) in programs().items():
    if flags.FLAGS.only and flags.FLAGS.only not in name:
      continue
    events = profile(fn, make(), *args, device=device)
    by_thread = collections.Counter(th for th, _, _ in events)
    print(f"\n== {name}: device events by thread: {dict(by_thread)}")
    # The streams' events are the device's work; the other lines of the device's process
    # (XLA Ops, XLA Modules, ...) are derived from them and would count each twice.
    work = [e for e in events if e[0].startswith("Stream")] or events
    per = collections.defaultdict(lambda: [0, 0.0])
    for _, ev, us in work:
      per[ev][0] += 1
      per[ev][1] += us
    n, us = len(work) / STEPS, sum(u for _, _, u in work) / STEPS
    summary.append((name, n, us))
    print(f"   {n:.2f} events a step, {us:.2f} us of GPU time a step")
    for ev, (c, u) in sorted(per.items(), key=lambda kv: -kv[1][1])[:TOP]:
      print(f"   {c / STEPS:6.2f}/step {u / STEPS:8.2f} us/step  {ev[:100]}")
  print("\nsummary (events a step, GPU time a step):")
  for name, n, us in summary:
    print(f"  {name:<40} {n:7.2f}  {us:9.2f} us")


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("device", "/device:GPU:0", "the trace's process of the device")
  flags.DEFINE_string("only", "", "profile only the programs whose name holds this")
  app.run(main)
