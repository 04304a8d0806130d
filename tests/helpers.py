"""Shared test utilities: small specs, jitted table functions, state checks."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import funcreplay as fr
from funcreplay.checkpoint import record
from funcreplay.core import counters as ctr
from funcreplay.core import indexes, sampling
from funcreplay.native import executor

ITEM = {"x": jax.ShapeDtypeStruct((), jnp.int32), "y": jax.ShapeDtypeStruct((2,), jnp.float32)}


def stored(state, signature=ITEM):
  """The items ``state`` holds as ``signature``'s pytree (every leaf ``[C, ...]``), whatever
  its storage (``fr.stored_items``): packed rows are one array, columns a pytree."""
  kind = "rows" if isinstance(state.data, (jax.Array, np.ndarray)) and len(
      jax.tree_util.tree_leaves(signature)) > 1 else "columns"
  cap = int(np.shape(state.occupied)[-1])
  return fr.stored_items(fr.TableSpec(cap, signature, storage=kind), state)


def require_native_kernels():
  """Skip (disabled by FUNCREPLAY_NATIVE, or no C++ compiler) or fail (a compiler
  exists but the kernels do not build) unless the native kernels are available."""
  import pytest

  from funcreplay.native import build
  if build.disabled():
    pytest.skip("native kernels disabled by FUNCREPLAY_NATIVE")
  if fr.native.available():
    return
  if build.compiler() is None:
    pytest.skip("no C++ compiler: the native kernels cannot be built here")
  pytest.fail(f"native kernels failed to build: {fr.native.error()}")


def items_from_ids(ids):
  ids = np.asarray(ids, np.int32)
  return {"x": jnp.asarray(ids), "y": jnp.asarray(np.stack([ids, -ids], -1).astype(np.float32))}


def jitted(spec: fr.TableSpec):
  """Jitted pure functions of ``spec`` (cached per spec and implementation)."""
  return _jitted(spec, fr.native.use_native())


@functools.lru_cache(maxsize=None)
def _jitted(spec: fr.TableSpec, native: bool):
  t = fr.make_table(spec, native=native)
  return dict(
      table=t,
      insert=jax.jit(t.insert),
      sample=jax.jit(t.sample, static_argnames=("batch_size", "replace")),
      delete=jax.jit(t.delete),
      update=jax.jit(t.update_priorities),
      evict=jax.jit(t.evict_stale),
  )


@functools.lru_cache(maxsize=None)
def _rebuild(spec):
  return jax.jit(functools.partial(indexes.rebuild, spec))


def assert_trees_consistent(spec: fr.TableSpec, state: fr.TableState):
  """Every device tree (and the version index) equals a from-scratch rebuild."""
  rebuilt = _rebuild(spec)(state)
  np.testing.assert_array_equal(np.asarray(state.occ_tree), np.asarray(rebuilt.occ_tree))
  if spec.prioritized:
    np.testing.assert_allclose(np.asarray(state.weight_tree), np.asarray(rebuilt.weight_tree),
                               rtol=1e-6, atol=0)
  if spec.needs_remover_tree:
    assert int(state.remover_tree[1]) == int(rebuilt.remover_tree[1])
  # The version index (staleness counts) too.
  np.testing.assert_array_equal(np.asarray(state.version_hist), np.asarray(rebuilt.version_hist))
  np.testing.assert_array_equal(np.asarray(state.version_bounds),
                                np.asarray(rebuilt.version_bounds))


def counters_dict(state):
  return {k: ctr.to_int(v) for k, v in state.counters.items()}


def host_sample(spec: fr.TableSpec):
  """The sampling engine with the host-only switches (``enabled``, ``split_key``,
  ``packed``) as the host ``Table`` runs it (host/programs.py); the pure
  ``make_table(spec).sample`` does not take them."""
  return functools.partial(sampling.sample, spec, native=executor.choose(None))


def assert_bit_identical(a, b, what):
  """``a`` and ``b`` (pytrees) have the same structure, and every leaf the same dtype, shape
  and bytes (NaN payloads and -0.0 included): the executors' and storages' oracle."""
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b)
  assert len(la) == len(lb), what
  for (path, x), y in zip(la, lb):
    x, y = np.atleast_1d(np.asarray(x)), np.atleast_1d(np.asarray(y))
    assert x.dtype == y.dtype and x.shape == y.shape, (what, jax.tree_util.keystr(path))
    assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), (
        what, jax.tree_util.keystr(path), x, y)


def assert_states_equal(spec, a, b, what):
  """Leaf for leaf, bit for bit; the ledger unpacked, so a failure names the counter."""
  la = jax.tree_util.tree_leaves_with_path(record.to_record(a, spec))
  lb = jax.tree_util.tree_leaves(record.to_record(b, spec))
  assert len(la) == len(lb)
  for (path, x), y in zip(la, lb):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=f"{what}{jax.tree_util.keystr(path)}")
