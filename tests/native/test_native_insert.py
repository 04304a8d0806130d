"""The native insert and update_priorities kernels against the portable path: the same
state, leaf for leaf (hypothesis over specs and op sequences), and the insert kernel in the
compiled program, updating the donated state in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcreplay as fr
from tests.helpers import (
  ITEM,
  assert_states_equal,
  assert_trees_consistent,
  items_from_ids,
  require_native_kernels,
)


@pytest.fixture(autouse=True)
def _need_kernels():
  require_native_kernels()


def _table(spec, use_native=True):
  return fr.make_table(spec, native=use_native)


INSERT_SPECS = [  # every sampler, with and without staleness / metadata
    fr.TableSpec(16, ITEM),
    fr.TableSpec(16, ITEM, max_staleness=2, metadata=("task", "status")),
    fr.TableSpec(16, ITEM, position_index=True, max_staleness=2),  # appends (position_index.h)
    fr.TableSpec(16, ITEM, sampler=fr.Prioritized(0.6), max_staleness=1 << 30,
                 max_times_sampled=2),
    fr.TableSpec(13, ITEM, sampler=fr.MinHeap(), max_staleness=0),
    fr.TableSpec(8, ITEM, sampler=fr.Lifo(), rate_limiter=fr.Queue(8)),
    fr.TableSpec(16, ITEM, sampler=fr.Prioritized(0.6),
                 rate_limiter=fr.SampleToInsertRatio(3.5, 4, (-1e6, 1e6))),
]


@settings(max_examples=15)
@given(spec_i=st.integers(0, len(INSERT_SPECS) - 1),
       ops_=st.lists(st.tuples(st.sampled_from(["insert", "insert", "delete", "evict",
                                                "update"]),
                               st.integers(1, 11), st.integers(0, 2**31 - 1)),
                     min_size=1, max_size=10))
def test_insert_and_update_are_bit_identical_to_portable(spec_i, ops_):
  """Insert and update_priorities are deterministic: the kernels and the portable
  path must produce the same state, leaf for leaf, over sequences that wrap the
  ring, overwrite items and holes, use masks, any int32 versions, invalid
  priorities, metadata, stale keys, out-of-range and duplicate slots."""
  spec = INSERT_SPECS[spec_i]
  nat, por = _jitted_pair(spec)
  s_nat = s_por = nat["init"]()
  for op, n, seed in ops_:
    rng = np.random.default_rng(seed)
    if op == "insert":
      b = min(n, spec.capacity)
      kw = dict(mask=jnp.asarray(rng.random(b) < 0.8),
                version=jnp.asarray(rng.integers(-2**31, 2**31, b) if seed % 5 == 0
                                    else rng.integers(0, 6, b), jnp.int32),
                priority=jnp.asarray(np.where(rng.random(b) < 0.1, -1.0, rng.random(b) * 3),
                                     jnp.float32))
      if spec.metadata:
        kw["metadata"] = {k: jnp.asarray(rng.integers(0, 3, b), jnp.int32)
                          for k in spec.metadata}
      items = items_from_ids(rng.integers(0, 1000, b))
      s_nat, s_por = nat["insert"](s_nat, items, **kw), por["insert"](s_por, items, **kw)
    elif op == "update":
      slots = rng.integers(-2, spec.capacity + 2, n).astype(np.int32)
      keys = np.asarray(s_nat.key)[np.clip(slots, 0, spec.capacity - 1)]
      keys = np.where(rng.random(n) < 0.2, keys + 1, keys).astype(np.uint32)  # stale keys
      prios = rng.random(n).astype(np.float32) * 4
      prios[rng.random(n) < 0.15] = rng.choice([np.nan, np.inf, -1.0])
      s_nat = nat["update"](s_nat, slots, keys, prios)
      s_por = por["update"](s_por, slots, keys, prios)
    elif op == "delete":
      slots = jnp.asarray(rng.integers(0, spec.capacity, 3), jnp.int32)
      s_nat = nat["delete"](s_nat, slots, s_nat.key[slots])
      s_por = por["delete"](s_por, slots, s_por.key[slots])
    elif spec.max_staleness is not None:
      v = jnp.int32(rng.integers(0, 6))
      s_nat, s_por = nat["evict"](s_nat, v), por["evict"](s_por, v)
    assert_states_equal(spec, s_nat, s_por, f"{op}: state")
  assert_trees_consistent(spec, s_nat)


@functools.lru_cache(maxsize=None)
def _jitted_pair(spec):
  out = []
  for use_native in (True, False):
    t = _table(spec, use_native)
    out.append(dict(init=t.init, insert=jax.jit(t.insert), delete=jax.jit(t.delete),
                    evict=jax.jit(t.evict_stale), update=jax.jit(t.update_priorities)))
  return out


def test_insert_kernel_in_hlo_and_in_place():
  spec = fr.TableSpec(4096, ITEM, max_staleness=3, metadata=("task",))
  t = _table(spec)
  f = jax.jit(lambda s, x: t.insert(s, x, version=2), donate_argnums=0)
  st = t.init()
  x = items_from_ids(np.arange(100))
  assert "funcreplay_fifo_insert" in f.lower(st, x).compile().as_text()
  before = [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(st) if a.size >= 4096]
  for _ in range(50):  # wraps the ring
    st = f(st, x)
  after = [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(st) if a.size >= 4096]
  assert before == after
  assert int(st.size) == 4096


@pytest.mark.parametrize("b, mask, extra, kernel", [
    (1, False, {}, False), (1, True, {}, True), (2, False, {}, True),
    (1, False, dict(sampler=fr.Prioritized(0.6)), True), (1, False, dict(max_staleness=3), True),
    (1, False, dict(metadata=("task",)), True)])
def test_one_row_ring_insert_runs_the_lean_program(b, mask, extra, kernel):
  """One row into the plain ring, without a mask, runs the lean JAX program on a native
  table (the faster executor there, ops.insert); a mask, more rows, a Prioritized sampler,
  max_staleness or metadata run the kernel."""
  t = _table(fr.TableSpec(4096, ITEM, **extra))
  kw = {"mask": jnp.ones((b,), bool)} if mask else {}
  f = jax.jit(lambda s, x: t.insert(s, x, **kw))
  text = f.lower(t.init(), items_from_ids(np.arange(b))).compile().as_text()
  assert ("funcreplay_fifo_insert" in text) == kernel
