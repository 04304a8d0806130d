"""The deterministic samplers' selection without a sort (``ordering.first_eligible``):
the first B eligible slots in the sampler's order are numpy's lexicographic sort, slot
for slot, over random keys with extreme values and ties, random eligibility and every
B; a heap table's sample in a scan sorts no table-sized array and has no condition."""

from __future__ import annotations

import functools
from typing import NamedTuple

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import funcreplay as fr
from funcreplay.core import hlo, ordering
from funcreplay.core import selectors as sel

SELECTORS = [sel.Fifo(), sel.Lifo(), sel.MinHeap(), sel.MaxHeap(), sel.StalestFirst(),
             sel.FreshestFirst()]
# Extreme words (the digits cut 32-bit words at 30 bits, across word boundaries) and a
# few small values, so that ties on a digit or a whole key are frequent.
WORDS = st.sampled_from([0, 1, 2, 3, (1 << 30) - 1, 1 << 30, (1 << 31) - 1, 1 << 31,
                         (1 << 32) - 2, (1 << 32) - 1]) | st.integers(0, (1 << 32) - 1)
PRIORITIES = st.sampled_from([0.0, 1.0, 1.5, 3.4e38, 1e-45]) | st.floats(0, 1e6)


class _Columns(NamedTuple):
  """The columns ``ordering.order_keys`` reads (a pytree, so jit takes it)."""
  occupied: jnp.ndarray
  next_key: jnp.ndarray
  key: jnp.ndarray
  touched: jnp.ndarray
  priority: jnp.ndarray
  version: jnp.ndarray


def _state(c, keys, touched, clock, next_key, priority, version):
  return _Columns(
      occupied=jnp.zeros((c,), bool), next_key=jnp.uint32(next_key),
      key=jnp.asarray(keys, jnp.uint32),
      touched=jnp.asarray(list(touched) + [clock], jnp.uint32),
      priority=jnp.asarray(priority, jnp.float32), version=jnp.asarray(version, jnp.int32))


def _reference(selector, state, eligible, b):
  """numpy: eligible first, then the order keys, then the slot; the first ``b``."""
  keys = [np.asarray(ordering.ascending_u32(k)) for k in ordering.order_keys(selector, state)]
  c = eligible.shape[0]
  order = np.lexsort((np.arange(c), *reversed(keys), ~eligible))
  n = int(eligible.sum())
  return np.where(np.arange(b) < n, order[:b], -1), n


# ``first_eligible``'s executors: the select (CPU, TPU) and the one sort (GPU), each
# checked here on the CPU against numpy.
EXECUTORS = ["select_first", "sort_first"]


@functools.lru_cache(maxsize=None)
def _program(selector, b, executor="select_first"):
  fn = getattr(ordering, executor)
  return jax.jit(lambda s, e: fn(selector, s, e, b))


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("selector", SELECTORS, ids=lambda s: type(s).__name__)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_the_first_eligible_slots_are_the_sorted_ones(selector, executor, data):
  c = data.draw(st.integers(1, 24))
  col = lambda s: data.draw(st.lists(s, min_size=c, max_size=c))  # noqa: E731
  state = _state(c, col(WORDS), col(WORDS), data.draw(WORDS), data.draw(WORDS),
                 col(PRIORITIES), col(st.integers(-(1 << 31), (1 << 31) - 1) | st.just(0)))
  eligible = np.asarray(col(st.booleans()))
  b = data.draw(st.integers(1, c))
  got, n = _program(selector, b, executor)(state, jnp.asarray(eligible))
  want, n_want = _reference(selector, state, eligible, b)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert int(n) == n_want


@pytest.mark.parametrize("selector", [sel.Lifo(), sel.Fifo(), sel.MinHeap()],
                         ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("pattern", ["rising", "falling", "equal"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_long_monotone_and_equal_keys(selector, pattern, executor):
  """Keys that rise or fall along the slots (the top-k passes' slow and fast inputs),
  and all equal (every slot a candidate to the end: the slot decides)."""
  c, b = 3000, 37
  i = np.arange(c, dtype=np.int64)
  keys = {"rising": i, "falling": c - i, "equal": np.zeros(c, np.int64)}[pattern]
  state = _state(c, keys.astype(np.uint32), keys.astype(np.uint32), c + 1, c + 1,
                 (keys % 7).astype(np.float32), np.zeros(c, np.int32))
  eligible = (i % 5 != 3)
  got, _ = _program(selector, b, executor)(state, jnp.asarray(eligible))
  np.testing.assert_array_equal(np.asarray(got), _reference(selector, state, eligible, b)[0])


def test_first_eligible_picks_the_select_on_the_cpu():
  """The program lowered for the CPU holds the select's top-k passes, not the sort."""
  c, b = 3000, 37
  state = _state(c, np.arange(c), np.arange(c), c + 1, c + 1, np.ones(c), np.zeros(c))
  txt = jax.jit(lambda s, e: ordering.first_eligible(sel.MinHeap(), s, e, b)).lower(
      state, jnp.ones((c,), bool)).as_text()
  assert "topk" in txt.lower() or "top_k" in txt.lower(), txt[:2000]
  assert f"tensor<{c}xi32>, tensor<{c}xui32>" not in txt  # no multi-operand sort of C


def test_a_heap_sample_in_a_scan_sorts_no_table_sized_array():
  """The old program sorted all C slots (a multi-operand sort, 17 ms at C = 65,536). On
  the CPU: on a GPU ``first_eligible`` sorts the table by design (``sort_first``)."""
  cap, b = 4096, 32
  spec = fr.TableSpec(cap, {"x": np.zeros((), np.int32)}, sampler=fr.MinHeap(),
                      remover=fr.Fifo(), max_times_sampled=1)
  t = fr.make_table(spec, native=False)

  def run(s, i0):
    def step(c, i):
      s, acc = c
      s = t.insert(s, {"x": jnp.arange(b, dtype=jnp.int32) + i},
                   priority=(jnp.arange(b) % 5).astype(jnp.float32))
      s, smp = t.sample(s, jax.random.PRNGKey(i), batch_size=b)
      return (s, acc + jnp.sum(smp.data["x"]) + jnp.sum(smp.info.key)), None
    return jax.lax.scan(step, (s, jnp.int32(0)), jnp.arange(4) + i0)[0]

  txt = jax.jit(run, donate_argnums=0).lower(t.init(), 0).compile().as_text()
  sorts = [line.split(" sort(")[0] for line in txt.splitlines() if " sort(" in line]
  assert any(f"[{b}]" in line for line in sorts), sorts  # the B rows
  assert not any(f"[{cap}]" in line or f"[{cap}," in line for line in sorts), sorts
  assert hlo.text_counts(txt, cap)["conditional"] == 0


# The min-heap's 64-bit order keys (priority, touch stamp); the hypothesis test above
# covers every selector's keys (a stack's sequence here too cost 12 s of the CI's suite).
@pytest.mark.parametrize("name", ["min-heap-queue"])
def test_the_gpu_executor_runs_the_backend_oracles_sequences_alike(name, monkeypatch):
  """The ordered specs of tests/core/test_backends.py (which compares the CPU with a GPU
  where there is one) on the CPU, with ``first_eligible`` as the GPU lowers it
  (``sort_first``) and as the CPU does: every batch and state bit-identical."""
  from tests.core import test_backends as backends
  from tests.helpers import assert_bit_identical
  cpu = jax.devices("cpu")[0]
  backends.programs.cache_clear()  # traced anew below, with each executor
  want = backends.run_sequence(name, cpu, 0)
  backends.programs.cache_clear()
  monkeypatch.setattr(ordering, "first_eligible", ordering.sort_first)
  try:
    got = backends.run_sequence(name, cpu, 0)
  finally:
    backends.programs.cache_clear()
  assert len(got) == len(want)
  for i, ((op, g), (_, w)) in enumerate(zip(got, want)):
    assert_bit_identical(g, w, f"{name}, output {i} ({op})")
