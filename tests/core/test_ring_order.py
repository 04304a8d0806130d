"""Fifo / Lifo sampling from a ring (``sampling.ring_order``): the order read off the ring
is the general program's sort by age, slot for slot, over random histories of inserts
(masked rows too), deletes and samples that use items up; its lean sample leaves the
general program's state and batch for those slots. That a queue's sample then insert in
a scan sorts nothing and copies no column, with and without holes, is checked in
tests/core/test_queue_ring.py."""

from __future__ import annotations

import functools

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

import funcreplay as fr
from funcreplay.core import ordering, trees
from funcreplay.core.sampling import ring_order
from funcreplay.core.sampling.finish import finish as general_finish

ITEM = {"x": np.zeros((), np.int32)}


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.data())
def test_count_below_is_the_prefix_sum(capacity, data):
  p = 1 << max(0, (capacity - 1).bit_length())
  leaves = np.zeros(p, np.int32)
  leaves[:capacity] = data.draw(st.lists(st.integers(0, 1), min_size=capacity,
                                         max_size=capacity))
  tree = trees.build_sum(jnp.asarray(leaves))
  for pos in sorted({0, capacity - 1, capacity, p, data.draw(st.integers(0, p))}):
    assert int(trees.count_below(tree, jnp.int32(pos))) == int(leaves[:pos].sum()), pos


def _history():
  return st.lists(st.one_of(
      st.tuples(st.just("insert"), st.lists(st.booleans(), min_size=1, max_size=5)),
      st.tuples(st.just("delete"), st.lists(st.integers(0, 10), min_size=1, max_size=3)),
      st.tuples(st.just("sample"), st.integers(1, 6))), min_size=1, max_size=25)


@functools.lru_cache(maxsize=None)
def _programs(lifo: bool, capacity: int, max_times: int):
  """The jitted programs of one table, compiled once for all of hypothesis' examples."""
  spec = fr.TableSpec(capacity, ITEM, sampler=fr.Lifo() if lifo else fr.Fifo(),
                      remover=fr.Fifo(), max_times_sampled=max_times)
  t = fr.make_table(spec, native=False)
  return dict(
      spec=spec, init=t.init,
      insert=jax.jit(lambda s, x, m: t.insert(s, {"x": x}, mask=m)),
      delete=jax.jit(lambda s, slots: t.delete(s, slots, s.key[slots])),
      sample=jax.jit(lambda s, k, m: t.sample(s, k, batch_size=capacity, where=m)[0]),
      sample_all=jax.jit(lambda s, k: t.sample(s, k, batch_size=3)[0]),
      pick=jax.jit(lambda s: ring_order.pick(spec, s, capacity)),
      lean=jax.jit(lambda s: ring_order.sample(spec, s, None, batch_size=3)),
      general=jax.jit(lambda s: general_finish(spec, s, ring_order.pick(spec, s, 3)[0],
                                               jnp.ones(3, jnp.float32), s.size, None, False)),
      by_sort=jax.jit(lambda s: ordering.sorted_eligible(spec.sampler, s, s.occupied)))


@pytest.mark.parametrize("lifo", [False, True], ids=["fifo", "lifo"])
@pytest.mark.parametrize("capacity,max_times", [(11, 1), (11, 0), (8, 2)])
@settings(max_examples=30, deadline=None)
@given(ops=_history())
def test_the_ring_order_is_the_sorted_order(lifo, capacity, max_times, ops):
  f = _programs(lifo, capacity, max_times)
  assert ring_order.applies(f["spec"])
  assert not ring_order.applies(f["spec"], where=jnp.ones(capacity, bool))
  s, n = f["init"](), 0
  for op in ops:
    if op[0] == "insert":
      mask = np.zeros(5, bool)
      mask[:len(op[1])] = op[1]
      s = f["insert"](s, jnp.arange(n, n + 5, dtype=jnp.int32), jnp.asarray(mask))
      n += 5
    elif op[0] == "delete":
      s = f["delete"](s, jnp.asarray(op[1] + [0] * (3 - len(op[1])), jnp.int32) % capacity)
    elif op[1] == 1:  # an unmasked sample: this program's order (uses up the first rows)
      (want, want_smp), (got, smp) = f["general"](s), f["lean"](s)
      for (path, a), b in zip(jax.tree_util.tree_flatten_with_path((got, smp))[0],
                              jax.tree_util.tree_leaves((want, want_smp))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                      err_msg=jax.tree_util.keystr(path))
      s = f["sample_all"](s, jax.random.PRNGKey(n))
      for a, b in zip(jax.tree_util.tree_leaves(s), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
      # A masked sample (the sort) uses up (max_times) the rows it returns: holes anywhere.
      where = np.arange(capacity) % op[1] == 0
      s = f["sample"](s, jax.random.PRNGKey(n), jnp.asarray(where))
    got, num = f["pick"](s)
    order, ok = f["by_sort"](s)
    want = np.where(np.asarray(ok), np.asarray(order), -1)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert int(num) == int(np.sum(ok))
