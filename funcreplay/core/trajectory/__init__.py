"""Trajectory tables: per-environment time axes, windows sampled inside ``jit``.

``spec`` (``TrajectorySpec``), ``state`` (``TrajectoryState``, window
geometry), ``add``, ``sample``, ``priorities``, ``nstep`` (n-step returns),
``functional`` (``make_trajectory_table``). BUILD.md "Trajectory tables".
"""

from funcreplay.core.trajectory.functional import TrajectoryTable, make_trajectory_table
from funcreplay.core.trajectory.nstep import n_step_returns, n_step_target
from funcreplay.core.trajectory.spec import TrajectorySpec
from funcreplay.core.trajectory.state import TrajectoryState

__all__ = ["TrajectorySpec", "TrajectoryState", "TrajectoryTable", "make_trajectory_table",
           "n_step_returns", "n_step_target"]
