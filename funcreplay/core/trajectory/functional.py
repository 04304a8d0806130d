"""``make_trajectory_table(spec)``: a trajectory table as a NamedTuple of pure functions."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional, Protocol

from funcreplay.core.trajectory import add as add_lib
from funcreplay.core.trajectory import priorities
from funcreplay.core.trajectory import sample as sample_lib
from funcreplay.core.trajectory import state as st
from funcreplay.core.trajectory.spec import TrajectorySpec


class TrajectoryExecutor(Protocol):
  """A backend with a kernel for the window gather of ``sample``
  (``funcreplay.native.trajectory.NativeTrajectoryExecutor``).

  The core never imports ``funcreplay.native``: ``fr.make_trajectory_table``
  (``funcreplay.native.trajectory``) passes its executor here. ``supports(spec)``
  is static; ``available()`` is asked while tracing and must only report.
  ``gather_windows(spec, data, w, valid)`` returns what ``sample.gather_storage``
  returns (the storage leaves' ``[B, L, ...]`` rows, zero where not ``valid``),
  bit for bit; ``draw_closed_form(spec, head, filled, rng, b, replace)`` returns
  ``(w, valid, n)`` as ``sample._closed_form`` (the uniform draw without episode
  tracking or masks; a threefry ``rng``), ``w`` where ``valid``, and
  ``draw_index(spec, ok_bits, ok_tree, rng, b, replace)`` the same for the episode
  index's draw (``sample._index_draw``). The sample calls them under
  ``lax.platform_dependent`` (CPU only).
  """

  def available(self) -> bool: ...

  def supports(self, spec: TrajectorySpec) -> bool: ...

  def gather_windows(self, spec: TrajectorySpec, data, w, valid) -> Any: ...

  def draw_closed_form(self, spec: TrajectorySpec, head, filled, rng, b: int,
                       replace: bool) -> Any: ...

  def draw_index(self, spec: TrajectorySpec, ok_bits, ok_tree, rng, b: int,
                 replace: bool) -> Any: ...


def check_executor(executor) -> Optional[TrajectoryExecutor]:
  """``executor`` if it is None or has the ``TrajectoryExecutor`` methods; a ``TypeError``
  naming what it lacks otherwise (a bare ``True`` is the usual mistake)."""
  if executor is None:
    return None
  missing = [m for m in ("available", "supports", "gather_windows", "draw_closed_form",
                         "draw_index")
             if not callable(getattr(executor, m, None))]
  if missing:
    raise TypeError(f"make_trajectory_table: executor must be None or a trajectory executor "
                    f"(funcreplay.native.trajectory.NATIVE; fr.make_trajectory_table(spec, "
                    f"native=True) picks it), got {executor!r} (lacks {missing}).")
  return executor


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


def make_trajectory_table(spec: TrajectorySpec, *,
                          executor: Optional[TrajectoryExecutor] = None) -> TrajectoryTable:
  """Build the pure functions of the trajectory table ``spec`` describes.

  ``executor``: None (the portable program everywhere) or a ``TrajectoryExecutor``
  whose CPU kernel copies the sampled windows (same batch, same state).
  ``fr.make_trajectory_table(spec, native=...)`` chooses it.

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
  executor = check_executor(executor)

  def sample(state, rng, *, batch_size: int, version=None, where=None, replace: bool = False):
    if spec.max_staleness is not None and version is None:
      raise ValueError(f"sample: the spec sets max_staleness={spec.max_staleness}, so pass "
                       "version= (the current policy version); without it stale windows "
                       "would be sampled.")
    return sample_lib.sample(spec, state, rng, batch_size=batch_size, version=version,
                             where=where, replace=replace, executor=executor)

  def eligible(state, *, version=None, where=None):
    """bool[N]: windows a ``sample`` with these arguments may return (under
    ``Prioritized``, of positive priority: ``count`` is their number)."""
    ok = sample_lib.eligible(spec, state, version=version, where=where)
    return sample_lib.weights(spec, state, ok) > 0 if spec.prioritized else ok

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
