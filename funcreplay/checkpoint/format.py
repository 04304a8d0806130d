"""On-disk format: one ``.npy`` file per array plus ``manifest.json``, written crash-safely.

A checkpoint is a directory::

    ckpt/
      manifest.json          schema version, funcreplay version, spec, host state,
                             user extras, packed rows (``rows.py``), and per array:
                             leaf path, file, shape, dtype, byte count, crc32;
                             last, ``manifest_crc32`` over all of that
      000-data.obs.npy       np.save format (allow_pickle=False), one per leaf
      001-occupied.npy
      ...

Writing (``write_dir``): every file goes into a fresh temporary sibling
directory ``.tmp-<name>-<pid>-<random>``, each file is fsynced, the manifest
is written last, the temporary directory is fsynced, renamed to its final
name in one atomic ``rename``, and the parent directory is fsynced. A crash
(even ``kill -9`` or power loss after the parent fsync) therefore leaves
either no checkpoint under the final name or a complete one; leftover
temporary directories are never mistaken for checkpoints.

``fsync=False`` skips the fsyncs (the files may still be in the page cache
when ``save`` returns): the rename still makes a *process* crash (``kill
-9``) safe, since the kernel writes the cache out anyway, but not an OS crash
or power loss. On this machine's disk the fsyncs are most of a save's time.

Files are exactly what ``np.save`` writes and are read with
``np.load(f, allow_pickle=False)``.

Checksums are CRC-32 (``zlib.crc32``) of each 16 MiB segment of an array's
raw C-order bytes (a list per file in the manifest), so one large array is
checksummed on several cores at once, beside the writes. CRC-32 runs at
~4 GB/s per core here (sha256 ~1.8 GB/s, blake2b ~0.9 GB/s), and it catches
the failures a checkpoint meets (truncation, bit rot, partial copies). It is
not a defence against deliberate tampering.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import secrets
import shutil
import threading
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from funcreplay.checkpoint import swap
from funcreplay.checkpoint.errors import CheckpointError

FORMAT = "funcreplay.checkpoint"
# 2: the manifest carries its own CRC-32 (``MANIFEST_CRC``) and item data may be stored as
# the occupied rows only (``funcreplay.checkpoint.rows``). 1: neither; still read (see
# ``funcreplay.checkpoint.migrate``).
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)
MANIFEST = swap.MANIFEST
MANIFEST_CRC = "manifest_crc32"
TMP_PREFIX = swap.TMP_PREFIX
TRASH_PREFIX = swap.TRASH_PREFIX
_WORKERS = 4  # file writes, reads and crc32 release the GIL: overlap them
_SMALL = 1 << 20  # arrays below this many bytes are handled inline (no hand-off cost)
_POOL: Optional[Tuple[int, concurrent.futures.ThreadPoolExecutor]] = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  """A process-wide I/O pool, created on first use (threads are reused across saves).

  Re-created in a forked child, where the parent's threads do not exist.
  """
  global _POOL
  with _POOL_LOCK:
    if _POOL is None or _POOL[0] != os.getpid():
      _POOL = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
          _WORKERS, thread_name_prefix="funcreplay-ckpt-io"))
    return _POOL[1]


def _run_all(fn, items):
  """``[fn(x) for x in items]``: large items on the pool, small ones inline, in order."""
  futures = [_pool().submit(fn, x) if big else None for x, big in items]
  out, error = [], None
  for (x, _), f in zip(items, futures, strict=True):
    try:  # wait for every task before raising: none may still touch the files
      out.append(fn(x) if f is None else f.result())
    except Exception as e:  # noqa: BLE001 (re-raised below)
      error = error or e
      out.append(None)
  if error is not None:
    raise error
  return out


def _safe_name(leaf: str) -> str:
  name = re.sub(r"[^A-Za-z0-9_.-]+", ".", leaf).strip(".")
  return name[:80] or "root"


def _storable(arr: np.ndarray) -> Tuple[np.ndarray, Optional[str]]:
  """(array np.save can round-trip without pickle, the real dtype name if viewed)."""
  dt = arr.dtype
  try:
    same = np.lib.format.descr_to_dtype(np.lib.format.dtype_to_descr(dt)) == dt
  except (ValueError, TypeError):
    same = False
  if same and dt.kind != "V":
    return arr, None
  # e.g. bfloat16 (ml_dtypes): store the bits as unsigned ints of the same width.
  return arr.view(np.dtype(f"u{dt.itemsize}")), dt.name


def fsync_path(path: str, directory: bool = False) -> None:
  """fsync a file or a directory by path (directories: POSIX only, else a no-op)."""
  flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
  try:
    fd = os.open(path, flags)
  except (IsADirectoryError, PermissionError):  # e.g. directories on Windows
    return
  try:
    os.fsync(fd)
  except OSError:
    if not directory:
      raise
  finally:
    os.close(fd)


SEGMENT = 16 << 20  # bytes per CRC: segments of one array are checksummed in parallel


def segments(arr: np.ndarray) -> List[np.ndarray]:
  """The raw bytes of a C-contiguous array as ``uint8`` views of ``SEGMENT`` bytes (>= 1)."""
  raw = arr.reshape(-1).view(np.uint8)
  return [raw[i:i + SEGMENT] for i in range(0, max(raw.nbytes, 1), SEGMENT)]


def crc32_segments(arr: np.ndarray) -> List[int]:
  """CRC-32 of each ``SEGMENT`` of an array's raw bytes (what the manifest stores)."""
  return [zlib.crc32(s) & 0xFFFFFFFF for s in segments(arr)]


def _crc_tasks(arrays: Sequence[np.ndarray]) -> List[List[int]]:
  """``crc32_segments`` of every array, large segments spread over the I/O pool."""
  segs = [segments(a) for a in arrays]
  flat = _run_all(lambda s: zlib.crc32(s) & 0xFFFFFFFF,
                  [(s, s.nbytes >= _SMALL) for ss in segs for s in ss])
  out, i = [], 0
  for ss in segs:
    out.append(flat[i:i + len(ss)])
    i += len(ss)
  return out


def _write_one(dirpath: str, file: str, arr: np.ndarray, fsync: bool = True) -> None:
  """Write ``arr`` in .npy format (exactly as ``np.save``) and fsync it (if ``fsync``)."""
  stored, _ = _storable(arr)
  with open(os.path.join(dirpath, file), "wb") as f:
    np.lib.format.write_array(f, stored, allow_pickle=False)
    f.flush()
    if fsync:
      os.fsync(f.fileno())


def manifest_crc32(manifest: Dict[str, Any]) -> int:
  """CRC-32 of a manifest's content (every field but ``MANIFEST_CRC``).

  Taken over a canonical JSON text (sorted keys, no spaces), so a manifest
  re-indented by a tool still verifies while any edited value does not.
  """
  body = {k: v for k, v in manifest.items() if k != MANIFEST_CRC}
  text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
  return zlib.crc32(text.encode("utf-8")) & 0xFFFFFFFF


def write_dir(path: str, arrays: Sequence[Tuple[str, np.ndarray]], header: Dict[str, Any],
              *, overwrite: bool = False, fsync: bool = True) -> str:
  """Write ``arrays`` ([(leaf name, ndarray)]) and a manifest to directory ``path``, atomically.

  Args:
    path: the final directory; its parent must exist.
    arrays: leaves in order; each becomes one ``.npy`` file.
    header: JSON-able fields merged into the manifest (spec, host state...).
    overwrite: replace an existing checkpoint at ``path``: swapped with the
      new one in one atomic step where the OS can (``swap.exchange``), else
      renamed aside first (a kill between the two renames is recovered by
      ``swap.interrupted``); deleted once the new one is in place.
    fsync: fsync files and directories (durable against power loss); False
      is safe against process crashes only.

  Returns:
    ``path``.
  """
  path = os.path.abspath(os.fspath(path))
  parent, base = os.path.split(path)
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"checkpoint save: parent directory {parent!r} does not exist.")
  if (os.path.exists(path) or swap.interrupted(path)) and not overwrite:
    raise FileExistsError(f"checkpoint save: {path!r} already exists; pass overwrite=True or "
                          "save to a new path (e.g. a checkpoint directory with step=).")
  if overwrite and os.path.exists(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
    # It replaced any directory (a directory of checkpoints, or one of the user's own).
    raise FileExistsError(f"checkpoint save: {path!r} exists and is not a checkpoint (no "
                          f"{MANIFEST}): overwrite=True replaces only a checkpoint. Save to a "
                          "new path, or into a directory of checkpoints with step= / keep_last=.")
  tmp = os.path.join(parent, f"{TMP_PREFIX}{base}-{os.getpid()}-{secrets.token_hex(4)}")
  os.mkdir(tmp)
  old = None
  try:
    # (np.ascontiguousarray would turn 0-d arrays into 1-d ones)
    arrays = [(leaf, np.asarray(a, order="C")) for leaf, a in arrays]
    files = [f"{i:03d}-{_safe_name(leaf)}.npy" for i, (leaf, _) in enumerate(arrays)]
    # Every write goes to the pool (each ends in an fsync that waits on the
    # disk); the CRCs of 16 MiB segments run beside them on the other cores.
    writes = [_pool().submit(_write_one, tmp, f, a, fsync)
              for f, (_, a) in zip(files, arrays, strict=True)]
    try:
      crcs = _crc_tasks([a for _, a in arrays])
    finally:
      for w in writes:  # wait for all (and re-raise the first error)
        w.exception()
    for w in writes:
      w.result()
    entries = []
    for (leaf, a), file, crc in zip(arrays, files, crcs, strict=True):
      _, real = _storable(a)
      entries.append({"leaf": leaf, "file": file, "shape": list(a.shape),
                      "dtype": a.dtype.name, "stored_as": None if real is None else
                      f"u{a.dtype.itemsize}", "nbytes": int(a.nbytes), "crc32": crc})
    manifest = {"format": FORMAT, "schema_version": SCHEMA_VERSION, **header,
                "checksum": "crc32", "crc32_segment_bytes": SEGMENT, "arrays": entries}
    manifest[MANIFEST_CRC] = manifest_crc32(manifest)
    text = json.dumps(manifest, indent=1, allow_nan=False)
    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      if fsync:
        os.fsync(f.fileno())
    if fsync:
      fsync_path(tmp, directory=True)
    if not overwrite:
      try:
        swap.place(tmp, path)  # never over a checkpoint another save made meanwhile
      except FileExistsError:
        raise FileExistsError(f"checkpoint save: {path!r} was made by another save while this "
                              "one wrote; pass overwrite=True or save to a new path.") from None
    elif os.path.exists(path) and swap.exchange(tmp, path):
      old = tmp  # one atomic swap (Linux): the previous checkpoint is now under tmp's name
    else:  # two renames; a kill between them is recovered by swap.interrupted
      if os.path.exists(path):
        old = os.path.join(parent, f"{TRASH_PREFIX}{base}-{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(path, old)
      os.rename(tmp, path)
    if fsync:
      fsync_path(parent, directory=True)
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
    swap.clean_stale(path)  # leftovers of killed saves to this path (a recovered pair too)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    if old is not None and not os.path.exists(path):
      os.rename(old, path)  # put the previous checkpoint back
    raise
  return path


def read_manifest(path: str) -> Dict[str, Any]:
  """The parsed manifest of the checkpoint directory ``path`` (validated header)."""
  path = os.fspath(path)
  mpath = os.path.join(path, MANIFEST)
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint {path!r} does not exist (or is not a directory).")
  if not os.path.isfile(mpath):
    raise CheckpointError(f"checkpoint {path!r} has no {MANIFEST}: it is incomplete (a save "
                          "was interrupted?) or not a funcreplay checkpoint.")
  try:
    with open(mpath, encoding="utf-8") as f:
      m = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{mpath}: cannot read the manifest ({e}); the file is truncated "
                          "or corrupted.") from None
  if not isinstance(m, dict) or m.get("format") != FORMAT:
    raise CheckpointError(f"{mpath}: not a funcreplay checkpoint manifest.")
  schema = m.get("schema_version")
  if isinstance(schema, bool) or schema not in READABLE_SCHEMAS:  # True == 1 in Python
    raise CheckpointError(f"{mpath}: schema version {schema!r}; this "
                          f"funcreplay reads versions {list(READABLE_SCHEMAS)}.")
  if schema == 1 and "rows" in m:
    raise CheckpointError(f"{mpath}: a schema-1 manifest with a 'rows' entry (schema 2's): it "
                          "was edited or corrupted.")
  # Checked whenever present, whatever the version says: the checksum covers the version,
  # so a manifest edited down to schema 1 does not escape it.
  if schema >= 2 or MANIFEST_CRC in m:
    try:
      ok = m.get(MANIFEST_CRC) == manifest_crc32(m)
    except (TypeError, ValueError):  # e.g. NaN written into the JSON by hand
      ok = False
    if not ok:
      raise CheckpointError(f"{mpath}: the manifest's checksum does not match its content: it "
                            "was edited or corrupted (spec, host state, extra and the per-file "
                            "checksums are all covered).")
  if not isinstance(m.get("arrays"), list):
    raise CheckpointError(f"{mpath}: the manifest lists no arrays; it is corrupted.")
  return m


def _read_one(path: str, e: Dict[str, Any]) -> np.ndarray:
  try:
    return _read_checked(path, e)
  except (KeyError, TypeError, AttributeError) as err:  # a damaged manifest entry
    raise CheckpointError(f"{os.path.join(path, MANIFEST)}: malformed entry for "
                          f"{e.get('file')!r} ({type(err).__name__}: {err}).") from None


def _read_checked(path: str, e: Dict[str, Any]) -> np.ndarray:
  fpath = os.path.join(path, e["file"])
  if not os.path.isfile(fpath):
    raise CheckpointError(f"{fpath}: file missing from the checkpoint (leaf {e['leaf']}).")
  want_dtype = np.dtype(e["stored_as"]) if e["stored_as"] else _dtype(e["dtype"], fpath)
  # The header first, checked against the manifest before any data is read: a damaged
  # header made numpy's parser raise other errors than ValueError (tokenize.TokenError,
  # SyntaxError) or allocate a shape it claimed (terabytes); any failure is corruption.
  try:
    with open(fpath, "rb") as f:
      major, _ = np.lib.format.read_magic(f)
      read_header = (np.lib.format.read_array_header_1_0 if major == 1
                     else np.lib.format.read_array_header_2_0)
      shape, _, dtype = read_header(f)
  except Exception as err:  # noqa: BLE001 (whatever a damaged header raises)
    raise CheckpointError(f"{fpath}: cannot read the array header (leaf {e['leaf']}): "
                          f"{type(err).__name__}: {err}; the file is corrupted.") from None
  if list(shape) != e["shape"] or dtype != want_dtype:
    raise CheckpointError(f"{fpath}: holds {dtype.name}{list(shape)}, the manifest says "
                          f"{want_dtype.name}{e['shape']} (leaf {e['leaf']}); corrupted.")
  try:  # the header just checked: np.load reads the same shape and dtype
    stored = np.load(fpath, allow_pickle=False)
  except Exception as err:  # noqa: BLE001 (a truncated or damaged file, however it fails)
    raise CheckpointError(f"{fpath}: cannot load (leaf {e['leaf']}): {type(err).__name__}: "
                          f"{err}; the file is truncated or corrupted.") from None
  return stored.view(_dtype(e["dtype"], fpath)) if e["stored_as"] else stored


def _dtype(name: str, where: str) -> np.dtype:
  try:
    import jax.numpy as jnp  # noqa: PLC0415 (knows ml_dtypes names such as bfloat16)
    return np.dtype(jnp.dtype(name))
  except TypeError:
    raise CheckpointError(f"{where}: unknown dtype {name!r}.") from None


def read_arrays(path: str, manifest: Dict[str, Any], *, verify: bool = True) -> List[np.ndarray]:
  """Every array of the checkpoint, loaded and (``verify``) checksum-verified; all or nothing.

  Without ``verify`` the files are still checked for existence, length, shape
  and dtype (so truncation is caught), not for flipped bits.
  """
  path = os.fspath(path)
  for e in manifest["arrays"]:
    if not isinstance(e, dict) \
        or not all(k in e for k in ("leaf", "file", "shape", "dtype", "stored_as", "crc32")) \
        or not isinstance(e["file"], str) or os.path.basename(e["file"]) != e["file"]:
      raise CheckpointError(f"{os.path.join(path, MANIFEST)}: malformed array entry {e!r}.")
  if manifest.get("crc32_segment_bytes") != SEGMENT:
    raise CheckpointError(f"{os.path.join(path, MANIFEST)}: CRC segment size "
                          f"{manifest.get('crc32_segment_bytes')!r}, expected {SEGMENT}.")
  entries = manifest["arrays"]
  arrays = _run_all(lambda e: _read_one(path, e),
                    [(e, int(e.get("nbytes", 0)) >= _SMALL) for e in entries])
  if not verify:
    return arrays
  # Checksums after every file is in memory, spread over the pool by segment.
  for e, crcs in zip(entries, _crc_tasks(arrays), strict=True):
    if crcs != e["crc32"]:
      raise CheckpointError(f"{os.path.join(path, e['file'])}: checksum mismatch (leaf "
                            f"{e['leaf']}): the file is corrupted.")
  return arrays
