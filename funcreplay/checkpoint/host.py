"""Checkpoints of the host ``Table``: ``save_table`` / ``restore_table``.

``save_table`` does **not** quiesce the table: it holds the table's lock only
while it copies the device state (``Table.snapshot``) and reads the host PRNG
key and policy version, so the three are mutually consistent; the copy is
then written to disk without the lock, while inserts and samples continue.
A restored table therefore continues exactly where the table stood at the
snapshot: same items, counters, limiter state, PRNG key and version, hence
the same samples for the same subsequent calls.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from funcreplay.checkpoint import core, layout
from funcreplay.checkpoint import sidecar as sidecar_lib
from funcreplay.checkpoint.errors import CheckpointError
from funcreplay.core.spec import TableSpec
from funcreplay.host import consistency
from funcreplay.host import table as table_lib
from funcreplay.host.table import Table


def snapshot_table(table):
  """``(state copy, {"version", "rng"})`` of ``table``, taken under one hold of its lock."""
  return table.checkpoint_state()


# Steps a save with step=None tries when concurrent saves to the same directory take them.
_STEP_ATTEMPTS = 8


def save_table(table, path, *, step: Optional[int] = None, keep_last: Optional[int] = None,
               extra: Any = None, overwrite: bool = False, fsync: bool = True,
               payloads: str = "refuse") -> str:
  """Save a host ``Table`` (state, spec, PRNG key, version); returns the checkpoint path.

  Args:
    table: a ``funcreplay.Table``.
    path: with ``step`` and ``keep_last`` both None, the checkpoint directory
      itself. Otherwise a directory of numbered checkpoints: the checkpoint
      goes to ``path/ckpt-<step>`` (``step`` default: one past the newest)
      and older ones beyond the newest ``keep_last`` are deleted afterwards.
    step: checkpoint number (int >= 0).
    keep_last: how many numbered checkpoints to keep (None: all).
    extra: JSON-able value stored with the checkpoint.
    overwrite: replace an existing checkpoint of the same path / step.
    fsync: durable against power loss (default); False: against process
      crashes only, faster (see ``funcreplay.checkpoint.format``).
    payloads: for a table holding payloads: ``"refuse"`` (default: a ValueError, no
      pickle unless asked), ``"pickle"`` (stored pickled; restore needs
      ``allow_pickle=True``) or ``"drop"`` (saved without them). Ragged values are
      always saved (plain arrays).

  The table keeps serving while the files are written: the lock is held only
  for the device-to-device snapshot.
  """
  state, host = snapshot_table(table)
  side = sidecar_lib.to_arrays(host.pop("sidecars", None), payloads)
  if step is None and keep_last is None:
    return core.save(path, state, table.spec, extra=extra, overwrite=overwrite, fsync=fsync,
                     host=host, sidecar=side)
  os.makedirs(os.fspath(path), exist_ok=True)
  if step is not None and keep_last is not None:
    newer = [s for s, _ in layout.list_steps(path) if s > step]
    if len(newer) >= keep_last:  # the prune below would delete what this call writes
      raise ValueError(
          f"save: {os.fspath(path)} already holds {len(newer)} checkpoints newer than step "
          f"{step} (up to {max(newer)}), so keep_last={keep_last} would delete this one at "
          "once; save with a larger step (or step=None: one past the newest).")
  for attempt in range(_STEP_ATTEMPTS):
    target = layout.step_path(path, layout.next_step(path) if step is None else step)
    try:
      out = core.save(target, state, table.spec, extra=extra, overwrite=overwrite,
                      fsync=fsync, host=host, sidecar=side)
      break
    except FileExistsError:
      # Another save (thread or process) took that step while this one wrote: the next one.
      if step is not None or attempt == _STEP_ATTEMPTS - 1:
        raise
  if keep_last is not None:
    layout.prune(path, keep_last)
  return out


def restore_table(path, spec: Optional[TableSpec] = None, *, allow_capacity_growth: bool = False,
                  seed: int = 0, verify: bool = True, check: bool = True,
                  allow_pickle: bool = False, payloads: Optional[bool] = None):
  """A new ``Table`` from a checkpoint (or from the newest one in a directory of them).

  Args:
    path: checkpoint directory or directory of ``ckpt-<step>`` checkpoints.
    spec: spec to restore into (checked; None: the saved spec).
    allow_capacity_growth: allow a larger ``spec.capacity`` (see
      ``funcreplay.checkpoint.migrate``).
    seed: seeds the PRNG key when the checkpoint came from the pure layer
      (``save``), which has no host key; a table checkpoint continues its own
      key.
    verify: check CRC-32 checksums (see ``funcreplay.checkpoint.restore``).
    check: check the restored state's consistency (``Table.from_state``).
    allow_pickle: unpickle saved payloads (``save(payloads="pickle")``); without it a
      checkpoint holding payloads is refused (unpickling runs code from the file).
    payloads: whether the table keeps payloads (None: iff the checkpoint holds some).

  Returns:
    ``funcreplay.Table`` with the saved state, PRNG key and policy version.
  """
  r = core.restore(path, spec, allow_capacity_growth=allow_capacity_growth, as_numpy=True,
                   verify=verify)
  if r.num_shards is not None:
    raise CheckpointError(f"{r.path}: a sharded checkpoint ({r.num_shards} shards) cannot become "
                          "a host Table; use funcreplay.checkpoint.restore(path, mesh=...).")
  keep, side = sidecar_lib.values(r.sidecar, r.spec, r.path, allow_pickle, payloads,
                                  r.state, r.sidecar_order)
  if r.host is None:
    return Table.from_state(r.spec, r.state, seed=seed, check=check, payloads=keep,
                            sidecar_values=side)
  return Table.from_state(r.spec, r.state, version=r.host["version"], rng=r.host["rng"],
                          check=check, payloads=keep, sidecar_values=side)


def read_into(table, path, *, verify: bool = True, check: bool = True,
              allow_pickle: bool = False):
  """``(state, version, rng)`` of a checkpoint, checked against ``table.spec``, for ``Table.load``.

  Args:
    table: the live ``funcreplay.Table`` to restore into (only its spec is read).
    path: checkpoint directory or directory of ``ckpt-<step>`` checkpoints.
    verify: check CRC-32 checksums.
    check: check the state's consistency (``consistency.check_state``).

  Returns:
    ``state`` (a host numpy ``TableState`` of ``table.spec``), ``version`` (int)
    and ``rng`` (uint32[2]); both None for a pure-layer checkpoint (the table
    keeps its own key and version).

  Raises:
    CheckpointError if the checkpoint's spec differs from the table's (every
    difference listed; capacity growth is not applied to a live table), if it
    is sharded, or if it is missing or corrupted. Reads nothing into the table.
  """
  r = core.restore(path, table.spec, as_numpy=True, verify=verify)
  if r.num_shards is not None:
    raise CheckpointError(f"{r.path}: a sharded checkpoint ({r.num_shards} shards) cannot be "
                          "loaded into a host Table.")
  if check:
    consistency.check_state(table.spec, r.state)
  _, side = sidecar_lib.values(r.sidecar, r.spec, r.path, allow_pickle, table.keeps_payloads,
                               r.state, r.sidecar_order)
  if r.host is None:
    return r.state, None, None, side
  return r.state, r.host["version"], r.host["rng"], side


# Table.save / Table.restore / Table.load call these (the host layer never imports this one).
table_lib.register_checkpoint_io(save_table, restore_table, read_into)
