"""Core section, prioritized group: ``prioritized sample+update bB`` of ``bench_core.py``,
ours (fused in one jitted call) vs flashbax's prioritised item buffer, cpprb's
``PrioritizedReplayBuffer`` and TorchRL's prioritized buffer, on one full table per peer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import funcreplay as fr
from experiments.bench_core_common import (
  Sizes,
  add_rows,
  cpprb_env,
  host_runner,
  skip_peer,
  torch_td,
  try_import,
)
from experiments.timing import Holder, example, measure, transitions


def prioritized_group(sz: Sizes, peers, rows_out: list):
  """Prioritized sample + priority update, one full table per peer."""
  tgt = sz.target_s
  host_chunk = transitions(sz.fill_chunk, seed=1)
  chunks = [jax.device_put(host_chunk)] * (sz.capacity // sz.fill_chunk)
  runners = {}
  spec = fr.TableSpec(sz.capacity, example(), sampler=fr.Prioritized(0.6))
  t = fr.make_table(spec)
  ins = jax.jit(lambda s, x: t.insert(s, x, version=0), donate_argnums=0)
  h = Holder(t.init())
  for c in chunks:
    h.state = ins(h.state, c)

  # Every peer writes back priorities computed from the batch it sampled
  # (|reward| + 0.01, standing in for a learner's |TD error|), and every
  # jitted peer gets a fresh key from the step index without splitting.
  def ours(s, i, b, replace):
    s, smp = t.sample(s, jax.random.PRNGKey(i), batch_size=b, replace=replace)
    new_p = jnp.abs(smp.data["reward"]) + 0.01
    s = t.update_priorities(s, smp.info.slot, smp.info.key, new_p)
    return s, (smp.data, smp.info.probability)

  for b in sz.prio_batches:
    runners[f"ours {b}"] = h.runner(jax.jit(lambda s, i, b=b: ours(s, i, b, False),
                                            donate_argnums=0), target_s=tgt)
  b0 = sz.prio_batches[0]
  if sz.variants:
    runners[f"ours_replace {b0}"] = h.runner(
        jax.jit(lambda s, i: ours(s, i, b0, True), donate_argnums=0), target_s=tgt)

  fbx = try_import("flashbax") if "flashbax" in peers else None
  if fbx is not None:
    mk = lambda b: fbx.make_prioritised_item_buffer(  # noqa: E731
        max_length=sz.capacity, min_length=1, sample_batch_size=b, add_batches=True,
        priority_exponent=0.6, device="cpu")
    buf = mk(b0)
    fh = Holder(buf.init(example()))
    fadd = jax.jit(buf.add, donate_argnums=0)
    for c in chunks:
      fh.state = fadd(fh.state, c)
    for b in sz.prio_batches:
      bb = mk(b)

      def fb(s, i, bb=bb):
        smp = bb.sample(s, jax.random.PRNGKey(i))
        s = bb.set_priorities(s, smp.indices, jnp.abs(smp.experience["reward"]) + 0.01)
        return s, (smp.experience, smp.probabilities)
      runners[f"flashbax {b}"] = fh.runner(jax.jit(fb, donate_argnums=0), target_s=tgt)

  cpprb = try_import("cpprb") if "cpprb" in peers else None
  if cpprb is not None:
    prb = cpprb.PrioritizedReplayBuffer(sz.capacity, cpprb_env(), alpha=0.6)
    for _ in range(sz.capacity // sz.fill_chunk):
      prb.add(**host_chunk)

    def cp(i, b):
      smp = prb.sample(b, beta=0.4)
      prb.update_priorities(smp["indexes"], np.abs(smp["reward"]).reshape(-1) + 0.01)
    for b in sz.prio_batches:
      runners[f"cpprb {b}"] = host_runner(lambda i, b=b: cp(i, b), tgt)

  trl = try_import("torchrl") if "torchrl" in peers else None
  if trl is not None:
    try:
      import torch  # noqa: F401 (torchrl needs it importable)
      from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
      prb_t = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4,
                                                storage=LazyTensorStorage(sz.capacity))
    except (RuntimeError, ImportError) as e:  # its C++ sum tree is an optional build
      skip_peer(f"torchrl prioritized buffer ({type(e).__name__}: {e})")
    else:
      td_chunk = torch_td(host_chunk)
      for _ in range(sz.capacity // sz.fill_chunk):
        prb_t.extend(td_chunk)

      def tr(i, b):
        smp = prb_t.sample(b)
        prb_t.update_priority(smp["index"], smp["reward"].abs() + 0.01)
      for b in sz.prio_batches:
        runners[f"torchrl {b}"] = host_runner(lambda i, b=b: tr(i, b), tgt)

  secs = measure(runners, sz.repeats)
  names = dict(flashbax="flashbax prioritised item buffer (cpu path, with repl.)",
               cpprb="cpprb PrioritizedReplayBuffer (with repl.)",
               torchrl="torchrl PrioritizedReplayBuffer (with repl.)")
  for b in sz.prio_batches:
    add_rows(rows_out, f"prioritized sample+update b{b} (ours: no repl.)", secs, f"ours {b}", b,
             "items/s", [(f"{p} {b}", names[p]) for p in ("flashbax", "cpprb", "torchrl")])
  add_rows(rows_out, f"prioritized sample+update b{b0} (ours: with repl.)", secs,
           f"ours_replace {b0}", b0, "items/s",
           [(f"{p} {b0}", names[p]) for p in ("flashbax", "cpprb", "torchrl")])
