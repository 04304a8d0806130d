"""The locking, waiting and closing half of the host ``Table``.

One lock (a ``threading.Condition``, ``self._cond``) guards the state. A call
the rate limiter forbids waits on the condition (``_wait``) and is retried
after every mutation (``_mutate`` notifies), with a timeout
(``TimeoutError``); ``close()`` wakes every waiter with ``TableClosedError``.
``TableGuard`` is a mixin of ``Table`` (``funcreplay.host.table``), which
creates the attributes it uses in ``Table._init``.
"""

from __future__ import annotations

import time
from typing import Optional

import jax
import numpy as np


class TableClosedError(RuntimeError):
  """Raised by every call on a closed ``Table`` and by calls woken by ``close()``."""


class TableGuard:
  """Lock, waits, close (mixin of ``Table``; state in ``_cond``, ``_closed``, ``_scalars``)."""

  @property
  def closed(self) -> bool:
    return self._closed

  def __enter__(self):
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- closing ------------------------------------------------------------------------
  def close(self) -> None:
    """Close the table: every waiter wakes with ``TableClosedError``; idempotent."""
    with self._cond:
      if self._closed:
        return
      self._closed = True
      self._state = None  # free the buffers; nothing may touch them any more
      self._sidecars = None  # and the ragged values and payloads
      if self._direct:
        self._direct.unbind()
      self._cond.notify_all()

  # -- internals ------------------------------------------------------------------------
  def _check_open(self, what: str, inserted: Optional[int] = None) -> None:
    if self._closed:
      err = TableClosedError(f"Table.{what}: the table is closed; create a new Table "
                             "(or restore a checkpoint) to continue.")
      if inserted is not None:
        err.inserted = inserted
      raise err

  def _wait(self, deadline: Optional[float]) -> bool:
    """Wait for a notification; False once ``deadline`` has passed. Lock held."""
    if deadline is None:
      self._cond.wait()
      return True
    remaining = deadline - time.monotonic()
    if remaining <= 0:
      return False
    self._cond.wait(remaining)
    return True

  def _mutate(self, what, fn, *args) -> None:
    with self._cond:
      self._check_open(what)
      self._state = fn(self._state, *args)
      if self._sidecars is not None:  # items may have left: drop their values / payloads
        self._sidecars.sync(self._state)
      self._cond.notify_all()

  def _device_int(self, name: str, value: int) -> jax.Array:
    """int32[] on the device for ``value``, reused while ``name`` keeps that value."""
    cached = self._scalars.get(name)  # (value, array); replaced whole, so thread-safe
    if cached is None or cached[0] != value:
      cached = (value, jax.device_put(np.int32(value)))
      self._scalars[name] = cached
    return cached[1]
