"""``TrajectoryState`` (the table as a value) and the window geometry read from it.

Window ``w = env * W + j`` starts at ring position ``s = j * period`` of its
environment's time axis. With ``head`` the env's next write position and
``filled`` its stored steps, the window's start lies ``d = ((head - s - 1)
mod T) + 1`` steps behind the head (``1 <= d <= T``) and the window holds
stored, complete data iff ``L <= d <= filled``: its ``L`` steps are all
written (``d >= L``: it does not reach the write head) and its first step is
not overwritten (``d <= filled``). A step overwrites the window's start before
any other of its steps (the head moves forward), so an overwritten window is
never handed out (BUILD.md "Trajectory tables").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from funcreplay.core import counters as ctr
from funcreplay.core.state import register_dataclass
from funcreplay.core.trajectory import index, rows
from funcreplay.core.trajectory.spec import TrajectorySpec

COUNTERS = ("steps", "samples")
"""Two-word counters of ``TrajectoryState.counters`` (rows: steps added, windows sampled)."""


@register_dataclass
@dataclasses.dataclass(frozen=True)
class TrajectoryState:
  """A trajectory table as a pytree of preallocated arrays.

  E envs, T = time_capacity, N = num_windows, P = ``index.tree_size(N)``.

  Attributes:
    data: the step storage: the step pytree with leading ``[E, T]`` axes on every
      leaf or, when every leaf is 4 bytes wide (``rows.packed``), one
      ``uint32[E, T, R]`` array of each step's leaves as words
      (``rows.unpack(spec, data, 2)`` gives the pytree back).
    head: int32[E] next ring position written per env.
    filled: int32[E] stored steps per env (saturates at T).
    written: uint32[E] steps ever written per env, modulo 2**32 (window keys).
    since_first: int32[E] steps since the env's latest episode start,
      saturated at L (``cross_episodes=False`` only; shape [0] otherwise).
    ok_bits: uint32[ceil(N / 32)] bit ``w`` set iff window ``w`` is complete and
      crosses no episode start, and
    ok_tree: int32[2P] count tree of the set bits per word (``index``;
      ``cross_episodes=False`` only, shape [0] otherwise: the geometry alone
      decides).
    version: int32[N] version of the window's first step.
    times_sampled: int32[N] samples of the window since its first step was written.
    priority: float32[N] (``Prioritized`` only; shape [0] otherwise).
    weight_tree: float32[2P'] sum tree of the sampleable windows' ``priority**alpha``
      (``Prioritized`` only, P' = ``spec.tree_size``; shape [0] otherwise).
    positive: int32[] its positive leaves: the eligible windows (0 under ``Uniform``).
    max_priority: float32[] largest priority set so far (1.0 on a fresh table).
    counters: uint32[2, 2] two-word counters, rows ``COUNTERS``.
  """

  data: Any
  head: jnp.ndarray
  filled: jnp.ndarray
  written: jnp.ndarray
  since_first: jnp.ndarray
  ok_bits: jnp.ndarray
  ok_tree: jnp.ndarray
  version: jnp.ndarray
  times_sampled: jnp.ndarray
  priority: jnp.ndarray
  weight_tree: jnp.ndarray
  positive: jnp.ndarray
  max_priority: jnp.ndarray
  counters: jnp.ndarray

  def replace(self, **changes) -> "TrajectoryState":
    return dataclasses.replace(self, **changes)

  def counter(self, name: str) -> int:
    """Host-side exact value of counter ``name`` (one of ``COUNTERS``)."""
    return ctr.to_int(self.counters[COUNTERS.index(name)])


def init_state(spec: TrajectorySpec) -> TrajectoryState:
  """A fresh, empty state for ``spec`` (every buffer preallocated)."""
  e, n = spec.num_envs, spec.num_windows
  track = spec.tracks_episodes
  ok_bits, ok_tree = index.empty(n if track else 0)
  return TrajectoryState(
      data=rows.empty(spec, (e, spec.time_capacity)),
      head=jnp.zeros((e,), jnp.int32),
      filled=jnp.zeros((e,), jnp.int32),
      written=jnp.zeros((e,), jnp.uint32),
      since_first=jnp.full((e if track else 0,), spec.sequence_length, jnp.int32),
      ok_bits=ok_bits if track else jnp.zeros((0,), jnp.uint32),
      ok_tree=ok_tree if track else jnp.zeros((0,), jnp.int32),
      version=jnp.zeros((n,), jnp.int32),
      times_sampled=jnp.zeros((n,), jnp.int32),
      priority=jnp.zeros((n if spec.prioritized else 0,), jnp.float32),
      weight_tree=jnp.zeros((2 * spec.tree_size if spec.prioritized else 0,), jnp.float32),
      positive=jnp.zeros((), jnp.int32),
      max_priority=jnp.ones((), jnp.float32),
      counters=jnp.zeros((len(COUNTERS), 2), jnp.uint32),
  )


def distance(spec: TrajectorySpec, state: TrajectoryState, w):
  """``(env, start, d)`` of window ids ``w`` (int32[...]): its env, the ring position
  of its first step, and how many steps that lies behind the env's head (1..T)."""
  t = spec.time_capacity
  env = w // spec.windows_per_env
  start = (w % spec.windows_per_env) * spec.period
  d = (state.head[env] - start + (t - 1)) % t + 1
  return env, start, d


def stored(spec: TrajectorySpec, state: TrajectoryState, w):
  """bool[...]: window ids ``w`` hold complete, not overwritten data (the geometry)."""
  env, _, d = distance(spec, state, w)
  return (d >= spec.sequence_length) & (d <= state.filled[env])


def keys(spec: TrajectorySpec, state: TrajectoryState, w):
  """uint32[...]: key of windows ``w``: ``(first step's index in its env) * E + env``
  modulo 2**32 (unique among stored windows, new for every rewrite of a window id)."""
  env, _, d = distance(spec, state, w)
  first = state.written[env] - d.astype(jnp.uint32)
  return first * jnp.uint32(spec.num_envs) + env.astype(jnp.uint32)


def valid_windows(spec: TrajectorySpec, state: TrajectoryState, w):
  """bool[...]: windows ``w`` that may be sampled before any mask (staleness, reuse,
  ``where``): stored and, when episodes are tracked, crossing no episode start."""
  if spec.tracks_episodes:
    return index.is_set(state.ok_bits, w)
  return stored(spec, state, w)


def all_windows(spec: TrajectorySpec):
  return jnp.arange(spec.num_windows, dtype=jnp.int32)


def count_valid(spec: TrajectorySpec, state: TrajectoryState):
  """int32[]: windows ``valid_windows`` admits (O(1) from the tree, else O(E))."""
  if spec.tracks_episodes:
    return index.count(state.ok_tree)
  return jnp.sum(per_env_counts(spec, state)[1])


def per_env_counts(spec: TrajectorySpec, state: TrajectoryState):
  """``(d0 int32[E], count int32[E])``: per env, the smallest distance ``d >= L`` of a
  window start (``d = head - start`` is ``head`` modulo ``period``) and the number
  of stored windows, whose distances are ``d0, d0 + period, ...`` up to ``filled``."""
  p, ln = spec.period, spec.sequence_length
  d0 = ln + (state.head - ln) % p
  count = jnp.where(state.filled >= d0, (state.filled - d0) // p + 1, 0)
  return d0, count
