"""The executor hook: how the pure core runs an operation through native kernels.

``core`` never imports ``funcreplay.native``: an operation that has a native
kernel (``ops.insert``, ``ops.update_priorities``, ``sampling.sample``) takes
an optional ``native`` argument, an object with the interface below, and
calls it under ``lax.platform_dependent`` (CPU: the kernel; other backends:
the JAX implementation). ``None`` runs the JAX implementation everywhere.
The choice of executor happens above the core: ``fr.make_table`` (in
``funcreplay.native.functional``) and the host ``Table`` pass
``funcreplay.native.executor.NATIVE`` when the native kernels are enabled.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol


class Executor(Protocol):
  """A backend with kernels for some operations (``funcreplay.native.executor.NativeExecutor``).

  Each ``supports_*`` says whether the kernel covers ``spec``; ``available``
  whether it can run in this process. The kernels receive the arguments the
  portable implementation has validated and prepared (see the callers).
  """

  def available(self) -> bool: ...

  def supports_insert(self, spec) -> bool: ...

  def supports_update_priorities(self, spec) -> bool: ...

  def supports_sample(self, spec, stratified: bool) -> bool: ...

  def insert(self, spec, state, items, mask, versions, prios, meta_rows, n_bad) -> Any: ...

  def update_priorities(self, spec, state, slots, keys, priorities) -> Any: ...

  def sample(self, spec, state, rng, batch_size: int, ver, where, replace: bool, enabled,
             layout, split_key: bool) -> Any: ...


def check(native: Optional[Executor], what: str) -> Optional[Executor]:
  """``native`` if it is None or has the ``Executor`` methods; a clear ``TypeError`` otherwise.

  (A bare ``True`` is the common mistake: ``fr.make_table(spec, native=True)``
  picks the executor; the core functions take the executor itself.)
  """
  if native is None or native is False:
    return None
  missing = [m for m in ("available", "supports_insert", "supports_update_priorities",
                         "supports_sample", "insert", "update_priorities", "sample")
             if not callable(getattr(native, m, None))]
  if missing:
    raise TypeError(f"{what}: native must be None or an executor "
                    f"(funcreplay.native.executor.NATIVE), got {native!r} (lacks {missing}).")
  return native
