"""On-disk format: one ``.npy`` file per array plus ``manifest.json``, written crash-safely.

A checkpoint is a directory::

    ckpt/
      manifest.json          schema version, funcreplay version, spec, host state,
                             user extras, and per array: leaf path, file, shape,
                             dtype, byte count, crc32
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

Files are byte-for-byte what ``np.save`` writes and are read with
``np.load(f, allow_pickle=False)``. Writes go out in 1 MiB chunks, each
checksummed right after it is written (while it is still in the CPU cache).

Checksums are CRC-32 (``zlib.crc32``) of each array's raw C-order bytes. It
runs at ~4 GB/s on one core here (sha256 ~1.8 GB/s, blake2b ~0.9 GB/s), so
checksumming costs a small fraction of writing the same bytes, and it
catches the failures a checkpoint meets (truncation, bit rot, partial
copies). It is not a defence against deliberate tampering.
"""

from __future__ import annotations

import concurrent.futures
import io
import json
import os
import re
import secrets
import shutil
import threading
import zlib
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from funcreplay.checkpoint.errors import CheckpointError

FORMAT = "funcreplay.checkpoint"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
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


def crc32(arr: np.ndarray) -> int:
  """CRC-32 of the raw bytes of a C-contiguous array (any dtype, any rank)."""
  return zlib.crc32(arr.reshape(-1).view(np.uint8)) & 0xFFFFFFFF


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


_CHUNK = 1 << 20  # bytes per write/read call: small enough that the CRC finds the chunk in L2


def _write_one(dirpath: str, file: str, arr: np.ndarray, fsync: bool = True) -> int:
  """Write ``arr`` in .npy format, fsync it (if ``fsync``), return the CRC-32 of its bytes.

  Same bytes as ``np.save``; the data goes out in chunks, each checksummed
  right after it was written (one pass over memory instead of two).
  """
  stored, _ = _storable(arr)
  raw = stored.reshape(-1).view(np.uint8)
  crc = 0
  with open(os.path.join(dirpath, file), "wb") as f:
    header = np.lib.format.header_data_from_array_1_0(stored)
    if _needs_v2(header):
      np.lib.format.write_array_header_2_0(f, header)
    else:
      np.lib.format.write_array_header_1_0(f, header)
    for i in range(0, raw.nbytes, _CHUNK):
      chunk = raw[i:i + _CHUNK]
      f.write(chunk)
      crc = zlib.crc32(chunk, crc)
    f.flush()
    if fsync:
      os.fsync(f.fileno())
  return crc & 0xFFFFFFFF


def _needs_v2(header: Dict[str, Any]) -> bool:
  """Whether a .npy header is too long for format 1.0 (``np.save`` decides the same way)."""
  try:
    np.lib.format.write_array_header_1_0(io.BytesIO(), header)
    return False
  except ValueError:
    return True


def write_dir(path: str, arrays: Sequence[Tuple[str, np.ndarray]], header: Dict[str, Any],
              *, overwrite: bool = False, fsync: bool = True) -> str:
  """Write ``arrays`` ([(leaf name, ndarray)]) and a manifest to directory ``path``, atomically.

  Args:
    path: the final directory; its parent must exist.
    arrays: leaves in order; each becomes one ``.npy`` file.
    header: JSON-able fields merged into the manifest (spec, host state...).
    overwrite: replace an existing checkpoint at ``path`` (the old one is
      renamed aside first and deleted after the new one is in place).
    fsync: fsync files and directories (durable against power loss); False
      is safe against process crashes only.

  Returns:
    ``path``.
  """
  path = os.path.abspath(os.fspath(path))
  parent, base = os.path.split(path)
  if not os.path.isdir(parent):
    raise FileNotFoundError(f"checkpoint save: parent directory {parent!r} does not exist.")
  if os.path.exists(path) and not overwrite:
    raise FileExistsError(f"checkpoint save: {path!r} already exists; pass overwrite=True or "
                          "save to a new path (e.g. a checkpoint directory with step=).")
  tmp = os.path.join(parent, f"{TMP_PREFIX}{base}-{os.getpid()}-{secrets.token_hex(4)}")
  os.mkdir(tmp)
  old = None
  try:
    # (np.ascontiguousarray would turn 0-d arrays into 1-d ones)
    arrays = [(leaf, np.asarray(a, order="C")) for leaf, a in arrays]
    files = [f"{i:03d}-{_safe_name(leaf)}.npy" for i, (leaf, _) in enumerate(arrays)]
    # Every write goes to the pool: each ends in an fsync that waits on the disk.
    crcs = _run_all(lambda fa: _write_one(tmp, fa[0], fa[1], fsync),
                    [((f, a), True) for f, (_, a) in zip(files, arrays, strict=True)])
    entries = []
    for (leaf, a), file, crc in zip(arrays, files, crcs, strict=True):
      _, real = _storable(a)
      entries.append({"leaf": leaf, "file": file, "shape": list(a.shape),
                      "dtype": a.dtype.name, "stored_as": None if real is None else
                      f"u{a.dtype.itemsize}", "nbytes": int(a.nbytes), "crc32": crc})
    manifest = {"format": FORMAT, "schema_version": SCHEMA_VERSION, **header,
                "checksum": "crc32", "arrays": entries}
    text = json.dumps(manifest, indent=1, allow_nan=False)
    with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      if fsync:
        os.fsync(f.fileno())
    if fsync:
      fsync_path(tmp, directory=True)
    if os.path.exists(path):
      old = os.path.join(parent, f"{TRASH_PREFIX}{base}-{os.getpid()}-{secrets.token_hex(4)}")
      os.rename(path, old)
    os.rename(tmp, path)
    if fsync:
      fsync_path(parent, directory=True)
    if old is not None:
      shutil.rmtree(old, ignore_errors=True)
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
  if m.get("schema_version") != SCHEMA_VERSION:
    raise CheckpointError(f"{mpath}: schema version {m.get('schema_version')!r}; this "
                          f"funcreplay reads version {SCHEMA_VERSION}.")
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
  try:
    # np.load (np.fromfile underneath) measured several times faster here than a
    # chunked readinto + running CRC for large files, so the CRC is a second pass.
    stored = np.load(fpath, allow_pickle=False)
  except (OSError, ValueError, EOFError) as err:
    raise CheckpointError(f"{fpath}: cannot load (leaf {e['leaf']}): {err}; the file is "
                          "truncated or corrupted.") from None
  want_dtype = np.dtype(e["stored_as"]) if e["stored_as"] else _dtype(e["dtype"], fpath)
  if list(stored.shape) != e["shape"] or stored.dtype != want_dtype:
    raise CheckpointError(f"{fpath}: holds {stored.dtype.name}{list(stored.shape)}, the manifest "
                          f"says {want_dtype.name}{e['shape']} (leaf {e['leaf']}); corrupted.")
  arr = stored.view(_dtype(e["dtype"], fpath)) if e["stored_as"] else stored
  if crc32(arr) != e["crc32"]:
    raise CheckpointError(f"{fpath}: checksum mismatch (leaf {e['leaf']}): the file is "
                          "corrupted.")
  return arr


def _dtype(name: str, where: str) -> np.dtype:
  try:
    import jax.numpy as jnp  # noqa: PLC0415 (knows ml_dtypes names such as bfloat16)
    return np.dtype(jnp.dtype(name))
  except TypeError:
    raise CheckpointError(f"{where}: unknown dtype {name!r}.") from None


def read_arrays(path: str, manifest: Dict[str, Any]) -> List[np.ndarray]:
  """Every array of the checkpoint, loaded and checksum-verified (all or nothing)."""
  path = os.fspath(path)
  for e in manifest["arrays"]:
    if not isinstance(e, dict) \
        or not all(k in e for k in ("leaf", "file", "shape", "dtype", "stored_as", "crc32")) \
        or not isinstance(e["file"], str) or os.path.basename(e["file"]) != e["file"]:
      raise CheckpointError(f"{os.path.join(path, MANIFEST)}: malformed array entry {e!r}.")
  return _run_all(lambda e: _read_one(path, e),
                  [(e, int(e.get("nbytes", 0)) >= _SMALL) for e in manifest["arrays"]])
