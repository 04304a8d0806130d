"""``NATIVE``: the native CPU kernels as a ``funcreplay.core.executor.Executor``.

The core's operations take it as their ``native`` argument; ``fr.make_table``
and the host ``Table`` pass it when the native kernels are enabled
(``funcreplay.native.use_native``).
"""

from __future__ import annotations

from typing import Optional

from funcreplay import native as native_lib
from funcreplay.native import insert as native_insert
from funcreplay.native import priorities as native_priorities
from funcreplay.native import sample as native_sample


class NativeExecutor:
  """The XLA FFI kernels of ``funcreplay.native`` behind the core's executor hook."""

  def available(self) -> bool:
    # Asked while tracing: report only, never build (``choose`` built the kernels).
    return native_lib.loaded()

  def supports_insert(self, spec) -> bool:
    return native_lib.supports_insert(spec)

  def supports_update_priorities(self, spec) -> bool:
    return native_lib.supports_update_priorities(spec)

  def supports_sample(self, spec, stratified: bool) -> bool:
    return native_lib.supports_sample(spec, stratified)

  def insert(self, spec, state, items, mask, versions, prios, meta_rows, n_bad):
    return native_insert.insert(spec, state, items, mask, versions, prios, meta_rows, n_bad)

  def update_priorities(self, spec, state, slots, keys, priorities):
    return native_priorities.update_priorities(spec, state, slots, keys, priorities)

  def sample(self, spec, state, rng, batch_size, ver, where, replace, enabled, layout,
             split_key):
    return native_sample.sample(spec, state, rng, batch_size, ver, where, replace, enabled,
                                layout, split_key)

  def __repr__(self) -> str:
    return "NATIVE"


NATIVE = NativeExecutor()


def choose(native: Optional[bool]) -> Optional[NativeExecutor]:
  """The executor for ``native`` (None: ``FUNCREPLAY_NATIVE``, ``native.use_native``):
  ``NATIVE`` or None.

  Choosing ``NATIVE`` builds and loads the kernels here (``funcreplay.native.ensure_built``).
  """
  use = native_lib.use_native(native)
  if use:
    native_lib.ensure_built()  # now, when the programs are built: never inside a trace
  return NATIVE if use else None
