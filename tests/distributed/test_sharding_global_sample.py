"""Sharded table (funcreplay.distributed): global sampling across shards (chi-square and
exact inclusion probabilities, with and without replacement), reuse and staleness,
``max_per_shard``.

The tests here need 8 devices (the ``mesh`` fixture of conftest.py skips them otherwise);
in a process with fewer, ``test_suite_on_8_cpu_devices`` (test_sharding_processes.py)
re-runs them in a subprocess with 8 fake CPU devices.
"""

import itertools

import jax
import numpy as np
import pytest
from scipy import stats as sps

import funcreplay as fr
from funcreplay import distributed as frs
from tests.distributed.common import (
  ITEM,
  PRIOS,
  SAMPLE_ARGS,
  N,
  count_of,
  draw_counts,
  stats_of,
  tagged_items,
  unequal_state,
)


def _inclusion_probabilities(w, b):
  """Exact P(item in batch) of successive sampling of ``b`` items with weights ``w``."""
  w = np.asarray(w, np.float64)
  inc = np.zeros(len(w))
  for seq in itertools.permutations(range(len(w)), b):
    p, left = 1.0, w.sum()
    for i in seq:
      p *= w[i] / left
      left -= w[i]
    inc[list(seq)] += p
  return inc


def test_global_with_replacement_chi_square(unequal):
  """Rows of replace=True global batches are i.i.d. draws with P(i) = w_i / W over all shards."""
  t, st, pr, mask = unequal
  trials = 1000
  counts, nvalid, first = draw_counts(t, st, trials, 4, True, pr.shape[1])
  w = pr.reshape(-1)
  obs = np.asarray(counts)
  assert np.all(np.asarray(nvalid) == 4)
  assert obs[w == 0].sum() == 0  # the empty shard's slots and zero weights never come out
  _, p = sps.chisquare(obs[w > 0], obs.sum() * w[w > 0] / w.sum())
  assert p > 1e-3, (obs, 4 * trials * w / w.sum())
  # info.probability is the global single-draw probability, num_eligible global.
  v = np.asarray(first.valid)
  s_idx = np.nonzero(v)[0]
  np.testing.assert_allclose(np.asarray(first.info.probability)[v],
                             pr[s_idx, np.asarray(first.info.slot)[v]] / w.sum(), rtol=1e-5)
  assert np.all(np.asarray(first.num_eligible) == mask.sum())


def test_global_without_replacement_exact_inclusion(unequal):
  """3-item batches without replacement: inclusion counts vs exact successive sampling."""
  t, st, pr, mask = unequal
  trials = 2000
  counts, nvalid, first = draw_counts(t, st, trials, 3, False, pr.shape[1])
  assert np.all(np.asarray(nvalid) == 3)
  obs = np.asarray(counts)[mask.reshape(-1)]
  expected = trials * _inclusion_probabilities(pr[mask], 3)
  # Per-item binomial counts (each batch holds 3 distinct items): z-scores
  # and a chi-square over items. Not w/W-proportional: the largest weight is
  # included in at most every batch.
  _, p = sps.chisquare(obs, expected * obs.sum() / expected.sum())
  assert p > 1e-3, (obs, expected)
  z = (obs - expected) / np.sqrt(expected * (1 - expected / trials))
  assert np.max(np.abs(z)) < 4.5, (obs, expected)
  # Rows never repeat an item within a batch.
  ids = np.asarray(first.info.slot) + 100 * np.arange(N)[:, None]
  ids = ids[np.asarray(first.valid)]
  assert len(set(ids.tolist())) == len(ids) == 3


def test_global_sample_draws_every_row_of_full_small_shards(mesh):
  """Shards of 2 slots, all full, and a batch of 3 (so each shard draws M = 2 rows,
  every item it has): the batch holds 3 rows with the exact inclusion probabilities of
  successive sampling over all 8 items. A shard that drew all its items cut every
  shard's rows at its last arrival, and batches came out short (found by a review)."""
  prios = [[1.0, 2.0], [3.0, 0.5], [4.0, 1.0], [2.0, 6.0]]
  t = frs.make_sharded_table(fr.TableSpec(2 * N, ITEM, sampler=fr.Prioritized(1.0)), mesh)
  st, pr, mask = unequal_state(t, prios)
  trials = 2000
  counts, nvalid, first = draw_counts(t, st, trials, 3, False, 2)
  assert np.all(np.asarray(nvalid) == 3)
  obs = np.asarray(counts)
  expected = trials * _inclusion_probabilities(pr.reshape(-1).astype(np.float64), 3)
  _, p = sps.chisquare(obs, expected * obs.sum() / expected.sum())
  assert p > 1e-3, (obs, expected)
  u = frs.make_sharded_table(fr.TableSpec(2 * N, ITEM), mesh)  # uniform, batches up to C
  ust = jax.jit(u.insert)(jax.jit(u.init)(), tagged_items(N, 2, 0))
  sg = jax.jit(u.sample_global, static_argnames=SAMPLE_ARGS)
  for b in (3, 5, 8):
    _, out = sg(ust, jax.random.PRNGKey(b), batch_size=b)
    tags = np.asarray(out.data["tag"])[np.asarray(out.valid)]
    assert len(tags) == b and len(set(tags.tolist())) == b


@pytest.mark.slow
def test_global_uniform_inclusion_slow(mesh):
  t = frs.make_sharded_table(fr.TableSpec(4 * 8, ITEM), mesh)  # uniform
  st, pr, mask = unequal_state(t, PRIOS)
  counts, nvalid, first = draw_counts(t, st, 3000, 4, False, pr.shape[1])
  obs = np.asarray(counts)[mask.reshape(-1)]
  assert np.all(np.asarray(nvalid) == 4) and obs.sum() == 12000
  _, p = sps.chisquare(obs)  # inclusion probability B/N for every item
  assert p > 1e-3, obs
  assert np.allclose(np.asarray(first.info.probability)[np.asarray(first.valid)], 1 / mask.sum())


def test_global_sample_reuse_and_staleness(mesh):
  """Only kept rows count: times_sampled, reuse eviction, counters; stale items never drawn."""
  spec = fr.TableSpec(4 * 8, ITEM, max_times_sampled=1, max_staleness=1)
  t = frs.make_sharded_table(spec, mesh)
  st = jax.jit(t.init)()
  ins = jax.jit(t.insert)
  st = ins(st, tagged_items(N, 3, 0), version=0)     # stale at version 2
  st = ins(st, tagged_items(N, 2, 100), version=2)   # 8 fresh items
  sg = jax.jit(t.sample_global, static_argnames=SAMPLE_ARGS)
  st, b1 = sg(st, jax.random.PRNGKey(0), batch_size=5, version=2)
  assert int(b1.valid.sum()) == 5
  assert np.all(np.asarray(b1.data["tag"])[np.asarray(b1.valid)] >= 100)
  s = stats_of(t, st)
  assert s["samples"] == 5 and s["evicted_reuse"] == 5 and s["size"] == 20 - 5
  # Unkept draws were not counted: no live item has been sampled.
  assert int(st.times_sampled[st.occupied].sum()) == 0
  st, b2 = sg(st, jax.random.PRNGKey(1), batch_size=5, version=2)
  assert int(b2.valid.sum()) == 3             # only 3 fresh items left
  got = set(np.asarray(b1.data["tag"])[np.asarray(b1.valid)]) | set(
      np.asarray(b2.data["tag"])[np.asarray(b2.valid)])
  assert got == set(range(100, 108))
  assert count_of(t, st, version=2) == 0 and stats_of(t, st)["samples"] == 8


@pytest.mark.slow
def test_max_per_shard_gives_exact_prefix(mesh):
  spec = fr.TableSpec(4 * 8, ITEM)
  t = frs.make_sharded_table(spec, mesh)
  st = jax.jit(t.insert)(jax.jit(t.init)(), tagged_items(N, 8, 0))
  sg = jax.jit(t.sample_global, static_argnames=SAMPLE_ARGS)
  _, b = sg(st, jax.random.PRNGKey(2), batch_size=8, max_per_shard=2)
  assert b.valid.shape == (N, 2)
  nv = int(b.valid.sum())
  assert 2 <= nv <= 8  # at least one shard's M rows arrive before the cutoff
  _, b = sg(st, jax.random.PRNGKey(2), batch_size=8)
  assert int(b.valid.sum()) == 8
