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
items and end in the same state (tests/test_direct.py).

The price is the usual one of mutating in place: the Python side must make
sure no XLA computation is still using the buffers. ``DirectSampler.bind``
is called with the table's current state whenever it changed and blocks
until the state is ready (pending jitted writers); the table's read-only
programs (``snapshot``, ``stats``) finish before it releases its lock
(``Table._reading``).

Applies (``unsupported`` returns None) to a spec the native sample kernel
covers (``native.supports_sample``), sampled without ``where``, except a
prioritized sampler with ``max_staleness`` (whose eligible weight is an O(C)
float sum in JAX: the direct path could not reproduce its rounding, and the
O(C) pass dominates that call anyway). Where it applies, ``update_priorities``
runs in place too (``RunUpdatePriorities``, the jitted update's kernel, with
``priority**alpha`` from libm's ``powf``, which XLA:CPU calls for ``pow``):
the jitted update cost ~130 us of validation and dispatch, and the next
direct sample then waited ~80 us for it (thread hand-off); in place it is
~40 us in all. A call with a denormal priority still takes the jitted path
(XLA treats denormal inputs one way or the other depending on the program),
and so does every update of a table whose ``alpha`` is a whole number >= 2
or 0.5 (JAX / XLA compute those powers by multiplication or a square root,
not ``powf``).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Tuple

import jax
import numpy as np

from funcreplay import native as native_lib
from funcreplay.core import packing
from funcreplay.core import selectors as sel
from funcreplay.core.spec import TableSpec
from funcreplay.native import build

# The layout of direct.cc's configuration and pointer vectors.
_ABI_VERSION = 3
(_ABI, _BATCH, _CAPACITY, _REPLACE, _MAX_TIMES, _RING, _N_DATA, _VERSION, _MIN_VALID,
 _MAX_STALENESS, _MIN_SIZE, _HAS_MIN_DIFF, _Q, _Q_MIN, _TREE_NODES, _HIST_SIZE,
 _LEDGER_WORDS, _KEY_WORDS, _OUT_BYTES, _FIXED) = range(20)
(_P_KEY, _P_OCCUPIED, _P_KEYS, _P_VERSION, _P_TIMES, _P_PRIORITY, _P_OCC_TREE,
 _P_WEIGHT_TREE, _P_LEDGER, _P_HIST, _P_BOUNDS, _P_OUT, _P_DATA) = range(13)
(_U_ABI, _U_CAPACITY, _U_TREE_NODES, _U_ALPHA_BITS, _U_LEDGER_WORDS, _U_FIXED) = range(6)
_ERRORS = {1: "the Python and C++ sides disagree on the call layout (rebuild the kernels)",
           2: "the ledger layout does not fit the ledger (rebuild the kernels)",
           3: "the packed layout does not match the output buffer"}


def unsupported(spec: TableSpec, native: bool) -> Optional[str]:
  """None if a ``Table`` of ``spec`` can sample directly (``where=None``), else why not."""
  if not native:
    return "the table does not use the native kernels"
  if not native_lib.supports_sample(spec, stratified=False):
    return "the native sample kernel does not cover this spec"
  if spec.prioritized and spec.max_staleness is not None:
    return "a prioritized sampler with max_staleness sums eligible weights in JAX"
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
    self._fn = lib.funcreplay_direct_sample
    self._fn.argtypes = [ctypes.c_void_p] * 3
    self._fn.restype = ctypes.c_int
    self.spec = spec
    lim = spec.rate_limiter
    _, q = lim.ratio
    n_data = len(spec.signature.leaves)
    self._n_data = n_data
    self._base = np.zeros(_FIXED, np.int64)
    base = self._base
    base[_ABI] = _ABI_VERSION
    base[_CAPACITY] = spec.capacity
    base[_MAX_TIMES] = int(spec.max_times_sampled)
    base[_RING] = int(isinstance(spec.sampler, sel.Uniform) and sel.is_ring(spec.remover))
    base[_N_DATA] = n_data
    base[_MAX_STALENESS] = -1 if spec.max_staleness is None else spec.max_staleness
    base[_MIN_SIZE] = lim.min_size_to_sample
    base[_HAS_MIN_DIFF] = int(lim.q_min is not None)
    base[_Q] = q
    if base[_HAS_MIN_DIFF]:  # rate_limiters.RateLimiter.can_sample: ceil(min_diff * q)
      base[_Q_MIN] = lim.q_min
    self._row_bytes = np.array(
        [int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
         for x in spec.signature.leaves], np.int64)
    self._ledger_layout = np.asarray(ledger_layout, np.int64)
    self._configs: dict = {}  # (rows, replace) -> int64 config vector
    self._ptrs = np.zeros(_P_DATA + n_data, np.uint64)
    self._flags = np.zeros(3, np.int32)
    self._ptrs_at = self._ptrs.ctypes.data
    self._flags_at = self._flags.ctypes.data
    self._bound = None  # the state whose pointers are in _ptrs
    self._key = None    # the key array whose pointer is in _ptrs
    self._update_fn = lib.funcreplay_direct_update_priorities
    self._update_fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64]
    self._update_fn.restype = ctypes.c_int
    ucfg = self._update_cfg = np.zeros(_U_FIXED + len(self._ledger_layout), np.int64)
    ucfg[_U_ABI] = _ABI_VERSION
    ucfg[_U_CAPACITY] = spec.capacity
    # Whether update_priorities may run here: XLA:CPU computes p**alpha with libm's powf,
    # except for a whole-number alpha >= 2, which JAX turns into multiplications, and
    # alpha 0.5, which XLA turns into a square root (each an ulp away from powf on some
    # inputs): those tables update through the jitted path.
    self.updates_in_place = True
    if spec.prioritized:  # indexes.sample_weight: alpha as a float32 constant
      alpha = spec.sampler.priority_exponent
      ucfg[_U_ALPHA_BITS] = int(np.float32(alpha).view(np.uint32))
      self.updates_in_place = not ((alpha >= 2 and float(alpha).is_integer()) or alpha == 0.5)
    ucfg[_U_FIXED:] = self._ledger_layout
    self._update_cfg_at = ucfg.ctypes.data
    self._rows = np.zeros(3, np.uint64)
    self._rows_at = self._rows.ctypes.data

  def layout(self, rows: int) -> packing.PackedLayout:
    return packing.layout(self.spec.signature, rows)

  def _config(self, rows: int, replace: bool) -> Tuple[np.ndarray, int]:
    got = self._configs.get((rows, replace))
    if got is None:
      lay = self.layout(rows)
      offsets = np.array([f.offset for f in lay.fields] + [lay.nbytes], np.int64)
      cfg = np.concatenate([self._base, self._row_bytes, offsets, self._ledger_layout])
      cfg[_BATCH] = rows
      cfg[_REPLACE] = int(replace)
      cfg[_OUT_BYTES] = lay.nbytes
      got = (cfg, cfg.ctypes.data)
      self._configs[(rows, replace)] = got
    return got

  def bind(self, state) -> None:
    """Point at ``state``'s buffers (after waiting for any computation writing them)."""
    if state is self._bound:
      return
    jax.block_until_ready(state)
    p = self._ptrs
    p[_P_OCCUPIED] = _pointer(state.occupied)
    p[_P_KEYS] = _pointer(state.key)
    p[_P_VERSION] = _pointer(state.version)
    p[_P_TIMES] = _pointer(state.times_sampled)
    p[_P_PRIORITY] = _pointer(state.priority)
    p[_P_OCC_TREE] = _pointer(state.occ_tree)
    p[_P_WEIGHT_TREE] = _pointer(state.weight_tree)
    p[_P_LEDGER] = _pointer(state.ledger)
    p[_P_HIST] = _pointer(state.version_hist)
    p[_P_BOUNDS] = _pointer(state.version_bounds)
    for d, leaf in enumerate(jax.tree_util.tree_leaves(state.data)):
      p[_P_DATA + d] = _pointer(leaf)
    self._tree_nodes = state.occ_tree.shape[0]
    self._hist_size = state.version_hist.shape[0]
    self._ledger_words = state.ledger.shape[0]
    self._update_cfg[_U_TREE_NODES] = state.weight_tree.shape[0]
    self._update_cfg[_U_LEDGER_WORDS] = self._ledger_words
    self._bound = state

  def unbind(self) -> None:
    """Forget the bound state (the table replaced or dropped it)."""
    self._bound = None

  def sample(self, rng: np.ndarray, rows: int, replace: bool, version: int, min_valid: int,
             out: int) -> Tuple[int, int, int]:
    """Sample ``rows`` into the buffer at address ``out`` (uint8, the packed layout's size,
    C-contiguous and writable: the caller checked); advances ``rng`` (numpy uint32 key
    words) in place on success. Returns (ok, limiter_ok, eligible count)."""
    cfg, cfg_at = self._config(rows, replace)
    cfg[_VERSION] = version
    cfg[_MIN_VALID] = min_valid
    cfg[_TREE_NODES] = self._tree_nodes
    cfg[_HIST_SIZE] = self._hist_size
    cfg[_LEDGER_WORDS] = self._ledger_words
    cfg[_KEY_WORDS] = rng.size
    if rng is not self._key:
      self._ptrs[_P_KEY] = rng.ctypes.data
      self._key = rng
    self._ptrs[_P_OUT] = out
    err = self._fn(cfg_at, self._ptrs_at, self._flags_at)
    if err:
      raise RuntimeError(f"funcreplay direct sample: {_ERRORS.get(err, f'error {err}')}.")
    ok, limiter_ok, cnt = self._flags.tolist()
    return ok, limiter_ok, cnt

  def update_priorities(self, slots: np.ndarray, keys: np.ndarray,
                        priorities: np.ndarray) -> None:
    """``update_priorities`` on the bound state, in place: ``slots`` int32[K], ``keys``
    uint32[K], ``priorities`` float32[K] (as given), each C-contiguous (the caller made
    them so). The weight tree gets ``priority**alpha`` from libm's ``powf``, as XLA:CPU
    computes it in the jitted update (callers check ``updates_in_place`` first)."""
    r = self._rows
    r[0] = slots.ctypes.data
    r[1] = keys.ctypes.data
    r[2] = priorities.ctypes.data
    err = self._update_fn(self._update_cfg_at, self._ptrs_at, self._rows_at, slots.shape[0])
    if err:
      raise RuntimeError(f"funcreplay direct update_priorities: "
                         f"{_ERRORS.get(err, f'error {err}')}.")
