"""Compile the native kernels once per (sources, jaxlib) and register their FFI targets.

One shared library holds ``kernels.cc`` (the XLA FFI handlers),
``direct.cc`` (the direct host entry points, ``funcreplay.host.direct``) and
``trajectory.cc`` (the trajectory tables' window gather and draws,
``native.trajectory``), which share the headers of ``csrc/`` (``sample_core.h``,
``insert_core.h`` and ``priorities_core.h``: the kernels' bodies). It is built on first
use with
the system C++ compiler (``$CXX``, else ``c++``/``g++``) against the XLA FFI
headers that ship with jaxlib (``jax.ffi.include_dir()``), and cached in
``$FUNCREPLAY_CACHE_DIR`` (default ``~/.cache/funcreplay``) under a name that
hashes the sources, the jaxlib version and the compiler command, so a changed
kernel or jaxlib rebuilds. Building takes ~3 s; concurrent processes (pytest
workers) each build into a private temporary file and rename it into place.

Any failure (no compiler, headers missing, load error, a library whose
``TableState.item_info`` columns, ``csrc/item_info.h``, are not those of
``funcreplay.core.item_info``: ``check_item_info``) is reported once as a
warning and the portable JAX implementation is used instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from typing import Optional

import jax
import jaxlib

from funcreplay.core import item_info

# The C++ sources live beside this module in csrc/ (shipped as package data).
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_UNITS = [os.path.join(_HERE, name) for name in ("kernels.cc", "direct.cc", "trajectory.cc")]
# Every header in csrc/ is hashed into the library's name, so a changed or new header
# rebuilds (a list kept by hand could miss one and load a stale library).
_HEADERS = sorted(os.path.join(_HERE, name) for name in os.listdir(_HERE) if name.endswith(".h"))
_TARGETS = {"funcreplay_sample": "FuncreplaySample",
            "funcreplay_fifo_insert": "FuncreplayFifoInsert",
            "funcreplay_update_priorities": "FuncreplayUpdatePriorities",
            "funcreplay_window_gather": "FuncreplayWindowGather",
            "funcreplay_window_draw": "FuncreplayWindowDraw",
            "funcreplay_window_index_draw": "FuncreplayWindowIndexDraw"}

_lock = threading.Lock()
_state: dict = {"loaded": None, "error": None, "lib": None}


def compiler() -> Optional[str]:
  """Path of the C++ compiler the kernels are built with, or None."""
  for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def _cache_dir() -> str:
  return os.environ.get("FUNCREPLAY_CACHE_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "funcreplay")


def _build(cxx: str) -> str:
  include = jax.ffi.include_dir()
  flags = ["-O3", "-std=c++17", "-shared", "-fPIC", "-w",
           f"-I{include}"]
  src = b""
  for path in _UNITS + _HEADERS:
    with open(path, "rb") as f:
      src += f.read()
  digest = hashlib.sha256(src + jaxlib.__version__.encode() + " ".join([cxx] + flags).encode())
  out_dir = _cache_dir()
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"kernels-{digest.hexdigest()[:16]}.so")
  if os.path.exists(path):
    return path
  fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
  os.close(fd)
  try:
    proc = subprocess.run([cxx, *flags, *_UNITS, "-o", tmp], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
      raise RuntimeError(f"{cxx} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    os.replace(tmp, path)  # atomic: a concurrent builder's identical file is fine
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
  return path


def item_info_layout() -> str:
  """``funcreplay.core.item_info``'s columns in the format of ``funcreplay_item_info_layout``
  (direct.cc): ``key:0;version:1;times_sampled:2;priority:3;width:4``."""
  cols = item_info.COLUMNS
  return (f"key:{cols['key']};version:{cols['version']};"
          f"times_sampled:{cols['times_sampled']};priority:{cols['priority']};"
          f"width:{item_info.WIDTH}")


def check_item_info(lib) -> None:
  """Raise unless the library's item_info layout (csrc/item_info.h) is
  ``funcreplay.core.item_info``'s (the source of truth): a kernel reading another column
  than the portable code writes would give wrong results, never an error."""
  fn = lib.funcreplay_item_info_layout
  fn.argtypes = []
  fn.restype = ctypes.c_char_p
  theirs, ours = fn().decode(), item_info_layout()
  if theirs != ours:
    raise RuntimeError(f"the kernels' item_info layout ({theirs}; csrc/item_info.h) is not "
                       f"funcreplay.core.item_info's ({ours}): update item_info.h")


def load() -> bool:
  """Build (if needed), load and register the kernels; True on success. Cached."""
  if _state["loaded"] is not None:
    return _state["loaded"]
  with _lock:
    if _state["loaded"] is not None:
      return _state["loaded"]
    try:
      cxx = compiler()
      if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX)")
      lib = ctypes.cdll.LoadLibrary(_build(cxx))
      check_item_info(lib)
      for target, symbol in _TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                                    platform="cpu")
      _state.update(loaded=True, lib=lib)
    except Exception as e:  # noqa: BLE001 -- any failure means: use the JAX path
      _state.update(loaded=False, error=f"{type(e).__name__}: {e}")
      warnings.warn(f"funcreplay: native CPU kernels unavailable ({_state['error']}); "
                    "using the portable JAX implementation.", RuntimeWarning, stacklevel=3)
    return _state["loaded"]


def loaded() -> bool:
  """True when ``load`` has already succeeded; never builds (safe inside a trace)."""
  return bool(_state["loaded"])


def disabled() -> bool:
  """True when ``FUNCREPLAY_NATIVE`` asks for the portable programs (tables built with
  ``native=None``; an explicit ``native=True`` still builds the kernels)."""
  return os.environ.get("FUNCREPLAY_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def library() -> Optional[ctypes.CDLL]:
  """The loaded shared library (None unless ``load()`` succeeded)."""
  return _state["lib"] if load() else None


def error() -> Optional[str]:
  """Why the kernels are unavailable (None if they loaded or were not tried)."""
  return _state["error"]
