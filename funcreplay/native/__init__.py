"""Native CPU kernels (XLA FFI custom calls) for the hot paths of the table.

On XLA:CPU every operation of a compiled program costs about a microsecond
however small, and the portable ``sample`` is ~100-160 operations (draws,
eligibility, dedup, counters, trees, in-place ordering). A kernel does the
same work in one call. It is used only where it applies and only on CPU:

* ``insert`` with a ``Fifo`` remover (the ring; any sampler);
* ``sample`` with a ``Uniform`` or ``Prioritized`` sampler and a ``Fifo`` or
  ``Uniform`` remover, with or without replacement, staleness / ``where``
  masks and ``max_times_sampled`` (not ``stratified``);
* ``update_priorities`` with a ``Fifo`` or ``Uniform`` remover;
* a trajectory table's ``sample``: the window gather (``native.trajectory``,
  ``fr.make_trajectory_table(spec, native=...)``).

A host ``Table`` on CPU can also run the sample kernel directly on its own
buffers, without a jitted call (``Table.sample_packed(out=...)``;
``funcreplay.host.direct``).

Everything else, and every non-CPU backend (``lax.platform_dependent``),
runs the portable JAX implementation. The kernels run the portable programs'
algorithm with the same random bits (BUILD.md "Bit recipe"): for the same
``(state, key)`` a table gives bit-identical batches and states with the
kernels on or off. Tests check exactly that.

Opt out per table with ``make_table(spec, native=False)`` /
``Table(spec, native=False)``; ``native=None`` (the default) reads the
``FUNCREPLAY_NATIVE`` environment variable (``0``/``false``/``no``/``off``:
portable) when the table's programs are built (``use_native``).
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from funcreplay.core import ledger
from funcreplay.core import rate_limiters as rl
from funcreplay.core import selectors as sel
from funcreplay.core.spec import TableSpec
from funcreplay.native.build import disabled, error, load, loaded

__all__ = ["available", "ensure_built", "error", "ledger_attr", "loaded", "supports_insert",
           "supports_sample", "supports_update_priorities", "use_native"]


def use_native(native: Optional[bool] = None) -> bool:
  """A table's ``native`` argument resolved: True / False as given; None reads
  ``FUNCREPLAY_NATIVE`` now (unset: True). Called where a table's programs are built,
  never inside a trace; there is no process-wide mutable default."""
  if native is None:
    return not disabled()
  return bool(native)


def available() -> bool:
  """True when the kernels are built and registered (builds them on first call)."""
  return load()


def ensure_built() -> bool:
  """Build (if needed), load and register the kernels now; True on success.

  ``fr.make_table`` and the host ``Table`` call this when they build their
  programs, so no trace ever compiles C++. A missing compiler gives one
  ``RuntimeWarning`` and the portable path.
  """
  return load()


def _byte_rows(spec: TableSpec) -> bool:
  """Every item leaf has whole-byte elements: the kernels copy rows as bytes, and
  XLA:CPU packs sub-byte types (int4, uint4, int2, float4...) two or more per byte."""
  return all(jax.dtypes.itemsize_bits(leaf.dtype) % 8 == 0 for leaf in spec.signature.leaves)


def supports_insert(spec: TableSpec) -> bool:
  """True if ``insert`` on ``spec`` has a native kernel (the ``Fifo`` ring remover,
  whole-byte item dtypes, any sampler but a heap: the kernels do not keep the
  heaps' ``TableState.touched`` stamps, so those specs run the portable op)."""
  return sel.is_ring(spec.remover) and _byte_rows(spec) and not spec.touch_stamps


def supports_update_priorities(spec: TableSpec) -> bool:
  """True if ``update_priorities`` on ``spec`` has a native kernel (no order tree, no
  heap sampler: ``TableState.touched`` is kept by the portable op only)."""
  return not spec.needs_remover_tree and not spec.touch_stamps


def supports_sample(spec: TableSpec, stratified: bool) -> bool:
  """True if ``sample`` on ``spec`` has a native kernel: a ``Uniform`` or
  ``Prioritized`` sampler, a remover without an order tree (``Fifo``,
  ``Uniform``), not ``stratified``, whole-byte item dtypes."""
  return (isinstance(spec.sampler, (sel.Uniform, sel.Prioritized))
          and not spec.needs_remover_tree and not stratified and _byte_rows(spec))


def ledger_attr(spec: TableSpec) -> np.ndarray:
  """The kernels' ``ledger`` attribute: int64[13 + 3].

  The word of each ledger entry (``ledger.ledger_words()``: the four scalars,
  then the counters in ``ledger.COUNTERS`` order; ``LedgerEntry`` in
  common.h), then the rate limiter's ``[p, q, DIFF_LIMIT]`` for
  ``rate_limiters.update_diff``.
  """
  p, q = spec.rate_limiter.ratio
  return np.array([*ledger.ledger_words(), p, q, rl.DIFF_LIMIT], np.int64)


def state_aliases(state_ops, first: int) -> dict:
  """``ffi_call``'s ``input_output_aliases`` for state operands ``state_ops`` (operands
  ``first``, ``first + 1``, ...; result ``i`` is operand ``first + i``'s column).

  Empty columns (a feature the spec leaves off: the weight tree of a uniform table, the
  version index without ``max_staleness``) are left out. XLA folds an empty operand into
  a constant, and a result aliased to a constant is a copy: one more operation per call
  (inside ``lax.scan``, per step) for a column with nothing in it. Their results are
  dropped instead (``keep_empty``); the kernels never write an empty column."""
  return {first + i: i for i, x in enumerate(state_ops) if np.size(x) > 0}


def keep_empty(results, state_ops) -> list:
  """``results`` (one per state operand) with each empty column's result replaced by the
  operand itself (``state_aliases``)."""
  return [r if np.size(x) > 0 else x for x, r in zip(state_ops, results)] + list(
      results[len(state_ops):])
