"""The whole ledger rewritten in one vectorized step (one fusion instead of ~15).

``TableState.replace(counters=..., write_pos=...)`` repacks the ledger from
one small operation per counter and scalar plus a concatenate; on XLA:CPU
each costs about a microsecond, which is most of a one-item insert. Here
every two-word counter increment and every scalar write is a select over the
ledger's iota, so XLA emits a single elementwise fusion. Results are bit for
bit those of ``counters.add`` / ``counters.add_sum`` and ``pack_ledger``.
"""

from __future__ import annotations

from typing import Dict, Tuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from funcreplay.core import counters
from funcreplay.core import ledger as ledger_lib
from funcreplay.core.state import TableState

_U32 = jnp.uint32
_SCALAR_WORD = ledger_lib.SLOTS
_SCALAR_DTYPE = dict(ledger_lib.LEDGER_SCALARS)
_COUNTER_WORD = ledger_lib.COUNTER_SLOTS


def count(n) -> Tuple[jnp.ndarray, jnp.ndarray]:
  """The two-word increment ``(hi, lo)`` of a uint32 scalar ``n`` (``counters.add``)."""
  return _U32(0), jnp.asarray(n).astype(_U32)


def total(values, where=None) -> Tuple[jnp.ndarray, jnp.ndarray]:
  """The exact two-word increment ``(hi, lo)`` of ``sum(values[where])`` (non-negative
  int32/uint32, any number of them; ``counters.total``)."""
  return counters.total(values, where)


def update(state: TableState, adds: Dict[str, Tuple], sets: Dict[str, jnp.ndarray]
           ) -> TableState:
  """``state`` with counters incremented by ``adds`` (name -> ``(hi, lo)`` from ``count``
  / ``total``) and ledger scalars (``write_pos``, ``next_key``, ``max_priority``,
  ``limiter_diff``) replaced by ``sets``."""
  led = state.ledger
  size = led.shape[-1]
  # Word masks as literal constants (numpy, static): ``lax.iota(...) == w`` is not
  # constant-folded by XLA, and inside ``lax.scan`` it is hoisted out of the loop as one
  # fusion per mask, run on every call (measured: an in-scan insert b1 call paid ~25 us
  # more for ten of them, as independent operations XLA:CPU hands to its threads).
  iota = np.arange(size)
  inc = jnp.zeros((size,), _U32)
  for name, (hi, lo) in adds.items():
    w = _COUNTER_WORD[name]
    inc = jnp.where(iota == w, hi, jnp.where(iota == w + 1, lo, inc))
  is_lo = np.zeros((size,), bool)
  for w in _COUNTER_WORD.values():
    is_lo = is_lo | (iota == w + 1)
  summed = led + inc
  carry = (is_lo & (summed < led)).astype(_U32)
  # A low word's carry goes to the high word just before it.
  new = summed + jnp.concatenate([carry[1:], jnp.zeros((1,), _U32)])
  for name, value in sets.items():
    word = lax.bitcast_convert_type(jnp.asarray(value).astype(_SCALAR_DTYPE[name]), _U32)
    new = jnp.where(iota == _SCALAR_WORD[name], word, new)
  return state.replace(ledger=new)
