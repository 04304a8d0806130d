"""The native executor of trajectory tables: the window gather of ``sample`` in C++.

``fr.make_trajectory_table(spec, native=None)`` builds the core's trajectory
table (``funcreplay.core.trajectory``) with ``NATIVE`` as its executor when the
native kernels are enabled (``native.use_native``: True / False as given, None
reads ``FUNCREPLAY_NATIVE`` now). On CPU every ``sample`` program (uniform or
prioritized, with or without masks) then copies its ``B`` windows with one
XLA FFI call (``csrc/trajectory.cc``: each window is at most two contiguous runs
of its env's ring, one ``memcpy`` each per storage leaf) instead of XLA's
element-wise gather of ``B * L`` rows, and the lean uniform draws (closed form
with ``cross_episodes=True``, the episode index otherwise; no masks, threefry
keys) are a second call; other
backends run the portable programs (``lax.platform_dependent``). The other
draws, the bookkeeping and ``add`` are the portable programs, and the kernels
follow the portable recipe, so for the same ``(state, key)`` the batch and the
new state are bit-identical with the kernels on or off
(``tests/native/test_trajectory_native.py``). BUILD.md "Trajectory tables".
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from funcreplay import native as native_lib
from funcreplay.core.trajectory import functional
from funcreplay.core.trajectory.spec import TrajectorySpec

TARGET = "funcreplay_window_gather"  # the FFI targets (native.build registers them)
DRAW_TARGET = "funcreplay_window_draw"
INDEX_DRAW_TARGET = "funcreplay_window_index_draw"


def supports(spec: TrajectorySpec) -> bool:
  """True if ``spec``'s storage has a native gather: whole-byte dtypes on every leaf (the
  kernel copies rows as bytes; XLA:CPU packs sub-byte types two or more per byte)."""
  return all(jax.dtypes.itemsize_bits(leaf.dtype) % 8 == 0
             for leaf in spec.signature.leaves)


def gather_windows(spec: TrajectorySpec, data, w, valid):
  """The storage leaves' ``[B, L, ...]`` rows of windows ``w`` (int32[B], in range where
  ``valid``), zero where not ``valid``: one FFI call for every leaf. Bit for bit
  ``core.trajectory.sample.gather_storage``."""
  leaves, treedef = jax.tree_util.tree_flatten(data)
  b, ln = w.shape[0], spec.sequence_length
  out_types = [jax.ShapeDtypeStruct((b, ln) + x.shape[2:], x.dtype) for x in leaves]
  call = jax.ffi.ffi_call(TARGET, out_types, vmap_method="sequential")
  got = call(jnp.asarray(w, jnp.int32), jnp.asarray(valid, bool), *leaves,
             num_envs=spec.num_envs, time_capacity=spec.time_capacity,
             sequence_length=ln, period=spec.period)
  return jax.tree_util.tree_unflatten(treedef, got)


def _draw(target: str, rng, a, c, b: int, **attrs):
  key = jax.random.key_data(rng) if jnp.issubdtype(jnp.asarray(rng).dtype,
                                                    jax.dtypes.prng_key) else rng
  out_types = [jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.bool_),
               jax.ShapeDtypeStruct((1,), jnp.int32)]
  call = jax.ffi.ffi_call(target, out_types, vmap_method="sequential")
  w, valid, n = call(jnp.asarray(key).astype(jnp.uint32).reshape(-1), a, c, **attrs)
  return w, valid, n[0]


def draw_closed_form(spec: TrajectorySpec, head, filled, rng, b: int, replace: bool):
  """``(w int32[b], valid bool[b], n int32[])``: the uniform draw of a table without episode
  tracking, no masks (``core.trajectory.sample._closed_form``, bit for bit; ``w`` is
  meaningful where ``valid``); ``rng`` a threefry key (raw or typed)."""
  return _draw(DRAW_TARGET, rng, head, filled, b, time_capacity=spec.time_capacity,
               sequence_length=spec.sequence_length, period=spec.period,
               replace=bool(replace))


def draw_index(spec: TrajectorySpec, ok_bits, ok_tree, rng, b: int, replace: bool):
  """The same for a table that tracks episodes: the ``x``-th set bit of the episode index
  (``core.trajectory.sample._index_draw``, bit for bit)."""
  return _draw(INDEX_DRAW_TARGET, rng, ok_bits, ok_tree, b, num_windows=spec.num_windows,
               replace=bool(replace))


class NativeTrajectoryExecutor:
  """``core.trajectory.functional.TrajectoryExecutor`` backed by ``csrc/trajectory.cc``."""

  def available(self) -> bool:
    # Asked while tracing: report only, never build (``choose`` built the kernels).
    return native_lib.loaded()

  def supports(self, spec: TrajectorySpec) -> bool:
    return supports(spec)

  def gather_windows(self, spec: TrajectorySpec, data, w, valid):
    return gather_windows(spec, data, w, valid)

  def draw_closed_form(self, spec: TrajectorySpec, head, filled, rng, b: int, replace: bool):
    return draw_closed_form(spec, head, filled, rng, b, replace)

  def draw_index(self, spec: TrajectorySpec, ok_bits, ok_tree, rng, b: int, replace: bool):
    return draw_index(spec, ok_bits, ok_tree, rng, b, replace)

  def __repr__(self) -> str:
    return "NATIVE_TRAJECTORY"


NATIVE = NativeTrajectoryExecutor()


def choose(native: Optional[bool]) -> Optional[NativeTrajectoryExecutor]:
  """``NATIVE`` or None for a table's ``native`` argument; choosing ``NATIVE`` builds and
  loads the kernels now (a missing compiler: one warning, then the portable gather)."""
  if native_lib.use_native(native):
    native_lib.ensure_built()  # now, when the programs are built: never inside a trace
    return NATIVE
  return None


def make_trajectory_table(spec: TrajectorySpec, *,
                          native: Optional[bool] = None) -> functional.TrajectoryTable:
  """Build the pure functions of the trajectory table ``spec`` describes.

  ``native``: on CPU, copy the sampled windows with the native kernel (same
  batches and states as the portable program, fewer XLA operations). False
  keeps the portable JAX implementation; None (default): the
  ``FUNCREPLAY_NATIVE`` environment variable, read now (unset: True). The rest (the
  spec check, an example) as ``funcreplay.core.trajectory.make_trajectory_table``.
  """
  if not isinstance(spec, TrajectorySpec):  # before choose(): no library build for a bad spec
    raise TypeError(f"make_trajectory_table expects a TrajectorySpec, got "
                    f"{type(spec).__name__}.")
  return functional.make_trajectory_table(spec, executor=choose(native))
