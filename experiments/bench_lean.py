"""Lean portable programs vs the current portable programs vs flashbax, inside ``lax.scan``.

CPU, native kernels off, flashbax 0.1.3 in the same scan, capacity 262,144,
the 524-byte transition of ``bench_core``, every sampled leaf consumed (so
XLA keeps every gather). Cases (K steps per jitted scan call):

- ``insert b16 + uniform sample b256`` per step (ours: without replacement);
- ``insert b1`` per step;
- ``prioritized sample b256 + update_priorities`` per step (write-back of
  ``|reward| + 0.01``; ours without replacement, flashbax with).

Runners are measured round-robin (``--rounds`` rounds), medians reported, with
the ratio ``flashbax seconds / ours seconds`` (> 1: ours faster). ``--hlo``
also prints the operation counts of the compiled uniform sample b256.

  PYTHONPATH=. python experiments/bench_lean.py --rounds=5
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments.bench_core import _example, _Holder, _measure, _use, transitions  # noqa: E402
from funcreplay.core import hlo  # noqa: E402
from funcreplay.core.ops import insert_lean as lean_insert  # noqa: E402
from funcreplay.core.ops import priorities_lean as lean_update  # noqa: E402
from funcreplay.core.sampling import prioritized_lean as lean_prio  # noqa: E402
from funcreplay.core.sampling import uniform_lean as lean_uniform  # noqa: E402

CAPACITY = 1 << 18
STEPS = 50
INS, SMP = 16, 256


class Lean:
  """The lean programs behind the ``make_table`` method names the benchmark calls."""

  def __init__(self, spec, ring=False):
    self.spec, self.ring = spec, ring
    self.init = fr.make_table(spec, native=False).init

  def insert(self, s, x, version=0):
    return lean_insert.insert(self.spec, s, x, version=version)

  def sample(self, s, key, *, batch_size, replace=False):
    if self.spec.prioritized:
      return lean_prio.sample(self.spec, s, key, batch_size=batch_size, replace=replace)
    return lean_uniform.sample(self.spec, s, key, batch_size=batch_size, replace=replace,
                               ring=self.ring)

  def update_priorities(self, s, slots, keys, p):
    return lean_update.update_priorities(self.spec, s, slots, keys, p)


def _filled(t, fill):
  ins = jax.jit(lambda s, x: t.insert(s, x), donate_argnums=0)
  h = _Holder(t.init())
  for c in fill:
    h.state = ins(h.state, c)
  return h


def _fbx_filled(buf, fill):
  add = jax.jit(buf.add, donate_argnums=0)
  h = _Holder(buf.init(_example()))
  for c in fill:
    h.state = add(h.state, c)
  return h


def uniform_runners(tables, fbx, fill, xs16, xs1, target_s):
  runners = {}

  def scan_fn(t):
    def f(s, i0, xs):
      def body(c, x):
        s, acc, v = c
        s = t.insert(s, x)
        s, smp = t.sample(s, jax.random.PRNGKey(v), batch_size=SMP)
        return (s, acc + _use(smp.data), v + 1), None
      (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
      return s, acc
    return f

  def ins_fn(t):
    def f(s, i0, xs):
      s, _ = jax.lax.scan(lambda s, x: (t.insert(s, x), None), s, xs)
      return s, None
    return f

  for name, t in tables.items():
    h = _filled(t, fill)
    runners[f"{name} scan"] = h.runner(jax.jit(scan_fn(t), donate_argnums=0), xs16,
                                       target_s=target_s)
    runners[f"{name} insert1"] = h.runner(jax.jit(ins_fn(t), donate_argnums=0), xs1,
                                          target_s=target_s)
  buf = fbx.make_item_buffer(max_length=CAPACITY, min_length=1, sample_batch_size=SMP,
                             add_batches=True)
  h = _fbx_filled(buf, fill)

  def fscan(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s = buf.add(s, x)
      return (s, acc + _use(buf.sample(s, jax.random.PRNGKey(v)).experience), v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc

  def fins(s, i0, xs):
    s, _ = jax.lax.scan(lambda s, x: (buf.add(s, x), None), s, xs)
    return s, None

  runners["flashbax scan"] = h.runner(jax.jit(fscan, donate_argnums=0), xs16, target_s=target_s)
  runners["flashbax insert1"] = h.runner(jax.jit(fins, donate_argnums=0), xs1, target_s=target_s)
  return runners


def prioritized_runners(tables, fbx, fill, target_s):
  runners = {}

  def step_fn(t):
    def f(s, i0):
      def body(c, _):
        s, acc, v = c
        s, smp = t.sample(s, jax.random.PRNGKey(v), batch_size=SMP)
        s = t.update_priorities(s, smp.info.slot, smp.info.key,
                                jnp.abs(smp.data["reward"]) + 0.01)
        return (s, acc + _use((smp.data, smp.info.probability)), v + 1), None
      (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), None,
                                    length=STEPS)
      return s, acc
    return f

  for name, t in tables.items():
    h = _filled(t, fill)
    runners[f"{name} prio"] = h.runner(jax.jit(step_fn(t), donate_argnums=0), target_s=target_s)
  buf = fbx.make_prioritised_item_buffer(max_length=CAPACITY, min_length=1, sample_batch_size=SMP,
                                         add_batches=True, priority_exponent=0.6, device="cpu")
  h = _fbx_filled(buf, fill)

  def fprio(s, i0):
    def body(c, _):
      s, acc, v = c
      smp = buf.sample(s, jax.random.PRNGKey(v))
      s = buf.set_priorities(s, smp.indices, jnp.abs(smp.experience["reward"]) + 0.01)
      return (s, acc + _use((smp.experience, smp.probabilities)), v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), None, length=STEPS)
    return s, acc

  runners["flashbax prio"] = h.runner(jax.jit(fprio, donate_argnums=0), target_s=target_s)
  return runners


def hlo_counts(fbx):
  """Operation counts of the compiled uniform sample b256: lean, current portable, flashbax."""
  spec = fr.TableSpec(CAPACITY, _example())
  t = fr.make_table(spec, native=False)
  st, key = t.init(), jax.random.PRNGKey(0)
  buf = fbx.make_item_buffer(max_length=CAPACITY, min_length=1, sample_batch_size=SMP,
                             add_batches=True)
  pspec = spec.replace(sampler=fr.Prioritized(0.6))
  pt = fr.make_table(pspec, native=False)
  return {
      "lean uniform": hlo.counts(lambda s, k: lean_uniform.sample(spec, s, k, batch_size=SMP),
                                 st, key, donate_argnums=0),
      "portable uniform": hlo.counts(lambda s, k: t.sample(s, k, batch_size=SMP), st, key,
                                     donate_argnums=0),
      "flashbax uniform": hlo.counts(lambda s, k: (s, buf.sample(s, k).experience),
                                     buf.init(_example()), key, donate_argnums=0),
      "lean prioritized": hlo.counts(lambda s, k: lean_prio.sample(pspec, s, k, batch_size=SMP),
                                     pt.init(), key, donate_argnums=0),
      "portable prioritized": hlo.counts(lambda s, k: pt.sample(s, k, batch_size=SMP),
                                         pt.init(), key, donate_argnums=0),
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--target_s", type=float, default=0.15)
  ap.add_argument("--cases", default="uniform,prioritized")
  ap.add_argument("--hlo", action="store_true")
  ap.add_argument("--no_portable", action="store_true")
  ap.add_argument("--ring", action="store_true", help="also lean with ring slots (no holes)")
  a = ap.parse_args()
  import flashbax as fbx
  chunk = jax.device_put(transitions(1 << 14, seed=1))
  fill = [chunk] * (CAPACITY // (1 << 14))
  steps = transitions(STEPS * INS, seed=3)
  xs16 = jax.device_put({k: v.reshape((STEPS, INS) + v.shape[1:]) for k, v in steps.items()})
  xs1 = jax.device_put({k: v[:STEPS, None] for k, v in steps.items()})
  print(f"capacity {CAPACITY:,}, jax {jax.__version__}, {STEPS} steps per scan, "
        f"{a.rounds} interleaved rounds (medians)")
  if a.hlo:
    for k, v in hlo_counts(fbx).items():
      print(f"HLO {k:<22} {v}")
  for case in a.cases.split(","):
    spec = fr.TableSpec(CAPACITY, _example())
    if case == "prioritized":
      spec = spec.replace(sampler=fr.Prioritized(0.6))
    tables = {"lean": Lean(spec)}
    if case == "uniform" and a.ring:  # what an O(1) position -> slot map would give
      tables["lean-ring"] = Lean(spec, ring=True)
    if not a.no_portable:
      tables["portable"] = fr.make_table(spec, native=False)
    if case == "uniform":
      runners = uniform_runners(tables, fbx, fill, xs16, xs1, a.target_s)
      kinds = ("scan", "insert1")
    else:
      runners = prioritized_runners(tables, fbx, fill, a.target_s)
      kinds = ("prio",)
    secs = _measure(runners, a.rounds)
    for kind in kinds:
      f = secs[f"flashbax {kind}"]
      for name in tables:
        s = secs[f"{name} {kind}"]
        spread = np.ptp(runners[f"{name} {kind}"].times) / s
        print(f"{case:<12} {kind:<8} {name:<9} {s / STEPS * 1e6:9.1f} us/step  flashbax "
              f"{f / STEPS * 1e6:9.1f} us/step  ratio {f / s:5.2f}x  (spread {spread:.0%})")
    del runners


if __name__ == "__main__":
  main()
