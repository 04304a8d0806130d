"""Whole-buffer copies in the programs of every kind of table, for the CPU and an H200.

XLA updates a donated buffer in place only when every read of its old contents is
ordered before the write; where it cannot prove that, it copies the buffer, O(C) a call
(``funcreplay.core.inplace``). Which reads it duplicates into which consumers differs by
backend, so a program that is clean on XLA:CPU (what tests/core/test_inplace.py checks)
may copy on XLA:GPU. This compiles, for each spec of ``SPECS``, the per-call programs
(insert of 1 and 16 rows, sample 256 with and without replacement, update_priorities)
and the in-scan steps of ``scan_steps`` (insert then sample, sample then insert, insert
alone, prioritized sample then update), for each target (``accel_hlo.Target``: no
device needed), and lists the copies of at least ``hlo.big_copy_sites``' size outside
conditional branches (a branch runs only when taken: the rare completions).

``KNOWN`` holds the copies found and not fixed yet (BUILD.md findings 29, 31); the script
exits 1 on any other, so that a change that adds a copy on some backend is seen. Run
in the accelerator venv (``make accel-hlo`` builds it):

  .venv-accel-hlo/bin/python experiments/accel_copies.py --targets=cpu,h200
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # as accel_hlo: see there
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments import scan_steps  # noqa: E402
from experiments.accel_hlo import CAPACITY, Target  # noqa: E402
from experiments.timing import example  # noqa: E402
from funcreplay.core import hlo  # noqa: E402

SPECS = {
    "uniform": dict(),
    "holes=False": dict(holes=False),
    "prioritized": dict(sampler=fr.Prioritized(0.6)),
    "reuse limit": dict(max_times_sampled=4),
    "staleness": dict(max_staleness=3),
    "prioritized + reuse": dict(sampler=fr.Prioritized(0.6), max_times_sampled=4),
    "Lifo sampler": dict(sampler=fr.Lifo()),
    "Fifo sampler": dict(sampler=fr.Fifo()),
    "MinHeap remover": dict(remover=fr.MinHeap()),
    "Uniform remover": dict(remover=fr.Uniform()),
    "position index": dict(position_index=True),
    "position index + reuse": dict(position_index=True, max_times_sampled=4),
    "position index + Uniform remover": dict(position_index=True, remover=fr.Uniform()),
}
# (target, spec, program) -> hot copies found and left (BUILD.md finding 29).
KNOWN = {
    # The masked draw's general path (staleness masks): its entry copies the count tree
    # once; the restore of the zeroed leaves (a branch) copies it too.
    **{("h200", "staleness", p): 1 for p in ("sample 256", "sample 256 replace", "scan",
                                            "smp-ins")},
    # Fixed in finding 31 (reads once off the CPU): the prioritized table with a reuse
    # limit's sample then update (item_info x2), and a full table's per-row eviction loop
    # with the MinHeap or Uniform remover (item_info x2 in the scan and the one-row insert).
}


class Cpu:
  """The CPU JAX runs on here, as a ``Target``."""

  def text(self, fn, *shapes) -> str:
    return jax.jit(fn, donate_argnums=0).lower(*shapes).compile().as_text()


def programs(spec):
  """``{program: (fn, state, *args)}`` of a table of ``spec`` (portable executors)."""
  t = fr.make_table(spec, native=False)
  state = jax.eval_shape(t.init)
  item = jax.tree_util.tree_map(jnp.asarray, example())
  rows = lambda *lead: jax.tree_util.tree_map(  # noqa: E731
      lambda v: jax.ShapeDtypeStruct(lead + v.shape, v.dtype), item)
  kw = {} if spec.max_staleness is None else dict(version=jnp.int32(0))
  # The Uniform remover draws its victims: a key.
  kw_ins = dict(kw, rng=jax.random.PRNGKey(0)) if isinstance(spec.remover, fr.Uniform) else kw
  insert = lambda s, x: t.insert(s, x, **kw_ins)  # noqa: E731
  key = jax.ShapeDtypeStruct((2,), jnp.uint32)
  i0 = jax.ShapeDtypeStruct((), jnp.int32)
  out = {f"insert b{b}": (insert, state, rows(b)) for b in (1, 16)}
  ordered = isinstance(spec.sampler, (fr.Fifo, fr.Lifo, fr.MinHeap, fr.MaxHeap))
  replaces = (False,) if ordered else (False, True)  # no replacement in an order
  for replace in replaces:
    out["sample 256" + " replace" * replace] = (
        lambda s, k, r=replace: t.sample(s, k, batch_size=256, replace=r, **kw), state, key)
  if spec.prioritized:
    b = jax.ShapeDtypeStruct((256,), jnp.int32)
    out["update 256"] = (t.update_priorities, state, b, b.update(dtype=jnp.uint32),
                         b.update(dtype=jnp.float32))
    out["prioritized step"] = (scan_steps.table_prioritized_step(t), state, i0)

  def sample(s, key):
    s, smp = t.sample(s, key, batch_size=scan_steps.SMP, **kw)
    return s, smp.data
  steps = scan_steps.uniform_steps(insert, sample)
  for name in ("scan", "smp-ins", "insert1"):
    b = 1 if name == "insert1" else scan_steps.INS
    out[name] = (steps[name], state, i0, rows(scan_steps.STEPS, b))
  return out


def main(argv):
  del argv
  from absl import flags
  new = 0
  for target_name in flags.FLAGS.targets.split(","):
    target = Cpu() if target_name == "cpu" else Target(target_name)
    print(f"{target_name}: copies of >= 65,536 elements outside conditional branches "
          f"(capacity {CAPACITY:,}; in a branch: counted apart)")
    for spec_name, kwargs in SPECS.items():
      if flags.FLAGS.specs and spec_name not in flags.FLAGS.specs:
        continue
      for name, (fn, *shapes) in programs(fr.TableSpec(CAPACITY, example(), **kwargs)).items():
        sites = hlo.big_copy_sites(target.text(fn, *shapes))
        hot = [shape for _, shape, in_branch in sites if not in_branch]
        known = KNOWN.get((target_name, spec_name, name), 0)
        flag = "" if len(hot) <= known else "  NEW"
        new += len(hot) > known
        if hot or flag or flags.FLAGS.all:
          print(f"  {spec_name:<20} {name:<20} {len(hot)} {sorted(set(hot))}  "
                f"(in branches: {len(sites) - len(hot)}){flag}")
  print("new copies:", new)
  return 1 if new else 0


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_string("targets", "cpu,h200", "comma-separated: cpu, or of accel_hlo.TARGETS")
  flags.DEFINE_bool("all", False, "list every program, not only those that copy")
  flags.DEFINE_list("specs", [], f"names of SPECS to compile (default: all): {list(SPECS)}")
  app.run(main)
