"""The pure layer: ``save(path, state, spec)`` / ``restore(path, spec=None)``.

A state is either an ordinary ``TableState`` (slot columns ``[C]``) or a
sharded one from ``funcreplay.distributed`` (every leaf ``[S, ...]``); the
manifest records which (``num_shards``). Sharded states are gathered to the
host before writing (``distributed.gather_state``; in one process every shard is
addressable) and laid out again on restore with ``distributed.shard_state``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np

from funcreplay import distributed as shd
from funcreplay.checkpoint import fields, layout, migrate, positions, record, rows, spec_codec, swap
from funcreplay.checkpoint import format as fmt
from funcreplay.checkpoint import sidecar as sidecar_lib
from funcreplay.checkpoint.errors import CheckpointError
from funcreplay.core import caches, ledger, staleness
from funcreplay.core import state as state_lib
from funcreplay.core.spec import TableSpec
from funcreplay.core.state import TableState
from funcreplay.core.version import VERSION
from funcreplay.host import consistency


@dataclasses.dataclass(frozen=True)
class Restored:
  """What ``restore`` returns. Unpacks as ``state, spec = restore(path)``.

  Attributes:
    state: the ``TableState`` (JAX arrays; laid out on ``mesh`` for a sharded
      checkpoint; numpy arrays with ``as_numpy=True``).
    spec: the ``TableSpec`` (the caller's, or decoded from the manifest).
    host: ``{"version": int, "rng": np.uint32[2]}`` of the host ``Table``
      that was saved, or None for a pure-layer checkpoint.
    extra: the JSON ``extra`` given to ``save`` (None if none).
    path: the checkpoint directory actually read.
    num_shards: S for a sharded checkpoint, else None.
    sidecar: ``{name: array}``: a host Table's ragged values / payloads, or None.
    sidecar_order: None, or int[N] when the items moved (a grown Fifo ring is unrolled):
      item ``i`` of ``state`` (in slot order) is saved item ``sidecar_order[i]`` (in the
      saved slot order, which the sidecar's pieces follow; ``migrate.item_order``).
  """

  state: TableState
  spec: TableSpec
  host: Optional[Dict[str, Any]]
  extra: Any
  path: str
  num_shards: Optional[int]
  sidecar: Optional[Dict[str, Any]] = None
  sidecar_order: Optional[np.ndarray] = None

  def __iter__(self):
    return iter((self.state, self.spec))


def _leaf_name(path) -> str:
  return jax.tree_util.keystr(path)


@functools.lru_cache(maxsize=64)
def _expected(spec: TableSpec, num_shards: Optional[int]) -> Tuple[Any, Tuple[Any, ...]]:
  """``(treedef, ((leaf name, shape, np.dtype), ...))`` of a state of ``spec``."""
  local = spec if num_shards is None else spec.replace(capacity=spec.capacity // num_shards)
  # On disk: the ledger unpacked (record.StateRecord), one array per scalar/counter.
  shapes = jax.eval_shape(lambda: record.to_record(state_lib.init_state(local), local))
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
  lead = () if num_shards is None else (num_shards,)
  return treedef, tuple((_leaf_name(p), lead + tuple(s.shape), np.dtype(s.dtype))
                        for p, s in leaves)


caches.register("checkpoint.core.expected", _expected.cache_clear)


def _num_shards(state: TableState, spec: TableSpec) -> Optional[int]:
  nd = np.ndim(state.occupied)
  if nd == 1:
    return None
  if nd == 2:
    s = int(np.shape(state.occupied)[0])
    if s >= 1 and spec.capacity % s == 0:
      return s
  raise ValueError(f"save: state.occupied has shape {list(np.shape(state.occupied))}; expected "
                   f"[{spec.capacity}] (a table of this spec) or [S, {spec.capacity} // S] "
                   "(a sharded table).")


def _check_state(state: TableState, spec: TableSpec, num_shards: Optional[int]) -> None:
  treedef, expected = _expected(spec, num_shards)
  lead = () if num_shards is None else (num_shards,)
  want = lead + (ledger.LEDGER_SIZE,)
  if tuple(np.shape(state.ledger)) != want or np.dtype(state.ledger.dtype) != np.uint32:
    raise ValueError(f"save: state.ledger is {np.dtype(state.ledger.dtype).name}"
                     f"{list(np.shape(state.ledger))}, the spec needs uint32{list(want)}.")
  nlead = 1 if num_shards is None else 2
  try:  # shapes only: nothing is unpacked here
    got_record = jax.eval_shape(lambda s: record.to_record(s, spec, nlead), state)
  except (TypeError, ValueError, AttributeError) as e:
    raise ValueError(f"save: state.data does not match the spec's storage "
                     f"{spec.storage!r} (funcreplay.core.storage): {e}") from None
  got, got_def = jax.tree_util.tree_flatten_with_path(got_record)
  if got_def != treedef:
    raise ValueError(f"save: the state's structure does not match the spec.\n  expected: "
                     f"{treedef}\n  got:      {got_def}")
  for (name, shape, dtype), (_, leaf) in zip(expected, got, strict=True):
    if tuple(np.shape(leaf)) != shape or np.dtype(leaf.dtype) != dtype:
      raise ValueError(f"save: state{name} is {np.dtype(leaf.dtype).name}{list(np.shape(leaf))}, "
                       f"the spec needs {dtype.name}{list(shape)}.")


def save(path, state: TableState, spec: TableSpec, *, extra: Any = None,
         overwrite: bool = False, fsync: bool = True,
         host: Optional[Dict[str, Any]] = None, sidecar=()) -> str:
  """Write ``state`` (and ``spec``) as a checkpoint directory at ``path``, atomically.

  Args:
    path: the checkpoint directory to create (its parent must exist).
    state: a ``TableState`` of ``spec`` (device or numpy arrays), or a sharded
      state (leaves ``[S, ...]``, ``spec`` the global spec).
    spec: the table's ``TableSpec``.
    extra: optional JSON-able value stored in the manifest (e.g. the learner
      step); comes back as ``Restored.extra``.
    overwrite: replace an existing checkpoint at ``path``.
    fsync: make the checkpoint durable against power loss / OS crashes
      (default). False skips every fsync: still atomic and safe against
      process crashes (``kill -9``), and as fast as the page cache.
    host: host-table extras ``{"version": int, "rng": uint32[2]}`` (set by
      ``save_table``).
    sidecar: ``[(name, array)]`` (``checkpoint.sidecar``, set by ``save_table``).

  Returns:
    The absolute path written.

  Every leaf is written bit-exactly (one ``.npy`` per leaf), with a CRC-32
  per file in ``manifest.json``; see ``funcreplay.checkpoint.format`` for the
  crash-safety protocol. A sharded state spanning several processes
  (``jax.distributed``) must be saved by every process (the gather is
  collective); only process 0 writes.
  """
  if not isinstance(spec, TableSpec):
    raise TypeError(f"save expects a TableSpec, got {type(spec).__name__}.")
  if not isinstance(state, TableState):
    raise TypeError(f"save expects a TableState, got {type(state).__name__}.")
  num_shards = _num_shards(state, spec)
  _check_state(state, spec, num_shards)
  try:
    extra_json = json.loads(json.dumps(extra, allow_nan=False))
  except (TypeError, ValueError) as e:
    raise TypeError(f"save: extra must be JSON-serialisable (dicts, lists, str, finite numbers), "
                    f"got {type(extra).__name__}: {e}") from None
  host_np = shd.gather_state(state) if num_shards is not None else jax.device_get(state)
  if num_shards is not None and jax.process_count() > 1 and jax.process_index() != 0:
    # Across processes every process joins the gather (a collective) and
    # process 0 alone writes (to a filesystem all of them can read). Others
    # return at once: synchronise (multihost_utils.sync_global_devices)
    # before reading the checkpoint elsewhere.
    return os.path.abspath(os.fspath(path))
  leaves, _ = jax.tree_util.tree_flatten_with_path(
      record.to_record(host_np, spec, 1 if num_shards is None else 2))
  arrays, rows_entry = rows.pack([(_leaf_name(p), np.asarray(x)) for p, x in leaves])
  arrays = list(arrays) + list(sidecar)
  header = {
      "funcreplay_version": VERSION,
      "created_unix": time.time(),
      "spec": spec_codec.spec_to_json(spec),
      "num_shards": num_shards,
      "host": None if host is None else {"version": int(host["version"]),
                                         "rng": [int(v) for v in np.asarray(host["rng"])]},
      "extra": extra_json,
      "rows": rows_entry,
  }
  return fmt.write_dir(path, arrays, header, overwrite=overwrite, fsync=fsync)


def resolve(path) -> str:
  """``path`` itself if it is a checkpoint, else the newest ``ckpt-<step>`` inside it.

  If an overwrite of ``path`` was killed between its two renames, the new
  copy it left beside ``path`` (``swap.interrupted``).
  """
  path = os.fspath(path)
  if os.path.isfile(os.path.join(path, fmt.MANIFEST)):
    return path
  recovered = swap.interrupted(path)  # an overwrite killed between its two renames
  if recovered is not None:
    return recovered
  newest = layout.latest(path)
  if newest is not None:
    return newest
  if os.path.isdir(path) and not any(n.startswith(layout.PREFIX) for n in os.listdir(path)):
    raise CheckpointError(f"{path!r} holds no checkpoint (no {fmt.MANIFEST} and no complete "
                          f"{layout.PREFIX}<step> directory).")
  return path  # read_manifest names what is missing


# Leaves that checkpoints written before they existed lack. They are derived
# from the slot columns, so a restore rebuilds them (``_add_derived``): the version
# index (both or neither), the heaps' touch stamps, the position index (checkpoint.positions).
_VERSION_INDEX = (".version_hist", ".version_bounds")
_DERIVED = _VERSION_INDEX + (".touched", ".position_index")


def _check_arrays(manifest, spec: TableSpec, num_shards: Optional[int], where: str, rows_entry):
  treedef, expected = _expected(spec, num_shards)
  lead = 1 if num_shards is None else 2
  entries = manifest["arrays"]
  names = [e.get("leaf") for e in entries]
  want = [n for n, _, _ in expected]
  lacking = [n for n in want if n not in names]
  older = (set(lacking) <= set(_DERIVED) and names == [n for n in want if n not in lacking]
           and len(set(lacking) & set(_VERSION_INDEX)) in (0, len(_VERSION_INDEX)))
  if names != want and older:
    expected = [x for x in expected if x[0] in names]
  elif names != want:
    missing = sorted(set(want) - set(names))
    unexpected = sorted(set(names) - set(want))
    raise CheckpointError(f"{where}: the checkpoint's arrays do not match the spec's state "
                          f"(missing {missing}, unexpected {unexpected}).")
  for e, (name, shape, dtype) in zip(entries, expected, strict=True):
    shape = rows.stored_shape(name, shape, rows_entry, lead)
    if tuple(e["shape"]) != shape or e["dtype"] != dtype.name:
      raise CheckpointError(f"{where}: array {name} is {e['dtype']}{e['shape']} in the manifest, "
                            f"the spec needs {dtype.name}{list(shape)}.")
  return treedef


def _zero_weight_count(spec: TableSpec, state):
  """``state`` (numpy) with ``occ_tree[..., 0]``, where it is 0, set to its count of
  occupied items of zero sampling weight (``indexes.zero_weight_count``):
  checkpoints written before that count existed hold 0 there. A stored count is
  kept as it is (a restore gives back the saved bytes)."""
  if not spec.prioritized:
    return state
  occupied, weights = np.asarray(state.occupied), np.asarray(state.weight_tree)
  p, c = weights.shape[-1] // 2, occupied.shape[-1]
  tree = np.array(state.occ_tree, copy=True)
  count = np.sum(occupied & ~(weights[..., p:p + c] > 0), axis=-1)
  tree[..., 0] = np.where(tree[..., 0] == 0, count, tree[..., 0])
  return state.replace(occ_tree=tree)


def _add_derived(arrays, manifest, spec: TableSpec, num_shards: Optional[int]):
  """``arrays`` (in manifest order) completed with the ``_DERIVED`` leaves an older
  checkpoint lacks, rebuilt from its columns."""
  _, expected = _expected(spec, num_shards)
  names = [e.get("leaf") for e in manifest["arrays"]]
  if len(names) == len(expected):
    return arrays
  local = spec if num_shards is None else spec.replace(capacity=spec.capacity // num_shards)
  by_name = dict(zip(names, arrays, strict=True))
  lead = () if num_shards is None else (num_shards,)
  if _VERSION_INDEX[0] not in by_name:
    hist, bounds = (np.broadcast_to(np.asarray(x), lead + np.shape(x)).copy()
                    for x in staleness.empty(local))
    rebuild = functools.partial(staleness.rebuild, local)
    if num_shards is not None:
      rebuild = jax.vmap(rebuild)
    by_name.update(zip(_VERSION_INDEX, (np.asarray(x) for x in rebuild(
        hist, bounds, by_name[".occupied"], by_name[".version"]))))
  if ".touched" not in by_name:
    by_name[".touched"] = _touched_from_keys(local, by_name[".key"], by_name[".next_key"], lead)
  by_name.setdefault(".position_index", np.zeros(lead + (2, 0), np.int32))  # saved without
  return [by_name[n] for n, _, _ in expected]


def _touched_from_keys(spec: TableSpec, key, next_key, lead):
  """``TableState.touched`` for a checkpoint written before it existed, whose heaps
  broke ties by insertion order: the stamps are the keys and the clock
  ``next_key``, which gives exactly the order that checkpoint had."""
  if not spec.touch_stamps:
    return np.zeros(lead + (0,), np.uint32)
  key, next_key = np.asarray(key, np.uint32), np.asarray(next_key, np.uint32)
  return np.concatenate([key, next_key[..., None]], axis=-1)


def _check_placement(path, num_shards, mesh, axis, as_numpy) -> None:
  """Errors about ``mesh=`` before any array is read."""
  if as_numpy:
    return
  if num_shards is not None:
    if mesh is None:
      raise CheckpointError(f"{path}: a sharded checkpoint ({num_shards} shards); pass mesh= "
                            "(and axis=) to lay it out, or as_numpy=True.")
    if axis not in mesh.shape or int(mesh.shape[axis]) != num_shards:
      raise CheckpointError(f"{path}: saved with {num_shards} shards but mesh axis {axis!r} has "
                            f"{dict(mesh.shape).get(axis)} devices; re-sharding to another "
                            "count is not supported.")
  elif mesh is not None:
    raise CheckpointError(f"{path}: an unsharded checkpoint; restore it without mesh=, or "
                          "shard a table with funcreplay.distributed instead.")


def restore(path, spec: Optional[TableSpec] = None, *, allow_capacity_growth: bool = False,
            mesh=None, axis: str = "data", as_numpy: bool = False,
            verify: bool = True) -> Restored:
  """Read a checkpoint written by ``save`` (or the newest one in a directory of them).

  Args:
    path: a checkpoint directory, or a directory of ``ckpt-<step>``
      checkpoints (the newest complete one is read).
    spec: the spec to restore into (checked against the saved one; every
      difference is listed in the error). None: use the saved spec.
    allow_capacity_growth: allow ``spec.capacity`` larger than the saved one
      (see ``funcreplay.checkpoint.migrate`` for how slots are laid out).
    mesh, axis: for a sharded checkpoint, the mesh to lay the state out on
      (``mesh.shape[axis]`` must equal the saved number of shards).
    as_numpy: return numpy arrays (no device placement; any checkpoint).
    verify: check every file's CRC-32 (default). False skips only that
      (lengths, shapes and dtypes are still checked): for trusted storage
      when the restore must be as fast as ``np.load``.

  Returns:
    ``Restored`` (unpacks as ``state, spec``).

  Raises:
    CheckpointError (a ValueError) naming the file or spec field at fault:
    missing / incomplete / corrupted / truncated files, checksum
    mismatches, or a spec that does not fit. Nothing is returned unless
    every array was read and verified. A concurrent ``save(path,
    overwrite=True)`` is not a failure: the read is repeated on the new
    checkpoint (``swap.read_stable``).
  """
  return swap.read_stable(path, resolve, lambda: _restore_once(
      path, spec, allow_capacity_growth, mesh, axis, as_numpy, verify))


def _restore_once(path, spec, allow_capacity_growth, mesh, axis, as_numpy, verify) -> Restored:
  """One read of ``restore`` (same arguments)."""
  path = resolve(path)
  manifest, side = sidecar_lib.split(fmt.read_manifest(path))
  mpath = os.path.join(path, fmt.MANIFEST)
  try:
    saved = manifest["spec"]
    num_shards = manifest["num_shards"]
    host = manifest["host"]
    extra = manifest.get("extra")
  except KeyError as e:
    if manifest.get("table_kind") is not None:  # e.g. save_trajectory's
      raise CheckpointError(f"{path}: a checkpoint of a {manifest['table_kind']!r} table, not "
                            "a Table's; restore it with funcreplay.restore_trajectory.") from None
    raise CheckpointError(f"{mpath}: the manifest lacks {e}; it is corrupted.") from None
  host = fields.parse_host(host, mpath)
  if spec is None:
    spec = spec_codec.spec_from_json(saved)
    saved_spec = spec
  else:
    if not isinstance(spec, TableSpec):
      raise TypeError(f"restore: spec must be a TableSpec or None, got {type(spec).__name__}.")
    try:
      diffs = spec_codec.spec_diffs(saved, spec, allow_capacity_growth=allow_capacity_growth)
    except (KeyError, TypeError, AttributeError) as e:
      raise CheckpointError(f"{mpath}: the saved spec is malformed ({type(e).__name__}: {e}); "
                            "the manifest is corrupted.") from None
    if diffs:
      raise CheckpointError(f"{path}: the checkpoint does not fit the given spec:\n  - "
                            + "\n  - ".join(diffs))
    saved_spec = positions.saved_spec(spec, saved, path)
  if num_shards is not None and spec.capacity % num_shards:
    raise CheckpointError(f"{path}: capacity {spec.capacity} is not a multiple of the "
                          f"checkpoint's {num_shards} shards.")
  _check_placement(path, num_shards, mesh, axis, as_numpy)
  names = [e.get("leaf") for e in manifest["arrays"]]
  rows_entry = rows.check_entry(manifest.get("rows"), names, mpath)  # absent in schema 1
  treedef = _check_arrays(manifest, saved_spec, num_shards, mpath, rows_entry)
  full = {n: (shape, dtype) for n, shape, dtype in _expected(saved_spec, num_shards)[1]}
  arrays = rows.unpack(fmt.read_arrays(path, manifest, verify=verify), names,
                       [full[n] for n in names], rows_entry, mpath)
  arrays = _add_derived(arrays, manifest, saved_spec, num_shards)
  state = _zero_weight_count(saved_spec, record.from_record(
      jax.tree_util.tree_unflatten(treedef, arrays), saved_spec,
      1 if num_shards is None else 2))
  order = None
  if spec.capacity != saved_spec.capacity:
    if num_shards is None:
      order = migrate.item_order(saved_spec, state)
      state = migrate.grow(saved_spec, spec, state)
    else:  # only the pure layer saves sharded states: no sidecar to move
      state = migrate.grow_sharded(saved_spec, spec, state, num_shards)
  state = positions.fit(spec, state, num_shards)  # rebuilt or dropped for another spec
  holes = consistency.holes_error(spec, state) or positions.error(spec, state)
  if holes:
    raise CheckpointError(f"{path}: {holes}.")
  if num_shards is not None and not as_numpy:
    state = shd.shard_state(state, mesh, axis)
  elif not as_numpy:
    state = jax.device_put(state)
  return Restored(state=state, spec=spec, host=host, extra=extra, path=path,
                  num_shards=num_shards, sidecar=sidecar_lib.read(path, manifest, side, verify),
                  sidecar_order=order)
