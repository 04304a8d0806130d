"""Host-side validation shared by ``Table`` and ``Ingestor``.

Every input of a host call is checked here *before* the state is touched, so
a bad call raises ``ValueError`` / ``TypeError`` naming what was wrong and
leaves the table exactly as it was.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from funcreplay.core import selectors as sel
from funcreplay.core import signature as sig_lib
from funcreplay.core.spec import TableSpec

I32 = np.iinfo(np.int32)

Where = Union[None, np.ndarray, jax.Array, Mapping[str, Union[int, Sequence[int]]]]


def check_items(signature: sig_lib.Signature, items: Any, *, batched: bool,
                what: str) -> Tuple[list, int]:
  """``(leaves, B)`` of ``items``, or the boundary's clear error prefixed with ``what``.

  The one item check of the host: ``Table.insert``, ``Ingestor.put`` /
  ``put_batch`` and ``SequenceWriter.append`` all come here (the Ingestor's
  generated fast path accepts only what this function accepts). Leaves must
  have exactly the signature's dtypes; unbatched Python scalars are converted
  only when lossless (``funcreplay.core.signature.scalar_leaf``: a ``1.5`` or a
  ``True`` for an int32 leaf is a ``TypeError``, ``2**40`` a ``ValueError``).
  """
  try:
    return sig_lib.check_items(signature, items, batched=batched)
  except (ValueError, TypeError) as e:
    raise type(e)(f"{what}: {e}") from None


def bucket(n: int, cap: int) -> int:
  """Smallest power of two >= n, capped at ``cap`` (n <= cap)."""
  return min(1 << max(0, (n - 1).bit_length()), cap)


def as_array(x, what: str) -> np.ndarray:
  """numpy view of a numpy / JAX / torch (anything with ``__array__``) array or a list."""
  try:
    a = np.asarray(x)
  except Exception as e:  # noqa: BLE001 (re-raised with context)
    raise TypeError(f"{what}: cannot convert {type(x).__name__} to an array ({e}).") from None
  if a.dtype == object:
    raise TypeError(f"{what}: expected numbers, got {type(x).__name__} of Python objects.")
  return a


def int_rows(x, n: int, what: str, lo: int = I32.min, hi: int = I32.max) -> np.ndarray:
  """int32[n] from a scalar or an ``[n]`` integer array; range-checked."""
  a = as_array(x, what)
  if a.dtype.kind not in "iu":
    raise TypeError(f"{what}: expected integers, got dtype {a.dtype.name}.")
  if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != n):
    raise ValueError(f"{what}: expected a scalar or shape [{n}], got {list(a.shape)}.")
  if a.size and (a.min() < lo or a.max() > hi):
    raise ValueError(f"{what}: values must lie in [{lo}, {hi}], got range "
                     f"[{a.min()}, {a.max()}].")
  return np.broadcast_to(a.astype(np.int64), (n,)).astype(np.int32)


def priority_rows(x, n: int, what: str, check: Optional[np.ndarray] = None) -> np.ndarray:
  """float32[n] priorities; NaN / inf / negative (where ``check``) -> ValueError."""
  a = as_array(x, what)
  if a.dtype.kind not in "fiu":
    raise TypeError(f"{what}: expected a float array, got dtype {a.dtype.name}.")
  if a.ndim > 1 or (a.ndim == 1 and a.shape[0] != n):
    raise ValueError(f"{what}: expected a scalar or shape [{n}], got {list(a.shape)}.")
  with np.errstate(over="ignore", invalid="ignore"):
    p = np.broadcast_to(a.astype(np.float32), (n,))
  bad = ~np.isfinite(p) | (p < 0)
  if check is not None:
    bad &= check
  if bad.any():
    i = int(np.argmax(bad))
    raise ValueError(f"{what}: priorities must be finite and >= 0 (as float32); row {i} is "
                     f"{a.reshape(-1)[i if a.ndim else 0]!r} ({int(bad.sum())} bad rows). "
                     "Clip or fix them before calling.")
  return np.ascontiguousarray(p + np.float32(0.0))  # -0.0 + 0.0 is 0.0: one zero stored


def has_denormal(p: np.ndarray, rows: np.ndarray) -> bool:
  """True if a float32 ``p`` on ``rows`` is denormal (nonzero, below the smallest normal)."""
  a = np.abs(p[rows])
  return bool(np.any((a > 0) & (a < np.finfo(np.float32).tiny)))


def pad(a: np.ndarray, n: int, fill=0) -> np.ndarray:
  if a.shape[0] == n:
    return a
  out = np.full((n, *a.shape[1:]), fill, a.dtype)
  out[:a.shape[0]] = a
  return out


def pad_leaf(x, n: int):
  """Pad a numpy or JAX leaf ``[B, ...]`` with zero rows to ``[n, ...]``."""
  b = x.shape[0]
  if b == n:
    return x
  if isinstance(x, jax.Array):
    return jnp.concatenate([x, jnp.zeros((n - b, *x.shape[1:]), x.dtype)])
  return pad(np.asarray(x), n)


def describe_limiter(spec: TableSpec) -> str:
  """The spec's limiter as the constructor call that makes it (``Queue(n)`` / ``Stack(n)``
  only for the limiters those make: an integer bound ``n >= 1``)."""
  lim = spec.rate_limiter
  if math.isinf(lim.max_diff) and math.isinf(lim.min_diff):
    return f"MinSize({lim.min_size_to_sample})"
  if (lim.samples_per_insert == 1.0 and lim.min_size_to_sample == 1 and lim.min_diff == 0.0
      and lim.max_diff >= 1 and float(lim.max_diff).is_integer()):
    name = "Stack" if isinstance(spec.sampler, sel.Lifo) else "Queue"
    return f"{name}({int(lim.max_diff)})"
  return (f"SampleToInsertRatio(samples_per_insert={lim.samples_per_insert}, "
          f"min_size_to_sample={lim.min_size_to_sample}, window=[{lim.min_diff}, "
          f"{lim.max_diff}])")


def check_limiter_reachable(spec: TableSpec) -> None:
  """A host table blocks a sample until its limiter allows it: refuse a limiter that never
  can, one that waits for more items than the table holds (Reverb accepts it, and its
  samples wait forever)."""
  need = spec.rate_limiter.min_size_to_sample
  if need > spec.capacity:
    raise ValueError(
        f"Table: the rate limiter {describe_limiter(spec)} waits for "
        f"min_size_to_sample={need} items, but the table holds at most capacity="
        f"{spec.capacity}: every sample would block until its timeout. Lower "
        f"min_size_to_sample or raise the capacity.")


def check_metadata_columns(metadata, columns, what: str) -> Mapping[str, Any]:
  """``metadata`` if it is a dict over (a subset of) ``columns``; else a clear error."""
  if not isinstance(metadata, Mapping):
    raise TypeError(f"{what}: metadata must be a dict column -> ints, got "
                    f"{type(metadata).__name__}.")
  unknown = sorted(set(metadata) - set(columns))
  if unknown:
    raise ValueError(f"{what}: unknown metadata columns {unknown}; the spec declares "
                     f"{list(columns)}.")
  return metadata


def check_int(x, what: str, lo: int = I32.min, hi: int = I32.max) -> int:
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
    if isinstance(x, (np.ndarray, jax.Array)) and x.ndim == 0 and x.dtype.kind in "iu":
      x = int(x)
    else:
      raise TypeError(f"{what} must be an int, got {type(x).__name__} {x!r}.")
  if not lo <= int(x) <= hi:
    raise ValueError(f"{what} must lie in [{lo}, {hi}], got {int(x)}.")
  return int(x)


def check_timeout(timeout) -> Optional[float]:
  """``timeout`` in seconds as a float, or None to wait forever. ``inf`` (and anything past
  ``threading.TIMEOUT_MAX``, ~292 years, beyond which ``Condition.wait`` raises
  ``OverflowError``) waits forever too: None."""
  if timeout is None:
    return None
  if isinstance(timeout, (bool, np.bool_)) \
      or not isinstance(timeout, (int, float, np.integer, np.floating)) \
      or math.isnan(timeout) or timeout < 0:
    raise ValueError(f"timeout must be None (wait forever) or a number of seconds >= 0, "
                     f"got {timeout!r}.")
  timeout = float(timeout)
  return None if timeout >= threading.TIMEOUT_MAX else timeout


def retimed(e: TimeoutError, timeout) -> TimeoutError:
  """A table's ``TimeoutError`` ``e`` ("... timed out after T s: why ...") naming ``timeout``
  as its wait: callers that wait in slices (``TorchSampler``'s prefetch thread, the replay
  actor's cancellable samples) report the caller's timeout, not the last slice's."""
  return TimeoutError(re.sub(r"timed out after \S+ s", f"timed out after {timeout} s",
                             str(e), count=1))


F32_MAX = float(np.finfo(np.float32).max)


def check_version_priority(version, priority, what: str):
  """``(version, priority)`` of ONE item, checked: an int32 version, a finite float32
  priority >= 0; None stays None. ``what`` names the call in the errors. (Its metadata:
  ``funcreplay.host.rollout.columns.check_item_extras``.)"""
  if version is not None:
    version = check_int(version, f"{what} version")
  if priority is not None:
    try:
      p = float(priority)
    except (TypeError, ValueError):
      raise TypeError(f"{what}: priority must be a float, got "
                      f"{type(priority).__name__} {priority!r}.") from None
    if not 0.0 <= p <= F32_MAX:  # also rejects NaN
      raise ValueError(f"{what}: priority must be finite and >= 0 (as float32), got "
                       f"{priority!r}.")
    priority = p + 0.0  # -0.0 + 0.0 is 0.0
  return version, priority
