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
  p = functools.partial
  native = executor_lib.check(executor, "make_table")
  return FunctionalTable(
      spec=spec,
      init=p(state_lib.init_state, spec),
      insert=p(ops.insert, spec, native=native),
      sample=p(sampling.sample, spec, native=native),
      delete=p(ops.delete, spec),
      update_priorities=p(ops.update_priorities, spec, native=native),
      set_metadata=p(ops.set_metadata, spec),
      evict_stale=p(ops.evict_stale, spec),
      count=p(ops.count, spec),
      eligible=p(ops.eligible_mask, spec),
      can_insert=p(ops.can_insert, spec),
      can_sample=p(ops.can_sample, spec),
      stats=p(ops.stats, spec),
  )
