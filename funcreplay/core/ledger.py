"""The ledger: a table's scalars and counters bit-packed into one ``uint32`` array.

``TableState.ledger`` holds ``write_pos``, ``next_key``, ``max_priority``,
``limiter_diff`` and every counter (two words each) in ``LEDGER_SIZE`` words,
so an operation reads and writes them as one array (one buffer for XLA and
the native kernels, which find each entry through ``ledger_words()``).
This module is the codec; ``TableState``'s properties read through it.
"""

from __future__ import annotations

from typing import Any, Dict

import jax.numpy as jnp
import numpy as np
from jax import lax

COUNTERS = (
    "inserts",            # items inserted (mask=True rows)
    "samples",            # valid rows handed out by sample
    "deletes",            # items removed by delete()
    "evicted_capacity",   # items overwritten/removed by the remover
    "evicted_stale",      # items removed by evict_stale()
    "evicted_reuse",      # items removed on reaching max_times_sampled
    "removed_reuse_sum",  # sum of times_sampled over every removed item
    "sampled_staleness_sum",  # sum of (version - item version) over sampled rows
    "invalid_priorities",  # negative / NaN / inf priorities clamped to 0
)


# The ledger: the table's scalars and counters packed into one uint32 array.
# Words 0-3 hold the bit patterns of ``LEDGER_SCALARS`` (each in the dtype
# given below); then each of ``COUNTERS`` takes two words ``[hi, lo]``.
LEDGER_SCALARS = (
    ("write_pos", jnp.int32),
    ("next_key", jnp.uint32),
    ("max_priority", jnp.float32),
    ("limiter_diff", jnp.int32),
)
LEDGER_FIELDS = tuple(name for name, _ in LEDGER_SCALARS) + ("counters",)
SLOTS = {name: i for i, (name, _) in enumerate(LEDGER_SCALARS)}
COUNTER_SLOTS = {name: len(LEDGER_SCALARS) + 2 * i for i, name in enumerate(COUNTERS)}
LEDGER_SIZE = len(LEDGER_SCALARS) + 2 * len(COUNTERS)


def _is_host(x) -> bool:
  return isinstance(x, (np.ndarray, np.generic, int, float))


def checked(ledger):
  if np.shape(ledger)[-1:] != (LEDGER_SIZE,):
    raise ValueError(f"state.ledger has shape {list(np.shape(ledger))}; a TableState's ledger "
                     f"holds {LEDGER_SIZE} uint32 words on its last axis (see "
                     "funcreplay.core.ledger.LEDGER_FIELDS).")
  return ledger


def ledger_word(ledger, i: int, dtype):
  """Word ``i`` of ``ledger`` (any leading dims) reinterpreted as ``dtype``."""
  word = checked(ledger)[..., i]
  if isinstance(ledger, np.ndarray):
    return np.asarray(word).view(np.dtype(dtype))
  return lax.bitcast_convert_type(word, dtype)


def _as_word(x, dtype):
  """``x`` converted to ``dtype``, its bits as uint32 (same leading dims)."""
  if _is_host(x):
    return np.asarray(np.asarray(x).astype(np.dtype(dtype))).view(np.uint32)
  return lax.bitcast_convert_type(jnp.asarray(x).astype(dtype), jnp.uint32)


def pack_ledger(*, write_pos, next_key, max_priority, limiter_diff, counters):
  """The ``ledger`` (uint32[..., LEDGER_SIZE]) holding these scalars and counters.

  Numpy in, numpy out (host states stay on the host); anything else gives a
  ``jax.Array``. Leading dims (a sharded or vmapped state) broadcast.
  """
  if set(counters) != set(COUNTERS):
    raise ValueError(f"counters must hold exactly {list(COUNTERS)}; missing "
                     f"{sorted(set(COUNTERS) - set(counters))}, unexpected "
                     f"{sorted(set(counters) - set(COUNTERS))}.")
  scalars = dict(write_pos=write_pos, next_key=next_key, max_priority=max_priority,
                 limiter_diff=limiter_diff)
  words = [_as_word(scalars[name], dtype)[..., None] for name, dtype in LEDGER_SCALARS]
  words += [_as_word(counters[name], jnp.uint32) for name in COUNTERS]
  xp = np if all(isinstance(w, np.ndarray) for w in words) else jnp
  lead = np.broadcast_shapes(*(np.shape(w)[:-1] for w in words))
  return xp.concatenate([xp.broadcast_to(w, lead + np.shape(w)[-1:]) for w in words], axis=-1)


def ledger_words() -> tuple:
  """First word of each ledger entry: the scalars in ``LEDGER_SCALARS`` order, then
  the counters in ``COUNTERS`` order (the native kernels' ``LedgerEntry``)."""
  return tuple(SLOTS[name] for name, _ in LEDGER_SCALARS) + tuple(
      COUNTER_SLOTS[name] for name in COUNTERS)


def ledger_fields(state) -> Dict[str, Any]:
  """The ledger's contents by name: ``pack_ledger(**ledger_fields(state))``."""
  return {name: getattr(state, name) for name in LEDGER_FIELDS}
