"""Sampling: the weighted draws, eligibility, the bookkeeping after a draw, weights.

``sample`` (sample.py) is the entry point; ``draw`` holds the weighted draws
(``draw_weighted``, ``ROUNDS``), ``eligibility`` the one definition of an
eligible item and of the eligible weight, ``finish`` the bookkeeping after a
draw, ``weights`` the PER importance weights. The sharded table uses the same
functions.
"""

from funcreplay.core.sampling.draw import (
    ROUNDS,
    candidates_per_round,
    draw_weighted,
    restore_zeroed,
    ring_window,
)
from funcreplay.core.sampling.eligibility import eligibility, eligible_weight
from funcreplay.core.sampling.finish import finish
from funcreplay.core.sampling.sample import sample
from funcreplay.core.sampling.weights import importance_weights

__all__ = ["ROUNDS", "candidates_per_round", "draw_weighted", "eligibility", "eligible_weight",
           "finish", "importance_weights", "restore_zeroed", "ring_window", "sample"]
