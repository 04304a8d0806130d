"""Sampling: draws, the bookkeeping after a draw, eligibility, importance weights."""

from funcreplay.core.sampling.sample import (
    ROUNDS,
    importance_weights,
    restore_zeroed,
    ring_window,
    sample,
)

__all__ = ["ROUNDS", "importance_weights", "restore_zeroed", "ring_window", "sample"]
