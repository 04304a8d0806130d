"""Calls to the replay actor: replies within a timeout, the actor's errors as they were raised.

Shared by the clients (``client``, ``writer``, ``prefetch``).
"""

from __future__ import annotations

import re
import time
from typing import Optional

from funcreplay.core.packing import PackedSample
from funcreplay.ray.errors import TableUnavailableError

# Added to a blocking call's own timeout before the caller stops waiting for the reply:
# the transfer of a batch through the object store, and a busy actor's scheduling.
RPC_SLACK_S = 30.0
# Default bound on calls that never wait on the table (stats, count, set_version, ...).
RPC_TIMEOUT_S = 60.0
# Default bound on ``save`` / ``checkpoint_now``: the actor snapshots the table under its
# lock and writes every slot to disk (fsync'ed), so a save takes seconds per GB -- minutes
# for a large table on slow shared storage. Ten minutes covers that and still bounds a
# stuck actor; pass ``timeout=`` for larger tables or slower disks.
SAVE_TIMEOUT_S = 600.0
# How long close() waits for Ray to report a killed actor dead: ``ray.kill`` only asks
# the raylet, and a call sent before it acts still reaches the closed table (which
# answers ``TableClosedError``, not ``TableUnavailableError``). Dying takes well under
# a second on an idle node; 2-core CI under load was seen past one second.
KILL_WAIT_S = 30.0
# Pause between the liveness probes of wait_dead.
_PROBE_S = 0.05


def require_ray():
  """The ``ray`` module, or an ``ImportError`` saying how to get it."""
  try:
    import ray
  except ImportError as e:
    raise ImportError("funcreplay.ray needs Ray: pip install 'funcreplay[ray]' (or "
                      "pip install ray).") from e
  return ray


# The line of a traceback that names the exception raised ("pkg.mod.SomeError: ...").
_RAISED = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit): ")


def wait_reply(ref, timeout: Optional[float], what: str, name: str):
  """``ray.get(ref)`` within ``timeout`` seconds, with the actor's errors as they were raised
  (``ValueError``, ``TimeoutError``, ``TableClosedError``, ...), ``TableUnavailableError``
  when the actor is gone and ``TimeoutError`` when no reply came in time."""
  ray = require_ray()
  from ray import exceptions as rex
  try:
    return ray.get(ref, timeout=timeout)
  except rex.RayTaskError as e:
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
      if hasattr(cause, "add_note"):
        cause.add_note(f"(raised in the replay actor {name!r})")
      raise cause from None
    raise
  except rex.GetTimeoutError:
    raise TimeoutError(f"{what}: no reply from the replay actor {name!r} within {timeout} s "
                       "(it is alive but busy or blocked, or the network is slow). The call may "
                       "still run in the actor.") from None
  except (rex.RayActorError, rex.ActorUnavailableError) as e:
    if getattr(e, "actor_init_failed", False):
      # The constructor raised (a checkpoint that does not fit the spec, ...): its error
      # ends Ray's message, after the traceback; "gone or unreachable" hid it.
      lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
      at = max((i for i, ln in enumerate(lines) if _RAISED.match(ln)), default=len(lines) - 1)
      raise TableUnavailableError(
          f"{what}: the replay actor {name!r} failed to start: "
          f"{' '.join(lines[at:]) if lines else type(e).__name__}. Fix the cause (the "
          "checkpoint_dir's newest checkpoint must fit the spec) and connect again.") from e
    raise TableUnavailableError(
        f"{what}: the replay actor {name!r} is gone or unreachable ({type(e).__name__}: "
        f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}). If it was created with "
        "max_restarts it may be restarting (from its newest checkpoint, with checkpoint_dir): "
        "later calls on the same handle reach it once it is back.") from e


def wait_dead(actor, timeout: float) -> bool:
  """Wait until calls to ``actor`` fail with Ray's actor-death error (True), or ``timeout``
  seconds pass (False: it is still shutting down; later calls may meet the closed table)."""
  ray = require_ray()
  from ray import exceptions as rex
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      ray.get(actor.info.remote(), timeout=max(0.1, deadline - time.monotonic()))
    except (rex.RayActorError, rex.ActorUnavailableError):
      return True
    except rex.GetTimeoutError:
      return False
    except Exception:  # noqa: BLE001 (the closed table's own error: not dead yet)
      pass
    time.sleep(_PROBE_S)
  return False


def as_sample(result):
  """A ``Sample`` of numpy arrays from what the actor's ``sample`` returned."""
  return result.numpy() if isinstance(result, PackedSample) else result
