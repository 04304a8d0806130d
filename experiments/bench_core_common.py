"""What the core section's groups (bench_core_uniform.py, bench_core_prioritized.py) share:
the sizes, the peers' plumbing (the numpy ring buffer, imports that skip a missing peer,
cpprb's and TorchRL's item formats, host runners) and the rows they append.

``bench_core.py`` is the entry point and re-exports the public names.
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence

import numpy as np

from experiments.timing import OBS, Runner, example

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


def host_runner(fn, target_s):
  return Runner(fn, lambda: None, target_s)


def try_import(name):
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
    skip_peer(f"peer {name} not installed ({e})")
  return None


def skip_peer(msg):
  print(f"[core] skip {msg}")
  NOTES.append(f"skipped {msg}")


def cpprb_env():
  return {"obs": {"shape": OBS, "dtype": np.float32},
          "next_obs": {"shape": OBS, "dtype": np.float32},
          "action": {"dtype": np.int32}, "reward": {"dtype": np.float32},
          "discount": {"dtype": np.float32}}


def torch_td(items):
  import torch
  from tensordict import TensorDict
  return TensorDict({k: torch.from_numpy(v) for k, v in items.items()},
                    batch_size=[len(items["reward"])])


# --- rows --------------------------------------------------------------------

def add_rows(out, case, secs, ours_key, items, unit, peer_keys, peer_items=None):
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
