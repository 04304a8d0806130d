"""A plain-Python reference model of a trajectory table (for
tests/core/trajectory/test_trajectory*.py)."""

from __future__ import annotations

import numpy as np


class TrajectoryModel:
  """Every step ever written, per env: the windows are recomputed from the definition.

  A window of env ``e`` starting at step ``a`` (0-based count of that env's
  steps) is sampleable iff ``a % period == 0``, its ``L`` steps are written
  (``a + L <= n_e``), its first step is still stored (``a >= n_e - T``) and,
  when episodes are tracked, none of steps ``a+1 .. a+L-1`` begins an episode.
  """

  def __init__(self, spec):
    self.spec = spec
    self.steps = [[] for _ in range(spec.num_envs)]    # payload per step
    self.first = [[] for _ in range(spec.num_envs)]
    self.version = [[] for _ in range(spec.num_envs)]
    self.times = {}  # (env, a) -> times sampled

  def add(self, payload, version=0, mask=None, first=None):
    """``payload`` [E, t] of ints."""
    payload = np.asarray(payload)
    e, t = payload.shape
    for i in range(e):
      if mask is not None and not mask[i]:
        continue
      for k in range(t):
        self.steps[i].append(int(payload[i, k]))
        self.first[i].append(bool(first[i, k]) if first is not None else False)
        self.version[i].append(int(version))

  def windows(self):
    """{(env, a): window id} of the sampleable windows (before masks)."""
    s = self.spec
    out = {}
    for e in range(s.num_envs):
      n = len(self.steps[e])
      for a in range(max(0, n - s.time_capacity), n - s.sequence_length + 1):
        if a % s.period:
          continue
        if s.tracks_episodes and any(self.first[e][a + 1:a + s.sequence_length]):
          continue
        out[(e, a)] = e * s.windows_per_env + (a % s.time_capacity) // s.period
    return out

  def key(self, e, a):
    return (a * self.spec.num_envs + e) % 2**32

  def data(self, e, a):
    return self.steps[e][a:a + self.spec.sequence_length]
