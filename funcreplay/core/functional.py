"""``make_table(spec)``: the table as a NamedTuple of pure functions (optax style)."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

from funcreplay.core import executor as executor_lib
from funcreplay.core import ops, sampling
from funcreplay.core import state as state_lib
from funcreplay.core.spec import TableSpec


class FunctionalTable(NamedTuple):
  """Pure functions over a ``TableState``, with the static ``spec`` closed over.

  Wrap them in ``jax.jit`` (``batch_size`` and ``replace`` of ``sample`` are
  static) or call them inside your own jitted / scanned training step.

  The query functions share one signature: ``sample(state, rng, *, batch_size,
  version=None, where=None, replace=False, stratified=False)``, ``count(state, *,
  version=None, where=None)``, ``eligible(state, *, version=None, where=None)``,
  ``can_sample(state, batch_size=1, *, version=None, where=None)``. With
  ``spec.max_staleness`` set, ``sample`` needs ``version`` (a ``ValueError``
  otherwise: it would hand out stale items); the queries without ``version``
  answer with the staleness mask off (e.g. ``count`` = every stored item).
  The host-only switches of the sampling engine (``enabled``, ``split_key``,
  ``packed``) are not here: the host ``Table`` (``host/programs.py``) uses them.
  """

  spec: TableSpec
  init: Callable[[], state_lib.TableState]
  insert: Callable[..., state_lib.TableState]
  sample: Callable[..., Any]
  delete: Callable[..., state_lib.TableState]
  update_priorities: Callable[..., state_lib.TableState]
  set_metadata: Callable[..., state_lib.TableState]
  evict_stale: Callable[..., state_lib.TableState]
  count: Callable[..., Any]
  eligible: Callable[..., Any]
  can_insert: Callable[..., Any]
  can_sample: Callable[..., Any]
  stats: Callable[..., ops.Stats]


def make_table(spec: TableSpec, *,
               executor: Optional[executor_lib.Executor] = None) -> FunctionalTable:
  """Build the pure functions of a table described by ``spec``.

  ``executor``: run the operations that have one through its CPU kernels
  (``core.executor``; same semantics, far fewer XLA operations); None keeps
  the portable JAX implementation everywhere. The public ``fr.make_table``
  (``funcreplay.native.functional``) chooses the native executor by default.

  Example::

    table = make_table(spec)
    state = table.init()
    state = table.insert(state, items, version=v)
    state, batch = table.sample(state, rng, batch_size=256, version=v)
  """
  if not isinstance(spec, TableSpec):
    raise TypeError(f"make_table expects a TableSpec, got {type(spec).__name__}.")
  if spec.ragged:
    names = [spec.signature.names[i] for i, _ in spec.ragged]
    raise ValueError(f"make_table: leaves {names} are fr.Ragged; their values live in the host "
                     "fr.Table's arenas (BUILD.md 'Ragged leaves live on the host'). In jit, "
                     "declare them as padded arrays plus a length leaf.")
  p = functools.partial
  native = executor_lib.check(executor, "make_table")

  def sample(state, rng, *, batch_size: int, version=None, where=None, replace: bool = False,
             stratified: bool = False):
    """``(state, Sample)``: ``batch_size`` items (``sampling.sample`` for the arguments)."""
    require_version(spec, version, "sample")
    return sampling.sample(spec, state, rng, batch_size=batch_size, version=version,
                           where=where, replace=replace, stratified=stratified, native=native)

  def count(state, *, version=None, where=None):
    """int32[]: the items a ``sample`` with these arguments may return (without
    ``version``: the staleness mask off)."""
    return ops.count(spec, state, where=where, version=version)

  def eligible(state, *, version=None, where=None):
    """bool[C]: the slots a ``sample`` with these arguments may return (without
    ``version``: the staleness mask off)."""
    return ops.eligible_mask(spec, state, version=version, where=where)

  def can_sample(state, batch_size: int = 1, *, version=None, where=None):
    """bool[]: the rate limiter admits a ``sample`` of ``batch_size`` and enough items
    are eligible (without ``version``: the staleness mask off)."""
    return ops.can_sample(spec, state, batch_size, version=version, where=where)

  return FunctionalTable(
      spec=spec,
      init=p(state_lib.init_state, spec),
      insert=p(ops.insert, spec, native=native),
      sample=sample,
      delete=p(ops.delete, spec),
      update_priorities=p(ops.update_priorities, spec, native=native),
      set_metadata=p(ops.set_metadata, spec),
      evict_stale=p(ops.evict_stale, spec),
      count=count,
      eligible=eligible,
      can_insert=p(ops.can_insert, spec),
      can_sample=can_sample,
      stats=p(ops.stats, spec),
  )


def require_version(spec: TableSpec, version, what: str) -> None:
  """Raise when ``spec`` has ``max_staleness`` but the pure call got no ``version``.

  Without a version the staleness mask is off, so a pure call would silently
  treat stale items as eligible; the host ``Table`` always passes its own.
  """
  if spec.max_staleness is not None and version is None:
    raise ValueError(f"{what}: the spec sets max_staleness={spec.max_staleness}, so pass "
                     "version= (the current policy version); without it stale items would "
                     "be sampled.")
