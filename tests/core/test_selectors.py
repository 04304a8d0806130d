"""Selector semantics: prioritized distributions, key guards, float drift, orders."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from scipy import stats as sstats

import funcreplay as fr
from funcreplay.core import indexes
from tests.helpers import ITEM, counters_dict, items_from_ids, jitted, stored

# Every test here runs against both implementations (see conftest.py).
pytestmark = pytest.mark.usefixtures("both_implementations")

P_MIN = 1e-4  # chi-square p-value floor (fixed seeds)


def _prio_state(spec, priorities, versions=None):
  f = jitted(spec)
  n = len(priorities)
  versions = np.zeros(n, np.int32) if versions is None else np.asarray(versions, np.int32)
  return f["insert"](f["table"].init(), items_from_ids(np.arange(n)), version=versions,
                     priority=np.asarray(priorities, np.float32))


def _draws(spec, state, n, batch_size, replace, where=None, version=None, seed=0):
  table = fr.make_table(spec)

  @jax.jit
  def run(state, key):
    def body(st, k):
      _, b = table.sample(st, k, batch_size=batch_size, replace=replace, where=where,
                          version=version)
      return st, (b.info.slot, b.info.probability, b.valid)
    return lax.scan(body, state, jax.random.split(key, n))[1]

  return [np.asarray(x) for x in run(state, jax.random.PRNGKey(seed))]


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0])
def test_prioritized_matches_p_alpha_over_eligible(alpha):
  prios = np.array([0.5, 1.0, 2.0, 4.0, 0.0, 3.0, 1.5, 8.0], np.float32)
  versions = [5, 5, 5, 5, 5, 5, 0, 5]  # slot 6 stale at version 5 (max_staleness 2)
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized(alpha), max_staleness=2)
  state = _prio_state(spec, prios, versions)
  where = jnp.arange(8) != 7  # slot 7 excluded
  slots, prob, valid = _draws(spec, state, 3000, 4, replace=True, where=where, version=5)
  assert valid.all()
  eligible = np.array([0, 1, 2, 3, 5])  # slot 4 has priority 0
  w = prios[eligible].astype(np.float64) ** alpha
  expected = w / w.sum()
  counts = np.bincount(slots.ravel(), minlength=8)
  assert counts[[4, 6, 7]].sum() == 0, "ineligible or zero-priority slot sampled"
  p = sstats.chisquare(counts[eligible], expected * counts.sum()).pvalue
  assert p > P_MIN, f"alpha={alpha}: p={p}"
  # Reported probability is the exact single-draw probability.
  for s, e in zip(eligible, expected):
    np.testing.assert_allclose(prob[slots == s], e, rtol=1e-5)


def test_without_replacement_is_exact_successive_sampling():
  prios = np.array([1.0, 2.0, 3.0, 6.0], np.float32)
  spec = fr.TableSpec(4, ITEM, sampler=fr.Prioritized(1.0))
  state = _prio_state(spec, prios)
  slots, _, valid = _draws(spec, state, 6000, 2, replace=False)
  assert valid.all()
  w = prios.astype(np.float64) / prios.sum()
  pairs = list(itertools.permutations(range(4), 2))
  expected = np.array([w[i] * w[j] / (1 - w[i]) for i, j in pairs])
  index = {pair: k for k, pair in enumerate(pairs)}
  counts = np.zeros(len(pairs))
  for a, b in slots:
    counts[index[(a, b)]] += 1
  p = sstats.chisquare(counts, expected * counts.sum()).pvalue
  assert p > P_MIN, f"successive sampling p={p}"


def test_heavy_item_still_gives_distinct_batch():
  """One item holding ~all the mass: the rounds must still fill the batch."""
  prios = np.array([1e6] + [1.0] * 15, np.float32)
  spec = fr.TableSpec(16, ITEM, sampler=fr.Prioritized(1.0))
  state = _prio_state(spec, prios)
  slots, _, valid = _draws(spec, state, 50, 8, replace=False)
  assert valid.all()
  for row in slots:
    assert len(set(row.tolist())) == 8 and 0 in row


def test_importance_weights():
  prios = np.array([1.0, 3.0], np.float32)
  spec = fr.TableSpec(4, ITEM, sampler=fr.Prioritized(1.0))
  state = _prio_state(spec, prios)
  _, b = jitted(spec)["sample"](state, jax.random.PRNGKey(0), batch_size=2)
  w = np.asarray(fr.importance_weights(b, beta=1.0))
  p = np.asarray(b.info.probability)
  expect = (2 * p) ** -1.0
  np.testing.assert_allclose(w, expect / expect.max(), rtol=1e-6)


def test_update_priorities_is_key_guarded():
  spec = fr.TableSpec(4, ITEM, sampler=fr.Prioritized(1.0))
  f = jitted(spec)
  state = _prio_state(spec, [1.0, 1.0, 1.0, 1.0])
  state, b = f["sample"](state, jax.random.PRNGKey(0), batch_size=2)
  slots, keys = b.info.slot, b.info.key
  state = f["insert"](state, items_from_ids(np.arange(10, 14)), version=0,
                      priority=np.full(4, 2.0, np.float32))  # overwrites every slot
  before = np.asarray(state.priority)
  state = f["update"](state, slots, keys, jnp.array([7.0, 7.0]))
  np.testing.assert_array_equal(np.asarray(state.priority), before)


def test_duplicate_slots_last_write_wins_and_invalid_clamped():
  spec = fr.TableSpec(4, ITEM, sampler=fr.Prioritized(1.0))
  f = jitted(spec)
  state = _prio_state(spec, [1.0, 1.0, 1.0, 1.0])
  k = np.asarray(state.key)
  state = f["update"](state, np.array([1, 1, 2, 3], np.int32), k[[1, 1, 2, 3]],
                      np.array([5.0, 9.0, np.nan, -1.0], np.float32))
  np.testing.assert_array_equal(np.asarray(state.priority), [1.0, 9.0, 0.0, 0.0])
  assert counters_dict(state)["invalid_priorities"] == 2
  np.testing.assert_allclose(float(state.weight_tree[1]), 10.0)


def test_no_float_drift_after_long_update_sequences():
  """flashbax #52: zero-priority items sampled after many float32 updates."""
  cap = 1000
  spec = fr.TableSpec(cap, ITEM, sampler=fr.Prioritized(0.6))
  f = jitted(spec)
  table = fr.make_table(spec)
  state = f["insert"](table.init(), items_from_ids(np.arange(cap)), version=0)
  keys = state.key

  @jax.jit
  def churn(state, key):
    def body(st, k):
      k1, k2, k3 = jax.random.split(k, 3)
      slots = jax.random.randint(k1, (64,), 0, cap)
      p = jax.random.uniform(k2, (64,), maxval=100.0) ** 3
      p = jnp.where(jax.random.uniform(k3, (64,)) < 0.3, 0.0, p)
      return table.update_priorities(st, slots, keys[slots], p), None
    return lax.scan(body, state, jax.random.split(key, 3000))[0]

  state = churn(state, jax.random.PRNGKey(0))
  prio = np.asarray(state.priority, np.float64)
  exact = np.sum(np.where(prio > 0, prio ** 0.6, 0.0))
  np.testing.assert_allclose(float(state.weight_tree[1]), exact, rtol=1e-5)
  rebuilt = indexes.rebuild(spec, state)
  np.testing.assert_array_equal(np.asarray(state.weight_tree), np.asarray(rebuilt.weight_tree))
  slots, _, valid = _draws(spec, state, 200, 64, replace=True)
  assert (prio[slots[valid]] > 0).all(), "a zero-priority item was sampled"


@pytest.mark.parametrize("sampler,expected", [
    (fr.Fifo(), [0, 1, 2, 3]),
    (fr.Lifo(), [5, 4, 3, 2]),
    (fr.MinHeap(), [4, 1, 3, 0]),   # priorities 2,1,3,1(older 1 first),0.5 ...
    (fr.MaxHeap(), [5, 2, 0, 1]),
])
def test_deterministic_samplers(sampler, expected):
  prios = [2.0, 1.0, 3.0, 1.0, 0.5, 4.0]
  spec = fr.TableSpec(8, ITEM, sampler=sampler)
  if isinstance(sampler, fr.MinHeap):
    expected = [4, 1, 3, 0]  # 0.5, then the two 1.0s oldest first, then 2.0
  if isinstance(sampler, fr.MaxHeap):
    expected = [5, 2, 0, 1]  # 4, 3, 2, then the older of the two 1.0s
  state = _prio_state(spec, prios)
  _, b = jitted(spec)["sample"](state, jax.random.PRNGKey(0), batch_size=4)
  assert np.asarray(b.data["x"]).tolist() == expected


def test_queue_and_stack_helpers():
  q = fr.queue(4, ITEM)
  f = jitted(q)
  state = f["insert"](f["table"].init(), items_from_ids([1, 2, 3]), version=0)
  out = []
  for i in range(3):
    state, b = f["sample"](state, jax.random.PRNGKey(i), batch_size=1)
    out.append(int(b.data["x"][0]))
  assert out == [1, 2, 3] and int(state.size) == 0
  s = fr.stack(4, ITEM)
  f = jitted(s)
  state = f["insert"](f["table"].init(), items_from_ids([1, 2, 3]), version=0)
  state, b = f["sample"](state, jax.random.PRNGKey(0), batch_size=2)
  assert np.asarray(b.data["x"]).tolist() == [3, 2] and int(state.size) == 1


@pytest.mark.parametrize("remover", [fr.Lifo(), fr.MinHeap(), fr.MaxHeap(), fr.Uniform()])
def test_removers_when_full(remover):
  spec = fr.TableSpec(4, ITEM, remover=remover)
  f = jitted(spec)
  state = f["table"].init()
  state = f["insert"](state, items_from_ids([0, 1, 2, 3]), version=0,
                      priority=np.array([3.0, 1.0, 4.0, 2.0], np.float32),
                      rng=jax.random.PRNGKey(0))
  state = f["insert"](state, items_from_ids([10]), version=0,
                      priority=np.array([2.5], np.float32), rng=jax.random.PRNGKey(1))
  live = sorted(np.asarray(stored(state)["x"])[np.asarray(state.occupied)].tolist())
  # The incoming item is a candidate too (Reverb inserts, then evicts): Lifo evicts it.
  gone = {fr.Lifo: 10, fr.MinHeap: 1, fr.MaxHeap: 2}.get(type(remover))
  if gone is not None:
    assert live == sorted({0, 1, 2, 3, 10} - {gone})
  else:
    assert len(live) == 4 and set(live) < {0, 1, 2, 3, 10}
  assert counters_dict(state)["evicted_capacity"] == 1


def test_uniform_remover_requires_rng():
  spec = fr.TableSpec(4, ITEM, remover=fr.Uniform())
  t = fr.make_table(spec)
  with pytest.raises(ValueError, match="rng="):
    t.insert(t.init(), items_from_ids([1]))


def test_combination_prioritized_reuse_staleness_heap_remover():
  """DI-engine broke on such combinations: check conservation and eligibility."""
  spec = fr.TableSpec(16, ITEM, sampler=fr.Prioritized(0.8), remover=fr.MinHeap(),
                      max_times_sampled=2, max_staleness=3)
  table = fr.make_table(spec)

  @jax.jit
  def run(state, key):
    def step(carry, t):
      st, k = carry
      k, k1, k2 = jax.random.split(k, 3)
      ids = t * 6 + jnp.arange(6, dtype=jnp.int32)
      items = {"x": ids, "y": jnp.stack([ids, -ids], -1).astype(jnp.float32)}
      st = table.insert(st, items, version=t, priority=jax.random.uniform(k2, (6,)) + 0.1)
      st, b = table.sample(st, k1, batch_size=5, version=t)
      ok = jnp.all(jnp.where(b.valid, t - b.info.version <= 3, True))
      st = table.update_priorities(st, b.info.slot, b.info.key, b.info.priority * 2)
      st = lax.cond(t % 4 == 3, lambda s: table.evict_stale(s, t), lambda s: s, st)
      return (st, k), ok
    return lax.scan(step, (state, key), jnp.arange(30, dtype=jnp.int32))

  (state, _), ok = run(table.init(), jax.random.PRNGKey(3))
  assert bool(ok.all())
  c = counters_dict(state)
  removed = c["evicted_capacity"] + c["evicted_reuse"] + c["evicted_stale"] + c["deletes"]
  assert c["inserts"] == int(state.size) + removed
  assert c["evicted_reuse"] > 0 and c["evicted_stale"] > 0 and c["evicted_capacity"] > 0
  rebuilt = indexes.rebuild(spec, state)
  np.testing.assert_allclose(np.asarray(state.weight_tree), np.asarray(rebuilt.weight_tree),
                             rtol=1e-6)
  assert int(state.remover_tree[1]) == int(rebuilt.remover_tree[1])


def test_stratified_option_is_proportional_and_unsorted():
  prios = np.array([1.0, 2.0, 3.0, 4.0, 0.0, 6.0], np.float32)
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized(1.0))
  state = _prio_state(spec, prios)
  table = fr.make_table(spec)

  @jax.jit
  def run(state, key):
    def body(st, k):
      _, b = table.sample(st, k, batch_size=4, replace=True, stratified=True)
      return st, b.info.slot
    return lax.scan(body, state, jax.random.split(key, 2000))[1]

  slots = np.asarray(run(state, jax.random.PRNGKey(0)))
  counts = np.bincount(slots.ravel(), minlength=8)
  assert counts[4] == 0
  elig = [0, 1, 2, 3, 5]
  expected = prios[elig].astype(np.float64) / prios.sum()
  assert sstats.chisquare(counts[elig], expected * counts.sum()).pvalue > P_MIN
  assert not all((np.diff(r) >= 0).all() for r in slots), "rows are always slot-sorted"
  with pytest.raises(ValueError, match="stratified"):
    table.sample(state, jax.random.PRNGKey(0), batch_size=4, stratified=True)


@pytest.mark.parametrize("capacity", [8, 300])
def test_stratified_draws_one_item_from_each_stratum(capacity):
  """Two equal weights, two strata: every batch holds both items. From 256 leaves a
  prioritized descent redraws its target halfway down (``weight_descent``); a stratified
  one must not (its stratum would pick only a node: half the batches held one item
  twice, found by a review)."""
  spec = fr.TableSpec(capacity, ITEM, sampler=fr.Prioritized(1.0))
  table = fr.make_table(spec)
  state = table.insert(table.init(), items_from_ids([0, 1]), priority=jnp.ones(2, jnp.float32))
  slots = jax.jit(jax.vmap(lambda k: table.sample(state, k, batch_size=2, replace=True,
                                                  stratified=True)[1].info.slot))(
      jax.random.split(jax.random.PRNGKey(0), 500))
  assert np.all(np.sort(np.asarray(slots), axis=1) == [0, 1])
