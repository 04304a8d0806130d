"""Issue 25's in-scan cases: funcreplay portable and native vs flashbax inside ``lax.scan``.

CPU, flashbax 0.1.3 in the same scan, capacity 262,144, the 524-byte
transition of ``bench_core``, every sampled leaf consumed (so XLA keeps every
gather). Cases (K steps per jitted scan call):

- ``insert b16 + uniform sample b256`` per step (ours: without replacement);
- ``smp-ins``: the same in the other order, ``uniform sample b256 + insert b16`` (the
  sample's reads before the insert's in-place writes: ``uniform_lean.finish``);
- ``insert b1`` per step (``insert1``: 50-step scans; ``insert1-1k``: 1000-step scans,
  the per-step cost inside the loop without the per-call cost spread over 50 steps);
- ``prioritized sample b256 + update_priorities`` per step (write-back of
  ``|reward| + 0.01``; ours without replacement, flashbax with);
- ``prioritized-small`` (not run by default): the same with batches of 8 and 32;
- ``removers`` (not run by default, ``bench_scan_removers.py``): insert 16 + prioritized
  sample 64 + update a step into a full table with each of Reverb's removers;
- ``queue`` (not run by default, ``bench_scan_queue.py``): Reverb's queue, take the 64
  oldest + insert 64 a step, against flashbax's trajectory queue;
- ``ordered`` (not run by default, ``bench_scan_ordered.py``): Reverb's stack, a min-heap
  and a stalest-first table, insert 64 + sample 64 a step, against the sort of every
  slot that these samplers ran before (no JAX library has them).

Ours: ``make_table(spec, native=False)`` (the portable programs; the lean ones
where they apply, BUILD.md "Lean portable programs") and ``native=True`` (the
CPU kernels). ``--reuse=N`` adds a portable table with ``max_times_sampled=N`` to the
uniform case (its sample frees the items it uses up; flashbax has no reuse limit, so
its step does less). ``--ring`` adds tables without holes (``TableSpec(holes=False)``:
no delete, eviction or reuse limit, like a flashbax buffer; the uniform sample maps a
position to its slot by ring arithmetic, BUILD.md finding 23), portable and native.
``--replace`` adds the uniform case sampled *with* replacement (``replace=True``, flashbax's
semantics: no draw without replacement to resolve), portable and native, next to the
default rows, which sample without. ``--index`` adds tables that keep a position index, portable and
native (``TableSpec(position_index=True)``: the uniform sample maps a position to its slot
with one gather, holes allowed; BUILD.md finding 36), and with ``--reuse=N`` one with that
reuse limit too (its freed items leave holes).

``--platform`` (default: JAX's default backend) runs the same cases on a GPU or
TPU: flashbax's prioritised buffer is then built with its ``device=`` for that
backend, and the ``native`` rows (CPU kernels; elsewhere ``native=True`` runs
the portable programs) are left out. Nothing in the portable programs is
CPU-only (no host callbacks, no CPU custom calls of ours).

Runners are measured round-robin (``--rounds`` rounds), medians reported, with
the ratio ``flashbax seconds / ours seconds`` (> 1: ours faster), and the same
ratio of process CPU time (all threads): on a shared, loaded machine the wall
ratio of one run moves by 2x (other processes preempt the 2 XLA threads at
random), the CPU-time ratio much less. ``--hlo``
prints the operation counts of the compiled programs (``funcreplay.core.hlo``).
``python experiments/bench_core.py --scan`` runs this too.

  PYTHONPATH=. python experiments/bench_scan.py --rounds=5 --hlo
  PYTHONPATH=. python experiments/bench_scan.py --platform=gpu   # make bench-scan PLATFORM=gpu
"""

from __future__ import annotations

import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments import bench_scan_ordered as ordered  # noqa: E402
from experiments import bench_scan_queue as queue  # noqa: E402
from experiments import bench_scan_removers as removers  # noqa: E402
from experiments import scan_steps  # noqa: E402
from experiments.scan_steps import INS, SMP, STEPS  # noqa: E402
from experiments.timing import Holder, example, measure, transitions  # noqa: E402
from funcreplay.core import hlo, ops  # noqa: E402

CAPACITY = 1 << 18
FILL_CHUNK = 1 << 14  # rows per insert while filling (CAPACITY a multiple of it)
# ``insert1-1k``: the one-item insert in a 1000-step scan as well. A call has a fixed cost
# (dispatch of the state's buffers, the loop's entry) that 50 steps of ~1 us do not hide;
# 1000 steps show the per-step cost inside the loop, where a training step runs.
LONG_STEPS = 1000
# ``prioritized-small``: the batches of a small learner (or one that samples often), where
# the step's fixed costs show (BUILD.md finding 14: a hidden copy of the weight tree cost
# 4.5x there, invisible at 256).
SMALL_BATCHES = (8, 32)


def _filled(t, fill):
  ins = jax.jit(lambda s, x: t.insert(s, x), donate_argnums=0)
  h = Holder(t.init())
  for c in fill:
    h.state = ins(h.state, c)
  return h


def _fbx_filled(buf, fill):
  add = jax.jit(buf.add, donate_argnums=0)
  h = Holder(buf.init(example()))
  for c in fill:
    h.state = add(h.state, c)
  return h


def uniform_runners(tables, fbx, fill, xs16, xs1, target_s, xs1_long, replace=()):
  """The uniform case's runners; the tables named in ``replace`` sample with replacement."""
  runners = {}

  def add(name, h, steps):
    runners[f"{name} scan"] = h.runner(jax.jit(steps["scan"], donate_argnums=0), xs16,
                                       target_s=target_s)
    runners[f"{name} smp-ins"] = h.runner(jax.jit(steps["smp-ins"], donate_argnums=0), xs16,
                                          target_s=target_s)
    if name in replace:  # their inserts are the programs of the tables without ``replace``
      return
    runners[f"{name} insert1"] = h.runner(jax.jit(steps["insert1"], donate_argnums=0), xs1,
                                          target_s=target_s)
    runners[f"{name} insert1-1k"] = h.runner(jax.jit(steps["insert1"], donate_argnums=0),
                                             xs1_long, target_s=target_s)

  for name, t in tables.items():
    add(name, _filled(t, fill), scan_steps.table_uniform_steps(t, replace=name in replace))
  buf = fbx.make_item_buffer(max_length=CAPACITY, min_length=1, sample_batch_size=SMP,
                             add_batches=True)
  add("flashbax", _fbx_filled(buf, fill), scan_steps.flashbax_uniform_steps(buf))
  return runners


def prioritized_runners(tables, fbx, fill, target_s, platform="cpu", batch=SMP):
  """``prio`` (``batch`` = 256) or ``prio<batch>``: prioritized sample + update a step."""
  runners, kind = {}, _prio_kind(batch)
  for name, t in tables.items():
    h = _filled(t, fill)
    runners[f"{name} {kind}"] = h.runner(
        jax.jit(scan_steps.table_prioritized_step(t, batch), donate_argnums=0),
        target_s=target_s)
  buf = fbx.make_prioritised_item_buffer(max_length=CAPACITY, min_length=1,
                                         sample_batch_size=batch,
                                         add_batches=True, priority_exponent=0.6,
                                         device=platform)
  h = _fbx_filled(buf, fill)
  runners[f"flashbax {kind}"] = h.runner(
      jax.jit(scan_steps.flashbax_prioritized_step(buf), donate_argnums=0), target_s=target_s)
  return runners


def _prio_kind(batch):
  return "prio" if batch == SMP else f"prio{batch}"


def hlo_counts(fbx):
  """Operation counts of the compiled programs, ours (portable) and flashbax's."""
  spec = fr.TableSpec(CAPACITY, example())
  t = fr.make_table(spec, native=False)
  st, key = t.init(), jax.random.PRNGKey(0)
  buf = fbx.make_item_buffer(max_length=CAPACITY, min_length=1, sample_batch_size=SMP,
                             add_batches=True)
  pspec = spec.replace(sampler=fr.Prioritized(0.6))
  pt = fr.make_table(pspec, native=False)
  nt = fr.make_table(spec.replace(holes=False), native=False)
  x16 = jax.tree_util.tree_map(jnp.asarray, transitions(INS))
  x1 = jax.tree_util.tree_map(lambda a: a[:1], x16)
  # The general insert (what ``insert`` runs with a mask): a comparison point.
  general_insert = lambda s, x: ops.insert(spec, s, x, mask=jnp.ones((x["reward"].shape[0],),  # noqa: E731
                                                                      bool))
  return {
      "uniform sample b256": hlo.counts(lambda s, k: t.sample(s, k, batch_size=SMP), st, key,
                                        donate_argnums=0),
      "uniform sample b256, holes=False": hlo.counts(
          lambda s, k: nt.sample(s, k, batch_size=SMP), st, key, donate_argnums=0),
      "flashbax uniform sample b256": hlo.counts(lambda s, k: (s, buf.sample(s, k).experience),
                                                 buf.init(example()), key, donate_argnums=0),
      "prioritized sample b256": hlo.counts(lambda s, k: pt.sample(s, k, batch_size=SMP),
                                            pt.init(), key, donate_argnums=0),
      "insert b16": hlo.counts(t.insert, st, x16, donate_argnums=0),
      "insert b1": hlo.counts(t.insert, st, x1, donate_argnums=0),
      "general (masked) insert b16": hlo.counts(general_insert, st, x16, donate_argnums=0),
      "flashbax add b16": hlo.counts(buf.add, buf.init(example()), x16, donate_argnums=0),
  }


# The options of ``run`` and their defaults (the absl flags below, and ``bench_core --scan``).
OPTIONS = dict(rounds=5, target_s=0.15, cases="uniform,prioritized", hlo=False, ring=False,
               native=True, platform="", reuse=0, replace=False, index=False)


def start(**options):
  """``run`` with ``OPTIONS`` updated by ``options``; selects ``platform`` first (before any
  backend is initialised)."""
  unknown = set(options) - set(OPTIONS)
  if unknown:
    raise TypeError(f"bench_scan.start: unknown options {sorted(unknown)}; known: "
                    f"{sorted(OPTIONS)}.")
  a = types.SimpleNamespace(**{**OPTIONS, **options})
  if a.platform:
    jax.config.update("jax_platforms", a.platform)
  run(a)


def main(argv):
  del argv
  from absl import flags
  start(**{name: getattr(flags.FLAGS, name) for name in OPTIONS})


def run(a):
  """Print the HLO counts (``a.hlo``) and the in-scan ratios of ``a.cases``."""
  import flashbax as fbx
  chunk = jax.device_put(transitions(FILL_CHUNK, seed=1))
  fill = [chunk] * (CAPACITY // FILL_CHUNK)
  steps = transitions(STEPS * INS, seed=3)
  xs16 = jax.device_put({k: v.reshape((STEPS, INS) + v.shape[1:]) for k, v in steps.items()})
  xs1 = jax.device_put({k: v[:STEPS, None] for k, v in steps.items()})
  xs1_long = jax.device_put({k: v[:, None] for k, v in transitions(LONG_STEPS, seed=4).items()})
  platform = jax.default_backend()
  from importlib.metadata import version
  print(f"capacity {CAPACITY:,}, jax {jax.__version__}, flashbax {version('flashbax')}, "
        f"{platform} ({jax.devices()[0].device_kind}), {STEPS} steps per scan, "
        f"{a.rounds} interleaved rounds (medians)")
  if a.hlo:
    for k, v in hlo_counts(fbx).items():
      print(f"HLO {k:<30} {v}")
  for case in a.cases.split(","):
    spec = fr.TableSpec(CAPACITY, example())
    if case.startswith("prioritized"):
      spec = spec.replace(sampler=fr.Prioritized(0.6))
    if case == "removers":  # its own specs, capacity and peer (bench_scan_removers.py)
      print(f"removers: capacity {removers.CAPACITY:,}, {removers.STEPS} steps per scan")
      report(case, removers.runners(fbx, a.target_s, platform), removers.KINDS, a.rounds,
             removers.STEPS)
      continue
    if case == "queue":  # Reverb's queue against flashbax's (bench_scan_queue.py)
      print(f"queue: capacity {queue.CAPACITY:,}, {queue.STEPS} steps per scan")
      report(case, queue.runners(fbx, a.target_s), queue.KINDS, a.rounds, queue.STEPS)
      continue
    if case == "ordered":  # the deterministic samplers against their old sort
      print(f"ordered: capacity {ordered.CAPACITY:,}, {ordered.STEPS} steps per scan; "
            "peer: the sort of every slot they replaced")
      report(case, ordered.runners(a.target_s), ordered.KINDS, a.rounds, ordered.STEPS,
             peer="sort")
      continue
    tables = {"portable": fr.make_table(spec, native=False)}
    if platform == "cpu" and a.native:  # elsewhere native=True runs the portable programs
      tables["native"] = fr.make_table(spec, native=True)
    if case == "uniform" and a.ring:  # a table without holes: the ring map, no descent
      tables["noholes"] = fr.make_table(spec.replace(holes=False), native=False)
      if platform == "cpu" and a.native:
        tables["noholes-native"] = fr.make_table(spec.replace(holes=False), native=True)
    if case == "uniform" and a.reuse:  # Reverb's reuse limit: used-up items freed
      tables[f"reuse{a.reuse}"] = fr.make_table(spec.replace(max_times_sampled=a.reuse),
                                                native=False)
    if case == "uniform" and a.index:  # holes allowed, the position index instead of a descent
      tables["index"] = fr.make_table(spec.replace(position_index=True), native=False)
      if platform == "cpu" and a.native:
        tables["index-native"] = fr.make_table(spec.replace(position_index=True), native=True)
      if a.reuse:  # the reuse limit's freed items leave holes: the index's own case
        tables[f"index-reuse{a.reuse}"] = fr.make_table(
            spec.replace(position_index=True, max_times_sampled=a.reuse), native=False)
    replace = set()
    if case == "uniform" and a.replace:  # with replacement, as flashbax samples
      replace = {"replace"} | ({"replace-native"} if "native" in tables else set())
      for name in sorted(replace):
        tables[name] = fr.make_table(spec, native=name.endswith("native"))
    if case == "uniform":
      runners = uniform_runners(tables, fbx, fill, xs16, xs1, a.target_s, xs1_long, replace)
      kinds = ("scan", "smp-ins", "insert1", "insert1-1k")
    else:
      batches = SMALL_BATCHES if case == "prioritized-small" else (SMP,)
      runners = {}
      for b in batches:
        runners.update(prioritized_runners(tables, fbx, fill, a.target_s, platform, b))
      kinds = tuple(_prio_kind(b) for b in batches)
    report(case, runners, kinds, a.rounds, STEPS, tables, partial=replace)
    del runners


def report(case, runners, kinds, rounds, steps, names=None, peer="flashbax", partial=()):
  """Measure ``runners`` (``"<name> <kind>"``, ``"<peer> <kind>"`` the peer) round-robin
  and print each one's time a step and ratio to the peer (wall, and process CPU time).
  ``partial``: names that have runners for some of the kinds only."""
  secs = measure(runners, rounds)
  cpu = {k: float(np.median(r.cpu_times)) for k, r in runners.items()}
  for kind in kinds:
    f, fc = secs[f"{peer} {kind}"], cpu[f"{peer} {kind}"]
    ours = names if names is not None else [
        k[:-len(kind) - 1] for k in runners if k.endswith(f" {kind}") and
        not k.startswith(f"{peer} ")]
    for name in ours:
      if name in partial and f"{name} {kind}" not in runners:
        continue
      s, c = secs[f"{name} {kind}"], cpu[f"{name} {kind}"]
      spread = np.ptp(runners[f"{name} {kind}"].times) / s
      n = LONG_STEPS if kind.endswith("-1k") else steps
      print(f"{case:<12} {kind:<10} {name:<14} {s / n * 1e6:9.2f} us/step  {peer} "
            f"{f / n * 1e6:9.2f} us/step  ratio {f / s:5.2f}x  (spread {spread:.0%}; "
            f"process CPU time ratio {fc / c:5.2f}x)")


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_integer("rounds", OPTIONS["rounds"], "interleaved rounds (medians reported)")
  flags.DEFINE_float("target_s", OPTIONS["target_s"], "seconds per timed batch of calls")
  flags.DEFINE_string("cases", OPTIONS["cases"],
                      "comma-separated: uniform, prioritized, prioritized-small, removers, queue, "
                      "ordered")
  flags.DEFINE_bool("hlo", OPTIONS["hlo"], "print the HLO operation counts first")
  flags.DEFINE_bool("ring", OPTIONS["ring"], "also tables without holes (TableSpec(holes=False))")
  flags.DEFINE_bool("replace", OPTIONS["replace"], "also the uniform case sampled with "
                    "replacement (flashbax's semantics), portable and native")
  flags.DEFINE_bool("index", OPTIONS["index"], "also uniform tables with a position "
                    "index (TableSpec(position_index=True)), portable and native")
  flags.DEFINE_integer("reuse", OPTIONS["reuse"], "also a portable table with this "
                       "max_times_sampled in the uniform case (0: not run)")
  flags.DEFINE_bool("native", OPTIONS["native"],
                    "also time native=True (CPU kernels; --native=0: portable vs flashbax)")
  flags.DEFINE_string("platform", OPTIONS["platform"],
                      "cpu, gpu or tpu ('': JAX's default backend)")
  app.run(main)
