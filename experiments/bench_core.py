"""Core section of the benchmark: the pure functional table in jit vs its peers.

Measured in one process, on the 524-byte transition ``obs f32[64], next_obs
f32[64], action i32, reward f32, discount f32`` at capacity 1,000,000 (small:
65,536), every table full before timing starts:

- ``insert bB``: items/s of a jitted, donated ``insert`` vs flashbax's item
  buffer (jitted, donated ``add``), a numpy ring buffer, cpprb's
  ``ReplayBuffer.add`` and TorchRL's ``ReplayBuffer.extend``/``add``.
- ``sample bB``: items/s of ``sample`` vs the same peers' uniform sampling.
  Ours runs with its default semantics: without replacement within the batch,
  staleness mask and reuse counters on (``version`` passed, ``max_staleness``
  and ``max_times_sampled`` set, never reached); every peer samples with
  replacement and has neither mask. The ``(ours: with repl., no masks)`` cases
  are the same call at the peers' semantics.
- ``prioritized sample+update bB``: one sample plus a priority write-back
  (ours fused in one jitted call) vs flashbax's prioritised item buffer
  (``device="cpu"`` path, sample + ``set_priorities`` in one jitted call),
  cpprb's ``PrioritizedReplayBuffer`` and TorchRL's prioritized buffer (all
  with replacement; ours without, plus a ``with repl.`` case). Each writes
  back ``|reward| + 0.01`` of the batch it sampled, as a learner writes back
  its TD errors; the jitted peers take their key from the step index.
- ``lax.scan``: K training-loop steps inside one jitted ``lax.scan`` (the
  Anakin layout): insert a batch of transitions + sample a batch whose every
  leaf is read (as a learner would; reading only part of it lets XLA drop the
  other gathers), vs flashbax in the same scan; and K single-item inserts in a
  scan, per item, against the host peers' single-item insert from Python.

Every timed operation is a ``Runner``; runners of one group are measured
round-robin (``repeats`` rounds, median seconds per call), so load from other
processes on a shared machine hits every configuration alike. Outputs of every
call (sampled data included) are kept alive and waited for, so XLA cannot drop
the gather. Peers that do not import are skipped with a printed line.

  python experiments/bench_core.py --small --out=results/bench_core.json
  python experiments/bench_core.py --scan   # issue 25's in-scan cases (bench_scan.py)
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from typing import List, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments.timing import (  # noqa: E402
  ITEM_BYTES,
  OBS,
  Holder,
  Runner,
  consume,
  example,
  measure,
  transitions,
)

SECTION = "core"
NOTES: List[str] = []  # filled by run(): skipped peers, semantic differences


@dataclasses.dataclass(frozen=True)
class Sizes:
  """How big and how long. ``capacity`` must be a multiple of ``fill_chunk``."""

  capacity: int
  insert_batches: Sequence[int]
  sample_batches: Sequence[int]
  prio_batches: Sequence[int]
  scan_steps: int        # K steps per jitted lax.scan call
  scan_insert: int       # transitions inserted per scan step
  scan_sample: int       # batch sampled per scan step
  fill_chunk: int
  target_s: float        # wall time of one measurement (steps are calibrated to it)
  repeats: int
  variants: bool = True  # also time ours with replacement and no masks (the peers' semantics)


FULL = Sizes(1_000_000, (1, 256, 1024), (256, 1024), (256, 1024), scan_steps=100,
             scan_insert=16, scan_sample=256, fill_chunk=50_000, target_s=0.25, repeats=7)
SMALL = Sizes(1 << 16, (1, 256), (256,), (256,), scan_steps=50, scan_insert=16, scan_sample=256,
              fill_chunk=1 << 14, target_s=0.03, repeats=3)
# For tests: one batch size everywhere, so each function compiles once.
TINY = Sizes(256, (8,), (8,), (8,), scan_steps=4, scan_insert=8, scan_sample=8, fill_chunk=8,
             target_s=0.002, repeats=2, variants=False)
PEERS = ("flashbax", "numpy", "cpprb", "torchrl")


# --- peers -------------------------------------------------------------------

class NumpyRing:
  """The reference: a plain numpy ring buffer (uniform sampling with replacement)."""

  def __init__(self, capacity: int, seed: int = 0):
    self.data = {k: np.zeros((capacity,) + v.shape, v.dtype) for k, v in example().items()}
    self.capacity, self.pos, self.size = capacity, 0, 0
    self.rng = np.random.default_rng(seed)

  def insert(self, items):
    b = len(items["reward"])
    first = min(b, self.capacity - self.pos)  # two slices where the ring wraps
    for k, col in self.data.items():
      col[self.pos:self.pos + first] = items[k][:first]
      col[:b - first] = items[k][first:]
    self.pos = (self.pos + b) % self.capacity
    self.size = min(self.capacity, self.size + b)

  def sample(self, batch_size):
    idx = self.rng.integers(0, self.size, batch_size)
    return {k: col[idx] for k, col in self.data.items()}


def _host_runner(fn, target_s):
  return Runner(fn, lambda: None, target_s)


def _try_import(name):
  """The peer's module, or None with a printed (and recorded) skip line."""
  try:
    if name == "flashbax":
      import flashbax
      return flashbax
    if name == "cpprb":
      import cpprb
      return cpprb
    if name == "torchrl":
      import logging

      import torchrl
      logging.getLogger("torchrl").setLevel(logging.WARNING)
      return torchrl
  except ImportError as e:
    _skip(f"peer {name} not installed ({e})")
  return None


def _skip(msg):
  print(f"[core] skip {msg}")
  NOTES.append(f"skipped {msg}")


def _cpprb_env():
  return {"obs": {"shape": OBS, "dtype": np.float32},
          "next_obs": {"shape": OBS, "dtype": np.float32},
          "action": {"dtype": np.int32}, "reward": {"dtype": np.float32},
          "discount": {"dtype": np.float32}}


def _torch_td(items):
  import torch
  from tensordict import TensorDict
  return TensorDict({k: torch.from_numpy(v) for k, v in items.items()},
                    batch_size=[len(items["reward"])])


# --- the two groups ----------------------------------------------------------

def _ours_uniform(sz: Sizes, chunks):
  spec = fr.TableSpec(sz.capacity, example(), max_staleness=1 << 30,
                      max_times_sampled=1 << 30)
  t = fr.make_table(spec)  # default semantics: masks on, no replacement
  plain = fr.make_table(spec.replace(max_staleness=None, max_times_sampled=0))  # same state
  ins = jax.jit(lambda s, i, items: t.insert(s, items, version=i), donate_argnums=0)
  h = Holder(t.init())
  for c in chunks:
    h.state = ins(h.state, 0, c)
  return t, plain, ins, h


def _uniform_group(sz: Sizes, peers, rows_out: list):
  """Insert, uniform sample and the lax.scan cases, on one full table per peer."""
  tgt = sz.target_s
  host_chunk = transitions(sz.fill_chunk, seed=1)
  chunks = [jax.device_put(host_chunk)] * (sz.capacity // sz.fill_chunk)
  host_b = {b: transitions(b, seed=2) for b in set(sz.insert_batches) | {sz.scan_insert}}
  dev_b = {b: jax.device_put(v) for b, v in host_b.items()}
  scan_xs = jax.device_put(jax.tree_util.tree_map(
      lambda x: x.reshape((sz.scan_steps, sz.scan_insert) + x.shape[1:]),
      transitions(sz.scan_steps * sz.scan_insert, seed=3)))
  scan_x1 = jax.device_put(jax.tree_util.tree_map(
      lambda x: x[:, None], transitions(sz.scan_steps, seed=4)))
  runners = {}

  t, plain, ins, h = _ours_uniform(sz, chunks)
  for b in sz.insert_batches:
    runners[f"ours insert {b}"] = h.runner(lambda s, i, x: (ins(s, i, x), None), dev_b[b],
                                           target_s=tgt)
  for b in sz.sample_batches:
    def smp(s, i, b=b):
      return t.sample(s, jax.random.PRNGKey(i), batch_size=b, version=i)
    def smp_plain(s, i, b=b):
      return plain.sample(s, jax.random.PRNGKey(i), batch_size=b, replace=True)
    runners[f"ours sample {b}"] = h.runner(jax.jit(smp, donate_argnums=0), target_s=tgt)
    if sz.variants:
      runners[f"ours sample_plain {b}"] = h.runner(jax.jit(smp_plain, donate_argnums=0),
                                                   target_s=tgt)

  def ours_scan(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s = t.insert(s, x, version=v)
      s, smp = t.sample(s, jax.random.PRNGKey(v), batch_size=sz.scan_sample, version=v)
      acc = acc + consume(smp.data)
      return (s, acc, v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc

  def ours_scan_insert(s, i0, xs):
    def body(c, x):
      s, v = c
      return (t.insert(s, x, version=v), v + 1), None
    (s, _), _ = jax.lax.scan(body, (s, jnp.int32(i0)), xs)
    return s, None

  runners["ours scan"] = h.runner(jax.jit(ours_scan, donate_argnums=0), scan_xs, target_s=tgt)
  runners["ours scan_insert"] = h.runner(jax.jit(ours_scan_insert, donate_argnums=0), scan_x1,
                                         target_s=tgt)

  fbx = _try_import("flashbax") if "flashbax" in peers else None
  if fbx is not None:
    mk = lambda b, batches=True: fbx.make_item_buffer(  # noqa: E731
        max_length=sz.capacity, min_length=1, sample_batch_size=b, add_batches=batches)
    buf = mk(sz.scan_sample)
    fadd = jax.jit(lambda s, x: buf.add(s, x), donate_argnums=0)
    fh = Holder(buf.init(example()))
    for c in chunks:
      fh.state = fadd(fh.state, c)
    for b in sz.insert_batches:
      if b == 1:  # flashbax's single-item add (no batch axis)
        one = mk(sz.scan_sample, batches=False)
        f = jax.jit(lambda s, i, x, one=one: (one.add(s, x), None), donate_argnums=0)
        runners[f"flashbax insert {b}"] = fh.runner(f, jax.tree_util.tree_map(
            lambda x: x[0], dev_b[1]), target_s=tgt)
      else:
        runners[f"flashbax insert {b}"] = fh.runner(
            lambda s, i, x: (fadd(s, x), None), dev_b[b], target_s=tgt)
    for b in sz.sample_batches:
      bb = mk(b)
      # The state is passed through (donated, aliased, no copy) so calls chain as ours do.
      f = jax.jit(lambda s, i, bb=bb: (s, bb.sample(s, jax.random.PRNGKey(i)).experience),
                  donate_argnums=0)
      runners[f"flashbax sample {b}"] = fh.runner(f, target_s=tgt)

    def fbx_scan(s, i0, xs):
      def body(c, x):
        s, acc, v = c
        s = buf.add(s, x)
        e = buf.sample(s, jax.random.PRNGKey(v)).experience
        acc = acc + consume(e)
        return (s, acc, v + 1), None
      (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
      return s, acc

    def fbx_scan_insert(s, i0, xs):
      s, _ = jax.lax.scan(lambda s, x: (buf.add(s, x), None), s, xs)
      return s, None

    runners["flashbax scan"] = fh.runner(jax.jit(fbx_scan, donate_argnums=0), scan_xs,
                                         target_s=tgt)
    runners["flashbax scan_insert"] = fh.runner(jax.jit(fbx_scan_insert, donate_argnums=0),
                                                scan_x1, target_s=tgt)

  if "numpy" in peers:
    ring = NumpyRing(sz.capacity)
    for _ in range(sz.capacity // sz.fill_chunk):
      ring.insert(host_chunk)
    for b in sz.insert_batches:
      runners[f"numpy insert {b}"] = _host_runner(lambda i, x=host_b[b]: ring.insert(x), tgt)
    for b in sz.sample_batches:
      runners[f"numpy sample {b}"] = _host_runner(lambda i, b=b: ring.sample(b), tgt)

  cpprb = _try_import("cpprb") if "cpprb" in peers else None
  if cpprb is not None:
    rb = cpprb.ReplayBuffer(sz.capacity, _cpprb_env())
    for _ in range(sz.capacity // sz.fill_chunk):
      rb.add(**host_chunk)
    for b in sz.insert_batches:
      runners[f"cpprb insert {b}"] = _host_runner(lambda i, x=host_b[b]: rb.add(**x), tgt)
    for b in sz.sample_batches:
      runners[f"cpprb sample {b}"] = _host_runner(lambda i, b=b: rb.sample(b), tgt)

  trl = _try_import("torchrl") if "torchrl" in peers else None
  if trl is not None:
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    trb = TensorDictReplayBuffer(storage=LazyTensorStorage(sz.capacity))  # sample(b) sizes
    td_chunk = _torch_td(host_chunk)
    for _ in range(sz.capacity // sz.fill_chunk):
      trb.extend(td_chunk)
    for b in sz.insert_batches:
      td = _torch_td(host_b[b])
      if b == 1:
        runners[f"torchrl insert {b}"] = _host_runner(lambda i, x=td[0]: trb.add(x), tgt)
      else:
        runners[f"torchrl insert {b}"] = _host_runner(lambda i, x=td: trb.extend(x), tgt)
    for b in sz.sample_batches:
      runners[f"torchrl sample {b}"] = _host_runner(lambda i, b=b: trb.sample(b), tgt)

  secs = measure(runners, sz.repeats)
  names = dict(flashbax="flashbax item buffer (jit, donated)", numpy="numpy ring buffer",
               cpprb="cpprb ReplayBuffer", torchrl="torchrl ReplayBuffer (LazyTensorStorage)")
  for b in sz.insert_batches:
    _rows(rows_out, f"insert b{b}", secs, f"ours insert {b}", b, "items/s",
          [(f"{p} insert {b}", names[p]) for p in PEERS])
  for b in sz.sample_batches:
    peers_b = [(f"{p} sample {b}", names[p] + " (with repl.)") for p in PEERS]
    _rows(rows_out, f"sample b{b} (ours: no repl., masks on)", secs, f"ours sample {b}", b,
          "items/s", peers_b)
    _rows(rows_out, f"sample b{b} (ours: with repl., no masks)", secs,
          f"ours sample_plain {b}", b, "items/s", peers_b)
  _rows(rows_out, f"lax.scan insert b{sz.scan_insert} + sample b{sz.scan_sample}", secs,
        "ours scan", sz.scan_steps, "steps/s", [("flashbax scan", names["flashbax"]
                                                 + " in the same scan (with repl.)")])
  # Per item: K single-item inserts in one scan vs the host peers' single-item insert.
  _rows(rows_out, "insert b1 in lax.scan (per item)", secs, "ours scan_insert", sz.scan_steps,
        "items/s", [("flashbax scan_insert", names["flashbax"] + " in the same scan")]
        + [(f"{p} insert 1", names[p] + " (b1 insert from Python)")
           for p in ("numpy", "cpprb", "torchrl")],
        peer_items={f"{p} insert 1": 1 for p in PEERS})


def _prioritized_group(sz: Sizes, peers, rows_out: list):
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

  fbx = _try_import("flashbax") if "flashbax" in peers else None
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

  cpprb = _try_import("cpprb") if "cpprb" in peers else None
  if cpprb is not None:
    prb = cpprb.PrioritizedReplayBuffer(sz.capacity, _cpprb_env(), alpha=0.6)
    for _ in range(sz.capacity // sz.fill_chunk):
      prb.add(**host_chunk)

    def cp(i, b):
      smp = prb.sample(b, beta=0.4)
      prb.update_priorities(smp["indexes"], np.abs(smp["reward"]).reshape(-1) + 0.01)
    for b in sz.prio_batches:
      runners[f"cpprb {b}"] = _host_runner(lambda i, b=b: cp(i, b), tgt)

  trl = _try_import("torchrl") if "torchrl" in peers else None
  if trl is not None:
    try:
      import torch  # noqa: F401 (torchrl needs it importable)
      from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer
      prb_t = TensorDictPrioritizedReplayBuffer(alpha=0.6, beta=0.4,
                                                storage=LazyTensorStorage(sz.capacity))
    except (RuntimeError, ImportError) as e:  # its C++ sum tree is an optional build
      _skip(f"torchrl prioritized buffer ({type(e).__name__}: {e})")
    else:
      td_chunk = _torch_td(host_chunk)
      for _ in range(sz.capacity // sz.fill_chunk):
        prb_t.extend(td_chunk)

      def tr(i, b):
        smp = prb_t.sample(b)
        prb_t.update_priority(smp["index"], smp["reward"].abs() + 0.01)
      for b in sz.prio_batches:
        runners[f"torchrl {b}"] = _host_runner(lambda i, b=b: tr(i, b), tgt)

  secs = measure(runners, sz.repeats)
  names = dict(flashbax="flashbax prioritised item buffer (cpu path, with repl.)",
               cpprb="cpprb PrioritizedReplayBuffer (with repl.)",
               torchrl="torchrl PrioritizedReplayBuffer (with repl.)")
  for b in sz.prio_batches:
    _rows(rows_out, f"prioritized sample+update b{b} (ours: no repl.)", secs, f"ours {b}", b,
          "items/s", [(f"{p} {b}", names[p]) for p in ("flashbax", "cpprb", "torchrl")])
  _rows(rows_out, f"prioritized sample+update b{b0} (ours: with repl.)", secs,
        f"ours_replace {b0}", b0, "items/s",
        [(f"{p} {b0}", names[p]) for p in ("flashbax", "cpprb", "torchrl")])


def _rows(out, case, secs, ours_key, items, unit, peer_keys, peer_items=None):
  """Append one row per measured peer: throughput = items per call / s per call."""
  peer_items = peer_items or {}
  if ours_key not in secs:  # a variant this run did not time
    return
  ours = items / secs[ours_key]
  for key, name in peer_keys:
    if key in secs:
      peer = peer_items.get(key, items) / secs[key]
      out.append(dict(section=SECTION, case=case, funcreplay=ours, peer=peer, peer_name=name,
                      unit=unit, ratio=ours / peer))


def run(small: bool, sizes: Optional[Sizes] = None, peers: Sequence[str] = PEERS) -> list:
  """The ``core`` section of ``experiments/benchmark.py``: one row per (case, peer).

  Args:
    small: CI-sized (``SMALL``: capacity 65,536) instead of ``FULL`` (1,000,000).
    sizes: overrides both (e.g. ``TINY`` in tests).
    peers: which of ``PEERS`` to measure (missing packages are skipped).
  """
  sz = sizes or (SMALL if small else FULL)
  if sz.capacity % sz.fill_chunk:
    raise ValueError(f"Sizes.capacity {sz.capacity} must be a multiple of fill_chunk "
                     f"{sz.fill_chunk}.")
  del NOTES[:]
  NOTES.append("ours samples without replacement with staleness/reuse masks on unless the case "
               "says 'with repl.'; every peer samples with replacement and has no masks")
  NOTES.append("flashbax prioritised buffer uses its device='cpu' code path")
  print(f"[core] capacity {sz.capacity:,}, item {ITEM_BYTES} B, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, peers {list(peers)}")
  rows: list = []
  for group in (_uniform_group, _prioritized_group):
    t0 = time.perf_counter()
    group(sz, tuple(peers), rows)
    gc.collect()  # free this group's 1M-slot tables before the next group allocates its own
    print(f"[core] {group.__name__[1:]} done in {time.perf_counter() - t0:.1f} s")
  return rows


def main(argv):
  del argv
  from absl import flags
  f = flags.FLAGS
  if f.scan:  # issue 25's in-scan cases, portable and native vs flashbax (bench_scan.py)
    from experiments import bench_scan
    bench_scan.start(hlo=True, rounds=f.scan_rounds, platform=f.scan_platform)
    return
  rows = run(f.small)
  for r in rows:
    print(f"{r['case']:<48} {r['funcreplay']:>14,.0f} {r['peer']:>14,.0f} {r['unit']:>8} "
          f"{r['ratio']:>7.2f}x  {r['peer_name']}")
  if f.out:
    os.makedirs(os.path.dirname(f.out) or ".", exist_ok=True)
    with open(f.out, "w") as fh:
      json.dump(dict(rows=rows, notes=NOTES), fh, indent=1)


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_bool("small", False, "CI-sized run")
  flags.DEFINE_string("out", "", "JSON output ('' = none)")
  flags.DEFINE_bool("scan", False, "run only issue 25's in-scan cases and HLO counts "
                    "(experiments/bench_scan.py)")
  flags.DEFINE_integer("scan_rounds", 5, "interleaved rounds of the --scan cases")
  flags.DEFINE_string("scan_platform", "", "backend of the --scan cases: cpu, gpu, tpu "
                      "('': JAX's default)")
  app.run(main)
