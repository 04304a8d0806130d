"""Core section, uniform group: ``insert bB``, ``sample bB`` and the ``lax.scan`` cases of
``bench_core.py``, ours vs flashbax's item buffer, a numpy ring buffer, cpprb's
``ReplayBuffer`` and TorchRL's ``ReplayBuffer``, on one full table per peer."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import funcreplay as fr
from experiments.bench_core_common import (
  PEERS,
  NumpyRing,
  Sizes,
  add_rows,
  cpprb_env,
  host_runner,
  torch_td,
  try_import,
)
from experiments.timing import Holder, consume, example, measure, transitions


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


def uniform_group(sz: Sizes, peers, rows_out: list):
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

  fbx = try_import("flashbax") if "flashbax" in peers else None
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
      runners[f"numpy insert {b}"] = host_runner(lambda i, x=host_b[b]: ring.insert(x), tgt)
    for b in sz.sample_batches:
      runners[f"numpy sample {b}"] = host_runner(lambda i, b=b: ring.sample(b), tgt)

  cpprb = try_import("cpprb") if "cpprb" in peers else None
  if cpprb is not None:
    rb = cpprb.ReplayBuffer(sz.capacity, cpprb_env())
    for _ in range(sz.capacity // sz.fill_chunk):
      rb.add(**host_chunk)
    for b in sz.insert_batches:
      runners[f"cpprb insert {b}"] = host_runner(lambda i, x=host_b[b]: rb.add(**x), tgt)
    for b in sz.sample_batches:
      runners[f"cpprb sample {b}"] = host_runner(lambda i, b=b: rb.sample(b), tgt)

  trl = try_import("torchrl") if "torchrl" in peers else None
  if trl is not None:
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
    trb = TensorDictReplayBuffer(storage=LazyTensorStorage(sz.capacity))  # sample(b) sizes
    td_chunk = torch_td(host_chunk)
    for _ in range(sz.capacity // sz.fill_chunk):
      trb.extend(td_chunk)
    for b in sz.insert_batches:
      td = torch_td(host_b[b])
      if b == 1:
        runners[f"torchrl insert {b}"] = host_runner(lambda i, x=td[0]: trb.add(x), tgt)
      else:
        runners[f"torchrl insert {b}"] = host_runner(lambda i, x=td: trb.extend(x), tgt)
    for b in sz.sample_batches:
      runners[f"torchrl sample {b}"] = host_runner(lambda i, b=b: trb.sample(b), tgt)

  secs = measure(runners, sz.repeats)
  names = dict(flashbax="flashbax item buffer (jit, donated)", numpy="numpy ring buffer",
               cpprb="cpprb ReplayBuffer", torchrl="torchrl ReplayBuffer (LazyTensorStorage)")
  for b in sz.insert_batches:
    add_rows(rows_out, f"insert b{b}", secs, f"ours insert {b}", b, "items/s",
             [(f"{p} insert {b}", names[p]) for p in PEERS])
  for b in sz.sample_batches:
    peers_b = [(f"{p} sample {b}", names[p] + " (with repl.)") for p in PEERS]
    add_rows(rows_out, f"sample b{b} (ours: no repl., masks on)", secs, f"ours sample {b}", b,
             "items/s", peers_b)
    add_rows(rows_out, f"sample b{b} (ours: with repl., no masks)", secs,
             f"ours sample_plain {b}", b, "items/s", peers_b)
  add_rows(rows_out, f"lax.scan insert b{sz.scan_insert} + sample b{sz.scan_sample}", secs,
           "ours scan", sz.scan_steps, "steps/s", [("flashbax scan", names["flashbax"]
                                                    + " in the same scan (with repl.)")])
  # Per item: K single-item inserts in one scan vs the host peers' single-item insert.
  add_rows(rows_out, "insert b1 in lax.scan (per item)", secs, "ours scan_insert", sz.scan_steps,
           "items/s", [("flashbax scan_insert", names["flashbax"] + " in the same scan")]
           + [(f"{p} insert 1", names[p] + " (b1 insert from Python)")
              for p in ("numpy", "cpprb", "torchrl")],
           peer_items={f"{p} insert 1": 1 for p in PEERS})
