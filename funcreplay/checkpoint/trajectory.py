"""Checkpoints of trajectory tables: ``save_trajectory`` / ``restore_trajectory``.

The same directory format as a table checkpoint (``format.py``: one ``.npy``
per state leaf, a manifest with CRC-32s, written to a temporary directory,
fsynced and renamed atomically), with ``"table_kind": "trajectory"`` and the
``TrajectorySpec`` as JSON in the manifest. Every leaf of the
``TrajectoryState`` is stored whole (the per-env time axes, cursors, window
columns, the episode index and counters), so a restored state samples
exactly as the saved one for the same key.

Not covered (the table checkpoint's extras): sharded states, keep-last-N
directories (save to ``ckpt-<step>`` paths yourself), capacity growth, and
the opaque-signature path: ``restore_trajectory`` always takes the spec and
checks it against the stored one.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Dict

import jax
import numpy as np

from funcreplay.checkpoint import format as fmt
from funcreplay.checkpoint import spec_codec
from funcreplay.checkpoint.errors import CheckpointError
from funcreplay.core.trajectory.spec import TrajectorySpec
from funcreplay.core.trajectory.state import TrajectoryState, init_state

KIND = "trajectory"


def spec_to_json(spec: TrajectorySpec) -> Dict[str, Any]:
  out = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
  out["signature"] = spec_codec.signature_to_json(spec.signature)
  out["sampler"] = spec_codec.selector_to_json(spec.sampler)
  return out


def _leaves(state: TrajectoryState):
  flat, _ = jax.tree_util.tree_flatten_with_path(state)
  return [(jax.tree_util.keystr(p), np.asarray(x)) for p, x in flat]


def save_trajectory(path, state: TrajectoryState, spec: TrajectorySpec, *,
                    overwrite: bool = False, fsync: bool = True) -> str:
  """Write ``state`` (of ``spec``) to the directory ``path`` atomically; returns ``path``."""
  if not isinstance(spec, TrajectorySpec) or not isinstance(state, TrajectoryState):
    raise TypeError("save_trajectory(path, state, spec) takes a TrajectoryState and its "
                    f"TrajectorySpec, got {type(state).__name__} and {type(spec).__name__}.")
  _check(spec, _leaves(state), "save_trajectory: state")
  header = {"table_kind": KIND, "spec": spec_to_json(spec)}
  return fmt.write_dir(os.fspath(path), _leaves(state), header, overwrite=overwrite,
                       fsync=fsync)


def _check(spec, got, what: str) -> None:
  flat, _ = jax.tree_util.tree_flatten_with_path(jax.eval_shape(lambda: init_state(spec)))
  want = [(jax.tree_util.keystr(p), tuple(a.shape), np.dtype(a.dtype)) for p, a in flat]
  got = [(name, tuple(np.shape(a)), np.dtype(a.dtype)) for name, a in got]
  if want != got:
    bad = [f"{w} vs {g}" for w, g in zip(want, got) if w != g] or [f"{len(want)} vs {len(got)}"]
    raise CheckpointError(f"{what} does not match the spec's state layout "
                          f"(expected vs got): {bad[:3]}.")


def restore_trajectory(path, spec: TrajectorySpec, *, verify: bool = True,
                       as_numpy: bool = False) -> TrajectoryState:
  """The ``TrajectoryState`` saved at ``path``; ``spec`` must equal the saved spec.

  ``verify``: check every file's CRC-32. ``as_numpy``: numpy leaves instead of
  device arrays. Raises ``CheckpointError`` naming the mismatch or damage.
  """
  path = os.fspath(path)
  m = fmt.read_manifest(path)
  if m.get("table_kind") != KIND:
    raise CheckpointError(f"{path}: not a trajectory-table checkpoint (restore it with "
                          "fr.restore).")
  want = spec_to_json(spec)
  if m.get("spec") != want:
    diff = sorted(k for k in set(want) | set(m.get("spec") or {})
                  if want.get(k) != (m.get("spec") or {}).get(k))
    raise CheckpointError(f"{path}: saved with a different TrajectorySpec (fields {diff}).")
  arrays = fmt.read_arrays(path, m, verify=verify)
  _check(spec, [(e["leaf"], a) for e, a in zip(m["arrays"], arrays)], f"{path}: the stored state")
  treedef = jax.tree_util.tree_structure(init_state(spec))
  leaves = arrays if as_numpy else [jax.device_put(a) for a in arrays]
  return jax.tree_util.tree_unflatten(treedef, leaves)
