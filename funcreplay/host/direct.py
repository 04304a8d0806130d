"""Sampling (and updating priorities of) a host ``Table``'s CPU state in place, without a
jitted call (``direct.cc``).

A ``Table.sample_packed(..., out=buf)`` on a CPU table normally costs a
jitted call: ~25 us of dispatch for the 16-leaf state, the native kernel,
and a fresh XLA output buffer that a torch consumer then imports through
DLPack. The table owns its state exclusively (it never hands out its arrays;
``snapshot`` copies) and serialises every use of it under its lock, so it
can instead run the same kernel (``sample_core.h``'s ``RunSample``) on those
buffers directly through ctypes, with the batch written into ``buf``. The C
side also does what the jitted program does around the kernel (eligible
count, rate limiter, ``min_valid``, key advance), bit for bit: a table
sampled directly and one sampled through the jitted path hand out the same
items and end in the same state (tests/host/test_direct.py).

The price is the usual one of mutating in place: the Python side must make
sure no XLA computation is still using the buffers. ``DirectSampler.bind``
is called with the table's current state whenever it changed and blocks
until the state is ready (pending jitted writers); the table's read-only
programs (``snapshot``, ``stats``) finish before it releases its lock
(``Table._reading``).

Applies (``unsupported`` returns None) to a spec the native sample kernel
covers (``native.supports_sample``), sampled without ``where`` (a prioritized
sampler with ``max_staleness`` included: its eligible weight is the root of
the masked sum tree, which the C++ prologue builds exactly as the portable
program does). Where it applies, ``update_priorities``
runs in place too (``RunUpdatePriorities``, the jitted update's kernel, with
``priority**alpha`` computed by powers.h: the integer steps and tables of
``core.powers``, so the weights are the jitted program's bits for every exponent):
the jitted update cost ~130 us of validation and dispatch, and the next
direct sample then waited ~80 us for it (thread hand-off); in place it is
~40 us in all. A call with a denormal priority still takes the jitted path, as
before the integer weights (XLA had treated denormal inputs one way or the
other depending on the program; whether that still matters with the integer
p**alpha was not re-checked).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import jax
import numpy as np

from funcreplay import native as native_lib
from funcreplay.core import packing, powers
from funcreplay.core.spec import TableSpec
from funcreplay.native import build

_ABI_VERSION = 9  # direct.cc's kAbiVersion
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class SampleArgs(ctypes.Structure):
  """``funcreplay_direct_sample``'s argument (direct.cc ``FR_SAMPLE_FIELDS``, same order).

  The calling layout is defined once per side and checked at load (``check_layout``):
  the library exports each field's name, offset and size, so a field reordered, retyped
  or missing on either side is refused with a clear error, never misread."""
  _fields_ = [(name, _I64) for name in (
      "abi", "batch", "capacity", "replace", "max_times_sampled", "n_data", "version",
      "min_valid", "max_staleness", "min_size", "has_min_diff", "q", "q_min", "tree_nodes",
      "hist_size", "ledger_words", "out_bytes", "ring")] + [(name, _PTR) for name in (
      "row_bytes", "src_stride", "packed", "ledger_layout", "key", "occupied", "item_info",
      "occ_tree", "weight_tree", "ledger", "hist", "bounds", "pindex", "out", "data", "flags")]


class UpdateArgs(ctypes.Structure):
  """``funcreplay_direct_update_priorities``'s argument (direct.cc ``FR_UPDATE_FIELDS``)."""
  _fields_ = [("abi", _I64), ("capacity", _I64), ("tree_nodes", _I64), ("alpha_bits", _I64),
              ("pow_words", _PTR), ("ledger_words", _I64), ("ledger_layout", _PTR), ("k", _I64),
              ("slots", _PTR), ("row_keys", _PTR), ("priorities", _PTR), ("occupied", _PTR),
              ("item_info", _PTR), ("weight_tree", _PTR), ("occ_tree", _PTR), ("ledger", _PTR)]


_ERRORS = {1: "the Python and C++ sides disagree on the ABI version (rebuild the kernels)",
           2: "the ledger layout does not fit the ledger (rebuild the kernels)",
           3: "the packed layout does not match the output buffer"}


def describe(struct) -> str:
  """``struct``'s layout in the library's format: ``name:offset:size;...;sizeof:N;abi:V``."""
  fields = "".join(f"{name}:{getattr(struct, name).offset}:{ctypes.sizeof(ctype)};"
                   for name, ctype in struct._fields_)
  return f"{fields}sizeof:{ctypes.sizeof(struct)};abi:{_ABI_VERSION}"


def check_layout(lib, which: int, struct) -> None:
  """Raise unless the library's layout ``which`` (0 sample, 1 update) is ``struct``'s."""
  fn = lib.funcreplay_direct_layout
  fn.argtypes = [ctypes.c_int]
  fn.restype = ctypes.c_char_p
  theirs, ours = fn(which).decode(), describe(struct)
  if theirs != ours:
    diff = sorted(set(theirs.split(";")) ^ set(ours.split(";")))
    raise RuntimeError(f"funcreplay direct path: the C++ and Python calling layouts of "
                       f"{struct.__name__} differ ({', '.join(diff)}); the library was built "
                       "from other sources than this package (rebuild the kernels).")


def unsupported(spec: TableSpec, native: bool) -> Optional[str]:
  """None if a ``Table`` of ``spec`` can sample directly (``where=None``), else why not."""
  if not native:
    return "the table does not use the native kernels"
  if not native_lib.supports_sample(spec, stratified=False):
    return "the native sample kernel does not cover this spec"
  why = packing.packable(spec.signature)
  if why is not None:
    return why
  if build.library() is None:
    return f"the native library is unavailable ({build.error()})"
  return None


def on_cpu(state) -> bool:
  """True if every leaf of ``state`` is a single-device CPU array."""
  for leaf in jax.tree_util.tree_leaves(state):
    devices = leaf.devices()
    if len(devices) != 1 or next(iter(devices)).platform != "cpu":
      return False
  return True


def _pointer(x) -> int:
  return x.unsafe_buffer_pointer() if x.size else 0


class DirectSampler:
  """The direct sample and priority update of one ``Table`` (configuration and buffer
  pointers; not thread-safe: the table calls it under its lock)."""

  def __init__(self, spec: TableSpec, ledger_layout: np.ndarray):
    lib = build.library()
    check_layout(lib, 0, SampleArgs)
    check_layout(lib, 1, UpdateArgs)
    self._fn = lib.funcreplay_direct_sample
    self._fn.argtypes = [ctypes.c_void_p]
    self._fn.restype = ctypes.c_int
    self._update_fn = lib.funcreplay_direct_update_priorities
    self._update_fn.argtypes = [ctypes.c_void_p]
    self._update_fn.restype = ctypes.c_int
    self.spec = spec
    lim = spec.rate_limiter
    _, q = lim.ratio
    n_data = len(spec.signature.leaves)
    self._row_bytes = np.array(
        [int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
         for x in spec.signature.leaves], np.int64)
    # Each field's place in a stored item: its own array (offset 0, stride = its bytes),
    # or inside one packed row of storage.width words (core.storage).
    self._field_at = np.zeros(n_data, np.int64)
    self._src_stride = self._row_bytes.copy()
    if spec.packed_rows:
      self._field_at[1:] = np.cumsum(self._row_bytes)[:-1]
      self._src_stride[:] = int(self._row_bytes.sum())
    self._ledger_layout = np.asarray(ledger_layout, np.int64)
    self._data_ptrs = np.zeros(max(n_data, 1), np.uint64)
    self._flags = np.zeros(3, np.int32)
    a = self._args = SampleArgs()
    a.abi = _ABI_VERSION
    a.capacity = spec.capacity
    a.max_times_sampled = int(spec.max_times_sampled)
    a.n_data = n_data
    a.max_staleness = -1 if spec.max_staleness is None else spec.max_staleness
    a.ring = int(not spec.holes)
    a.min_size = lim.min_size_to_sample
    a.has_min_diff = int(lim.q_min is not None)
    a.q = q
    if a.has_min_diff:  # rate_limiters.RateLimiter.can_sample: ceil(min_diff * q)
      a.q_min = lim.q_min
    a.row_bytes = self._row_bytes.ctypes.data
    a.src_stride = self._src_stride.ctypes.data
    a.ledger_layout = self._ledger_layout.ctypes.data
    a.data = self._data_ptrs.ctypes.data
    a.flags = self._flags.ctypes.data
    self._args_at = ctypes.addressof(a)
    self._packed: dict = {}  # rows -> (packed offsets, nbytes)
    self._bound = None  # the state whose pointers are in the arguments
    self._key = None    # the key array whose pointer is in the arguments
    u = self._update = UpdateArgs()
    u.abi = _ABI_VERSION
    u.capacity = spec.capacity
    u.ledger_layout = self._ledger_layout.ctypes.data
    self._update_at = ctypes.addressof(u)
    if spec.prioritized:  # indexes.sample_weight: alpha as a float32 constant
      u.alpha_bits = int(np.float32(spec.sampler.priority_exponent).view(np.uint32))
      self._pow_words = powers.words()  # held: the struct keeps only its address
      u.pow_words = self._pow_words.ctypes.data

  def layout(self, rows: int) -> packing.PackedLayout:
    return packing.layout(self.spec.signature, rows)

  def _offsets(self, rows: int) -> Tuple[np.ndarray, int]:
    got = self._packed.get(rows)
    if got is None:
      lay = self.layout(rows)
      got = (np.array([f.offset for f in lay.fields] + [lay.nbytes], np.int64), lay.nbytes)
      self._packed[rows] = got
    return got

  def bind(self, state) -> None:
    """Point at ``state``'s buffers (after waiting for any computation writing them)."""
    if state is self._bound:
      return
    jax.block_until_ready(state)
    a, u = self._args, self._update
    a.occupied = u.occupied = _pointer(state.occupied)
    # item_info itself (uint32[C, 4], written in place): state.key & co. are copies.
    a.item_info = u.item_info = _pointer(state.item_info)
    a.occ_tree = u.occ_tree = _pointer(state.occ_tree)
    a.weight_tree = u.weight_tree = _pointer(state.weight_tree)
    a.ledger = u.ledger = _pointer(state.ledger)
    a.hist = _pointer(state.version_hist)
    a.bounds = _pointer(state.version_bounds)
    # The kernel reads and writes int32[2, C + 1] through this pointer (null when off):
    # a state of another shape must never reach it (the jitted kernel counts its elements).
    want = (2, self.spec.capacity + 1) if self.spec.position_index else (2, 0)
    if tuple(state.position_index.shape) != want:
      raise ValueError(f"direct sample: the state's position_index is "
                       f"{list(state.position_index.shape)}, the spec needs {list(want)}.")
    a.pindex = _pointer(state.position_index)
    leaves = jax.tree_util.tree_leaves(state.data)
    for d, at in enumerate(self._field_at):
      self._data_ptrs[d] = _pointer(leaves[0 if self.spec.packed_rows else d]) + int(at)
    a.tree_nodes = state.occ_tree.shape[0]
    a.hist_size = state.version_hist.shape[0]
    a.ledger_words = u.ledger_words = state.ledger.shape[0]
    u.tree_nodes = state.weight_tree.shape[0]
    self._bound = state

  def unbind(self) -> None:
    """Forget the bound state (the table replaced or dropped it)."""
    self._bound = None

  def sample(self, rng: np.ndarray, rows: int, replace: bool, version: int, min_valid: int,
             out: int) -> Tuple[int, int, int]:
    """Sample ``rows`` into the buffer at address ``out`` (uint8, the packed layout's size,
    C-contiguous and writable: the caller checked); advances ``rng`` (numpy uint32[2] key
    words) in place on success. Returns (ok, limiter_ok, eligible count)."""
    offsets, nbytes = self._offsets(rows)
    a = self._args
    a.batch = rows
    a.replace = int(replace)
    a.packed = offsets.ctypes.data
    a.out_bytes = nbytes
    a.version = version
    a.min_valid = min_valid
    if rng is not self._key:
      if rng.shape != (2,) or rng.dtype != np.uint32:
        raise ValueError(f"funcreplay direct sample: the key must be uint32[2] (threefry), "
                         f"got {rng.dtype}{list(rng.shape)}.")
      a.key = rng.ctypes.data
      self._key = rng
    a.out = out
    err = self._fn(self._args_at)
    if err:
      raise RuntimeError(f"funcreplay direct sample: {_ERRORS.get(err, f'error {err}')}.")
    ok, limiter_ok, cnt = self._flags.tolist()
    return ok, limiter_ok, cnt

  def update_priorities(self, slots: np.ndarray, keys: np.ndarray,
                        priorities: np.ndarray) -> None:
    """``update_priorities`` on the bound state, in place: ``slots`` int32[K], ``keys``
    uint32[K], ``priorities`` float32[K] (as given), each C-contiguous (the caller made
    them so). The weight tree gets ``priority**alpha`` by powers.h, the bits the jitted
    update computes (``core.powers``)."""
    u = self._update
    u.slots = slots.ctypes.data
    u.row_keys = keys.ctypes.data
    u.priorities = priorities.ctypes.data
    u.k = slots.shape[0]
    err = self._update_fn(self._update_at)
    if err:
      raise RuntimeError(f"funcreplay direct update_priorities: "
                         f"{_ERRORS.get(err, f'error {err}')}.")
