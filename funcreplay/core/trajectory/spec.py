"""``TrajectorySpec``: the static, hashable configuration of a trajectory table.

A trajectory table keeps one time axis per environment (``[num_envs,
time_capacity, ...]`` per leaf, each step stored once) and hands out windows
of ``sequence_length`` consecutive steps that start at multiples of
``period`` (BUILD.md "Trajectory tables"). Like ``TableSpec`` it lives
outside the state: the pure functions of ``make_trajectory_table`` close over
it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from funcreplay.core import selectors as sel
from funcreplay.core.signature import Signature, as_signature

# Flat step indices ``env * time_capacity + t`` and window ids are int32; keys
# ``(start step * num_envs + env) mod 2**32`` stay unique among stored windows
# while ``num_envs * time_capacity <= 2**32``: this bound covers both.
MAX_STEPS = 1 << 30


def _int(name: str, value, lo: int) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < lo:
    raise ValueError(f"TrajectorySpec.{name} must be an int >= {lo}, got {value!r}.")
  return value


@dataclasses.dataclass(frozen=True, init=False)
class TrajectorySpec:
  """Static description of a trajectory table (E envs, T steps each, windows of L).

  Attributes:
    num_envs: ``E``, the environments (rows) that ``add`` advances.
    time_capacity: ``T`` steps kept per environment (a ring per env);
      a multiple of ``period``.
    sequence_length: ``L`` steps per sampled window (``1 <= L <= T``).
    period: windows start at steps whose index (per env, counted from the
      env's first step) is a multiple of ``period``: ``period = 1`` gives
      every overlapping window, ``period = L`` disjoint ones.
    signature: one *step* (a pytree of ``jax.ShapeDtypeStruct`` or an
      example step); ``add`` takes leaves ``[E, t, *leaf_shape]``.
    sampler: ``Uniform()`` or ``Prioritized(alpha)`` over windows.
    max_times_sampled: a window is no longer sampled after this many
      samples (0: no limit).
    max_staleness: windows whose first step's version is older than
      ``version - max_staleness`` are not sampled (None: no limit).
    cross_episodes: False (default): ``add(..., first=...)`` marks the steps
      that begin an episode and no window contains such a step anywhere but
      at its start. True: episode starts are not tracked (``first`` is
      refused) and any ``L`` consecutive stored steps form a window; the
      uniform sample then needs no index at all (closed form).
    default_priority: priority of a new window under ``Prioritized``; None:
      the largest priority set so far (1.0 on a fresh table), as in PER.
  """

  num_envs: int
  time_capacity: int
  sequence_length: int
  period: int
  signature: Signature
  sampler: Any
  max_times_sampled: int
  max_staleness: Optional[int]
  cross_episodes: bool
  default_priority: Optional[float]

  def __init__(self, num_envs: int, time_capacity: int, sequence_length: int, period: int,
               signature: Any, sampler: Any = None, max_times_sampled: int = 0,
               max_staleness: Optional[int] = None, cross_episodes: bool = False,
               default_priority: Optional[float] = None):
    _int("num_envs", num_envs, 1)
    _int("time_capacity", time_capacity, 1)
    _int("sequence_length", sequence_length, 1)
    _int("period", period, 1)
    if sequence_length > time_capacity:
      raise ValueError(f"TrajectorySpec.sequence_length={sequence_length} exceeds "
                       f"time_capacity={time_capacity}: a window must fit in the stored steps.")
    if time_capacity % period:
      raise ValueError(f"TrajectorySpec.time_capacity={time_capacity} must be a multiple of "
                       f"period={period} (window starts then keep their ring positions).")
    if num_envs * time_capacity > MAX_STEPS:
      raise ValueError(f"TrajectorySpec: num_envs * time_capacity = {num_envs * time_capacity} "
                       f"exceeds {MAX_STEPS} steps (int32 step indices).")
    sampler = sel.Uniform() if sampler is None else sampler
    if not isinstance(sampler, (sel.Uniform, sel.Prioritized)):
      raise TypeError(f"TrajectorySpec.sampler must be fr.Uniform() or fr.Prioritized(...), "
                      f"got {sampler!r}.")
    _int("max_times_sampled", max_times_sampled, 0)
    if max_staleness is not None:
      _int("max_staleness", max_staleness, 0)
    if not isinstance(cross_episodes, bool):
      raise TypeError(f"TrajectorySpec.cross_episodes must be a bool, got {cross_episodes!r}.")
    if default_priority is not None and (not math.isfinite(default_priority)
                                         or default_priority < 0):
      raise ValueError(f"TrajectorySpec.default_priority must be None or finite >= 0, "
                       f"got {default_priority!r}.")
    sig = as_signature(signature)
    for k, v in dict(num_envs=num_envs, time_capacity=time_capacity,
                     sequence_length=sequence_length, period=period, signature=sig,
                     sampler=sampler, max_times_sampled=max_times_sampled,
                     max_staleness=max_staleness, cross_episodes=cross_episodes,
                     default_priority=None if default_priority is None
                     else float(default_priority)).items():
      object.__setattr__(self, k, v)

  def replace(self, **changes) -> "TrajectorySpec":
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    fields.update(changes)
    return TrajectorySpec(**fields)

  @property
  def windows_per_env(self) -> int:
    """``W = T / period``: window ids per environment (one per start position)."""
    return self.time_capacity // self.period

  @property
  def num_windows(self) -> int:
    """``N = E * W``: window id ``w = env * W + start_position // period``."""
    return self.num_envs * self.windows_per_env

  @property
  def tree_size(self) -> int:
    """Leaves of the trees the masked draws build over the windows (power of two >= ``N``)."""
    return 1 << max(0, (self.num_windows - 1).bit_length())

  @property
  def prioritized(self) -> bool:
    return isinstance(self.sampler, sel.Prioritized)

  @property
  def tracks_episodes(self) -> bool:
    """True when windows must not cross an episode start (the index tree is kept)."""
    return not self.cross_episodes
