"""``fr.make_table``: the core's ``make_table`` with the executor chosen (native on CPU)."""

from __future__ import annotations

from typing import Optional

from funcreplay.core import functional
from funcreplay.core.spec import TableSpec
from funcreplay.native import executor


def make_table(spec: TableSpec, *, native: Optional[bool] = None) -> functional.FunctionalTable:
  """Build the pure functions of a table described by ``spec``.

  ``native``: on CPU, run the operations that have one through a native
  kernel (``funcreplay.native``: same semantics, far fewer XLA operations).
  False keeps the portable JAX implementation everywhere; None (default):
  the ``FUNCREPLAY_NATIVE`` environment variable, read now (unset: True).
  Both give the same results for the same ``(state, key)``.

  Example::

    table = fr.make_table(spec)
    state = table.init()
    state = table.insert(state, items, version=v)
    state, batch = table.sample(state, rng, batch_size=256, version=v)
  """
  if not isinstance(spec, TableSpec):
    raise TypeError(f"make_table expects a TableSpec, got {type(spec).__name__}.")
  return functional.make_table(spec, executor=executor.choose(native))
