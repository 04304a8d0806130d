"""``make_trajectory_table(spec)``: a trajectory table as a NamedTuple of pure functions."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

from funcreplay.core.trajectory import add as add_lib
from funcreplay.core.trajectory import priorities
from funcreplay.core.trajectory import sample as sample_lib
from funcreplay.core.trajectory import state as st
from funcreplay.core.trajectory.spec import TrajectorySpec


class TrajectoryTable(NamedTuple):
  """Pure functions over a ``TrajectoryState`` with the static ``spec`` closed over.

  ``init() -> state``; ``add(state, steps, *, version=0, mask=None, first=None) ->
  state``; ``sample(state, rng, *, batch_size, version=None, where=None,
  replace=False) -> (state, Sample)``; ``update_priorities(state, slots, keys,
  priorities) -> state``; ``eligible(state, *, version=None, where=None) ->
  bool[N]``; ``count(state, *, version=None, where=None) -> int32[]``. Wrap them
  in ``jax.jit`` (``batch_size`` and ``replace`` static) or call them inside a
  jitted / scanned step; states ``vmap``.
  """

  spec: TrajectorySpec
  init: Callable
  add: Callable
  sample: Callable
  update_priorities: Callable
  eligible: Callable
  count: Callable


def make_trajectory_table(spec: TrajectorySpec) -> TrajectoryTable:
  """Build the pure functions of the trajectory table ``spec`` describes.

  Example::

    spec = fr.TrajectorySpec(num_envs=16, time_capacity=65536, sequence_length=32,
                             period=8, signature=step_example)
    table = fr.make_trajectory_table(spec)
    state = table.init()
    state = table.add(state, steps)  # leaves [16, t, ...]
    state, batch = table.sample(state, rng, batch_size=64)  # leaves [64, 32, ...]
  """
  if not isinstance(spec, TrajectorySpec):
    raise TypeError(f"make_trajectory_table expects a TrajectorySpec, got "
                    f"{type(spec).__name__}.")

  def sample(state, rng, *, batch_size: int, version=None, where=None, replace: bool = False):
    if spec.max_staleness is not None and version is None:
      raise ValueError(f"sample: the spec sets max_staleness={spec.max_staleness}, so pass "
                       "version= (the current policy version); without it stale windows "
                       "would be sampled.")
    return sample_lib.sample(spec, state, rng, batch_size=batch_size, version=version,
                             where=where, replace=replace)

  def eligible(state, *, version=None, where=None):
    """bool[N]: windows a ``sample`` with these arguments may return."""
    return sample_lib.eligible(spec, state, version=version, where=where)

  def count(state, *, version=None, where=None):
    """int32[]: the number of such windows (O(1) or O(E) without masks, else O(N)); under
    ``Prioritized`` only windows of positive priority count."""
    if spec.prioritized and not sample_lib.masked(spec, version=version, where=where):
      return state.positive
    if spec.prioritized or sample_lib.masked(spec, version=version, where=where):
      ok = sample_lib.eligible(spec, state, version=version, where=where)
      if spec.prioritized:
        ok = sample_lib.weights(spec, state, ok) > 0
      return ok.sum(dtype="int32")
    return st.count_valid(spec, state)

  p = functools.partial
  return TrajectoryTable(
      spec=spec,
      init=p(st.init_state, spec),
      add=p(add_lib.add, spec),
      sample=sample,
      update_priorities=p(priorities.update_priorities, spec),
      eligible=eligible,
      count=count,
  )
