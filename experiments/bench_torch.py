"""Batches/s delivered to a PyTorch consumer: funcreplay's torch bridge vs TorchRL.

The consumer receives batches of 256 transitions of 524 bytes each (obs
float32[64], next_obs float32[64], action int32, reward float32, discount
float32) as torch tensors on the CPU and touches them (a sum over ``obs``).
Cases, each measured in the same process, round-robin over ``--repeats``
(median reported):

* ``uniform``: ``TorchSampler`` over a ``fr.Table`` (Uniform sampler,
  without replacement; each batch sampled in place into a fresh torch tensor,
  ``Table.sample_packed(out=...)``) vs TorchRL
  ``ReplayBuffer(LazyTensorStorage)`` (RandomSampler, with replacement);
* ``uniform, prefetch 2``: both with two batches sampled ahead on a
  background thread (``TorchSampler(prefetch=2)`` / ``ReplayBuffer(prefetch=2)``);
* ``uniform, 4 / 8 batches/call``: ``TorchSampler(batches_per_call=k)`` (one
  table call of k * 256 rows handed out as k batches) vs TorchRL amortised
  the same way (``ReplayBuffer(batch_size=k * 256)``, each sample sliced into
  k TensorDict batches);
* ``uniform, per-array export``: ``sample_to_torch(Table.sample(256))``, one
  DLPack export per array instead of the one of a packed sample (compared
  with TorchRL's ``uniform``);
* ``prioritized + write-back``: a ``Prioritized(0.6)`` table, importance
  weights (beta 0.4) and ``update_priorities`` with new priorities each
  batch vs TorchRL ``PrioritizedReplayBuffer`` (alpha 0.6, beta 0.4) +
  ``update_priority``;
* ``plain torch indexing`` (reference, not a replay buffer): ``randint`` +
  ``index_select`` on preallocated torch tensors, the floor for any host
  buffer.

  python experiments/bench_torch.py --capacity=131072 --out=results/bench_torch.json

TorchRL rows are skipped, with a line saying so, when torchrl is not installed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Dict, List

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import funcreplay as fr  # noqa: E402
import funcreplay.torch as frt  # noqa: E402
from funcreplay.core import packing  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("capacity", 1 << 17, "items in every buffer (filled completely)")
flags.DEFINE_integer("batch_size", 256, "rows per batch")
flags.DEFINE_integer("steps", 200, "batches per timed measurement")
flags.DEFINE_integer("repeats", 5, "measurements per case; the median is reported")
flags.DEFINE_integer("torch_threads", 1, "torch intra-op threads")
flags.DEFINE_string("out", "", "JSON output ('' = none)")

OBS = 64
ITEM_BYTES = 2 * OBS * 4 + 3 * 4  # 524


def _item() -> Dict[str, np.ndarray]:
  return dict(obs=np.zeros(OBS, np.float32), next_obs=np.zeros(OBS, np.float32),
              action=np.zeros((), np.int32), reward=np.zeros((), np.float32),
              discount=np.zeros((), np.float32))


def _data(n: int, seed: int = 0) -> Dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return dict(obs=rng.standard_normal((n, OBS), np.float32),
              next_obs=rng.standard_normal((n, OBS), np.float32),
              action=rng.integers(0, 4, n).astype(np.int32),
              reward=rng.standard_normal(n, np.float32),
              discount=np.ones(n, np.float32))


def _fill_table(sampler, capacity: int) -> fr.Table:
  table = fr.Table(fr.TableSpec(capacity, _item(), sampler=sampler), seed=0)
  chunk = min(capacity, 16384)
  for start in range(0, capacity, chunk):
    table.insert(_data(min(chunk, capacity - start), seed=start))
  return table


def _consume(obs: torch.Tensor) -> float:
  return float(obs.sum())


class _Case:
  """One timed consumer loop; ``step()`` delivers and consumes one batch."""

  def __init__(self, step: Callable[[], None], close: Callable[[], None] = lambda: None):
    self.step, self.close, self.rates = step, close, []
    for _ in range(5):  # compile / warm up
      step()

  def measure(self, steps: int) -> None:
    t0 = time.perf_counter()
    for _ in range(steps):
      self.step()
    self.rates.append(steps / (time.perf_counter() - t0))


def _ours(capacity: int, batch: int) -> Dict[str, _Case]:
  cases = {}
  uni = _fill_table(fr.Uniform(), capacity)
  for name, prefetch, k in (("uniform", 0, 1), ("uniform, prefetch 2", 2, 1),
                            ("uniform, 4 batches/call", 0, 4),
                            ("uniform, 8 batches/call", 0, 8)):
    it = iter(frt.TorchSampler(uni, batch, prefetch=prefetch, batches_per_call=k,
                               on_copy="raise"))
    cases[name] = _Case(lambda it=it: _consume(next(it).data["obs"]), it.close)
  # The same batch exported array by array (Table.sample + sample_to_torch), as the
  # bridge did before packed samples: the difference is the per-array export cost.
  cases["uniform, per-array export"] = _Case(
      lambda: _consume(frt.sample_to_torch(uni.sample(batch), on_copy="raise").data["obs"]))
  # Diagnostics: the table call alone, jitted (JAX arrays, blocked on, no torch) and in
  # place into a torch tensor; the rest of the "uniform" case's time is the bridge
  # (views, iterator).
  cases["Table.sample alone (no bridge)"] = _Case(
      lambda: jax.block_until_ready(uni.sample(batch).data["obs"]))
  nbytes = packing.layout(uni.spec.signature, batch).nbytes
  cases["sample_packed(out=tensor) alone"] = _Case(
      lambda: uni.sample_packed(batch, out=torch.empty(nbytes, dtype=torch.uint8)))
  pri = _fill_table(fr.Prioritized(0.6), capacity)
  it_p = iter(frt.TorchSampler(pri, batch, prefetch=0, beta=0.4, on_copy="raise"))
  gen = torch.Generator().manual_seed(0)

  def prioritized():
    b = next(it_p)
    _consume(b.data["obs"] * b.weights[:, None])
    frt.update_priorities(pri, b.info, torch.rand(batch, generator=gen) + 0.01)

  cases["prioritized + write-back"] = _Case(prioritized, it_p.close)
  return cases


def _torchrl(capacity: int, batch: int):
  """TorchRL cases, or (None, reason) when torchrl is missing."""
  try:
    from tensordict import TensorDict  # noqa: PLC0415
    from torchrl import data as rl_data  # noqa: PLC0415
  except ImportError as e:
    return None, f"torchrl not installed ({e})"
  td = TensorDict({k: torch.from_numpy(v) for k, v in _data(capacity).items()},
                  batch_size=[capacity])
  cases = {}
  for name, prefetch in (("uniform", None), ("uniform, prefetch 2", 2)):
    rb = rl_data.ReplayBuffer(storage=rl_data.LazyTensorStorage(capacity), batch_size=batch,
                              prefetch=prefetch)
    rb.extend(td)
    cases[name] = _Case(lambda rb=rb: _consume(rb.sample()["obs"]))
  for k in (4, 8):  # TorchRL amortised the same way: one k * B sample cut into k batches
    rb = rl_data.ReplayBuffer(storage=rl_data.LazyTensorStorage(capacity),
                              batch_size=k * batch)
    rb.extend(td)

    def step(rb=rb, k=k, pending=[]):  # noqa: B006 (per-case state, bound at definition)
      if not pending:
        big = rb.sample()
        pending.extend(big[i * batch:(i + 1) * batch] for i in range(k))
      _consume(pending.pop(0)["obs"])

    cases[f"uniform, {k} batches/call"] = _Case(step)
  try:
    prb = rl_data.PrioritizedReplayBuffer(alpha=0.6, beta=0.4, batch_size=batch,
                                          storage=rl_data.LazyTensorStorage(capacity))
  except RuntimeError as e:  # e.g. torchrl's C++ segment trees not built for this torch
    print(f"TorchRL PrioritizedReplayBuffer unavailable, prioritized case has no peer: {e}")
    prb = None
  if prb is not None:
    prb.extend(td)
    gen = torch.Generator().manual_seed(0)

    def prioritized():
      s, info = prb.sample(return_info=True)
      _consume(s["obs"] * torch.as_tensor(info["_weight"], dtype=torch.float32)[:, None])
      prb.update_priority(info["index"], torch.rand(batch, generator=gen) + 0.01)

    cases["prioritized + write-back"] = _Case(prioritized)
  return cases, "torchrl " + __import__("torchrl").__version__


def _plain(capacity: int, batch: int) -> _Case:
  store = {k: torch.from_numpy(v) for k, v in _data(capacity).items()}
  gen = torch.Generator().manual_seed(0)

  def step():
    idx = torch.randint(capacity, (batch,), generator=gen)
    b = {k: v.index_select(0, idx) for k, v in store.items()}
    _consume(b["obs"])

  return _Case(step)


def measure(capacity: int, batch: int, steps: int, repeats: int) -> dict:
  """Median batches/s per (case, implementation)."""
  ours = _ours(capacity, batch)
  peers, peer_name = _torchrl(capacity, batch)
  plain = _plain(capacity, batch)
  everything = [("funcreplay", k, c) for k, c in ours.items()] + [("plain", "indexing", plain)]
  if peers is not None:
    everything += [("torchrl", k, c) for k, c in peers.items()]
  for _ in range(repeats):  # round-robin: load changes hit every case alike
    for _, _, c in everything:
      c.measure(steps)
  for _, _, c in everything:
    c.close()
  res = {(impl, k): float(np.median(c.rates)) for impl, k, c in everything}
  return dict(results=res, peer_name=peer_name if peers is not None else None,
              skipped=None if peers is not None else peer_name)


_DIAGNOSTIC = ("Table.sample alone (no bridge)", "sample_packed(out=tensor) alone")
# Our cases without a TorchRL counterpart of their own compare with this one.
_PEER_CASE = {"uniform, per-array export": "uniform"}


def _rows(m: dict, batch: int) -> List[dict]:
  res, rows = m["results"], []
  plain = res[("plain", "indexing")]
  for (impl, case), ours in res.items():
    if impl != "funcreplay" or case in _DIAGNOSTIC:
      continue
    peer_case = _PEER_CASE.get(case, case)
    if ("torchrl", peer_case) in res:
      peer = res[("torchrl", peer_case)]
      rows.append(dict(section="torch", case=f"{case} b{batch}", funcreplay=ours,
                       peer=peer, peer_name=f"TorchRL ReplayBuffer(LazyTensorStorage) "
                       f"[{m['peer_name']}]", unit="batches/s", ratio=ours / peer))
    rows.append(dict(section="torch", case=f"{case} b{batch} (vs plain indexing)",
                     funcreplay=ours, peer=plain, peer_name="plain torch randint+index_select",
                     unit="batches/s", ratio=ours / plain))
  return rows


def _setup(threads: int) -> None:
  torch.set_num_threads(threads)


def main(_):
  _setup(FLAGS.torch_threads)
  m = measure(FLAGS.capacity, FLAGS.batch_size, FLAGS.steps, FLAGS.repeats)
  print(f"capacity {FLAGS.capacity}, batch {FLAGS.batch_size} x {ITEM_BYTES} B, torch "
        f"{torch.__version__}, peer: {m['peer_name'] or 'skipped: ' + m['skipped']}")
  print(f"{'case':<34} {'funcreplay':>12} {'torchrl':>12} {'plain idx':>12} {'ratio':>7}")
  res = m["results"]
  for (impl, case), ours in res.items():
    if impl != "funcreplay":
      continue
    peer = res.get(("torchrl", _PEER_CASE.get(case, case)), float("nan"))
    print(f"{case:<34} {ours:>12,.0f} {peer:>12,.0f} {res[('plain', 'indexing')]:>12,.0f} "
          f"{ours / peer:>7.2f}")
  rows = _rows(m, FLAGS.batch_size)
  if FLAGS.out:
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump(dict(capacity=FLAGS.capacity, batch_size=FLAGS.batch_size, rows=rows,
                     batches_per_s={f"{i}: {c}": v for (i, c), v in res.items()}), f, indent=1)
    print(f"wrote {FLAGS.out}")


def run(small: bool) -> list:
  """The ``torch`` section of ``experiments/benchmark.py`` (rows as in bench_sharding)."""
  _setup(1)
  if small:
    m = measure(capacity=1 << 15, batch=256, steps=30, repeats=3)
  else:
    m = measure(capacity=1 << 17, batch=256, steps=200, repeats=5)
  return _rows(m, 256)


if __name__ == "__main__":
  app.run(main)
