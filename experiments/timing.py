"""What the benchmarks in experiments/ share: the 524-byte transition, the timing loop
(calibrated calls, interleaved rounds, wall and process CPU time) and ``consume``, which
reads every sampled field so XLA keeps every gather."""

from __future__ import annotations

import time
from typing import Callable, Dict

import jax
import jax.numpy as jnp
import numpy as np

OBS = 64
ITEM_BYTES = 2 * OBS * 4 + 3 * 4  # 524
# ``Holder.runner`` passes call ``i`` the seed base ``i * KEYS_PER_CALL``: a scan of up to
# this many steps seeds step ``j`` with ``base + j``, so no two calls share a key. With the
# base ``i`` itself, call ``i + 1`` reused 49 of call ``i``'s 50 keys; a uniform sample of a
# full table then re-read the rows it had read one call before, from the cache (a batch of
# 256 rows of 524 bytes: ~6.5 MB a call), and every sampler whose slots follow from the key
# alone (flashbax's, the descent over a full table) looked faster than one whose slots also
# depend on the write position (BUILD.md finding 24). A training step draws fresh keys.
KEYS_PER_CALL = 1 << 10


def transitions(n: int, seed: int = 0) -> Dict[str, np.ndarray]:
  """``n`` random transitions: dict of numpy arrays with a leading ``[n]`` axis."""
  rng = np.random.default_rng(seed)
  return {"obs": rng.standard_normal((n, OBS), dtype=np.float32),
          "next_obs": rng.standard_normal((n, OBS), dtype=np.float32),
          "action": rng.integers(0, 18, n, dtype=np.int32),
          "reward": rng.standard_normal(n, dtype=np.float32),
          "discount": np.full(n, 0.99, np.float32)}


def example():
  """One transition (no leading axis)."""
  return {k: v[0] for k, v in transitions(1).items()}


class Runner:
  """One timed operation: ``step(i)`` issues call ``i``, ``sync()`` waits for it.

  The number of calls per measurement is calibrated once so a measurement
  takes about ``target_s`` seconds.
  """

  def __init__(self, step: Callable[[int], None], sync: Callable[[], None], target_s: float):
    self.step, self.sync, self.i, self.times = step, sync, 0, []
    self.cpu_times = []  # process CPU seconds per call (all threads), one per run()
    for _ in range(2):  # compile + warm up
      self._call()
    self.sync()
    t0, n = time.perf_counter(), 0
    while n < 3 or time.perf_counter() - t0 < target_s / 10:
      self._call()
      n += 1
    self.sync()
    per_call = (time.perf_counter() - t0) / n
    self.steps = int(min(50_000, max(3, round(target_s / max(per_call, 1e-9)))))

  def _call(self):
    self.step(self.i)
    self.i += 1

  def run(self):
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(self.steps):
      self._call()
    self.sync()
    self.times.append((time.perf_counter() - t0) / self.steps)
    self.cpu_times.append((time.process_time() - c0) / self.steps)


def measure(runners: Dict[str, Runner], repeats: int) -> Dict[str, float]:
  """Median seconds per call of each runner, measured round-robin."""
  for _ in range(repeats):
    for r in runners.values():
      r.run()
  return {k: float(np.median(r.times)) for k, r in runners.items()}


class Holder:
  """The state of one jitted table, threaded (donated) through every call."""

  def __init__(self, state):
    self.state, self.out = state, None

  def runner(self, fn, *args, target_s):
    def step(i):
      self.state, self.out = fn(self.state, (i * KEYS_PER_CALL) % 2**31, *args)
    return Runner(step, lambda: jax.block_until_ready((self.state, self.out)), target_s)


def consume(batch):
  """A float32 scalar that reads every sampled leaf, so XLA keeps every gather (as a
  learner that uses the whole transition would)."""
  return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree_util.tree_leaves(batch))
