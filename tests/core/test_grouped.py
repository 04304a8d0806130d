"""``funcreplay.core.ops.grouped``'s O(C) pieces against Python references: the radix
select of each group's first items (``first_by_group``), ties, negative / unsigned /
float keys and ``-0.0`` included, and the group ids by lookup (vocabulary codes) or by
binary search (any int32 values), repeated and out-of-range values included."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import funcreplay as fr
from funcreplay.core.ops import grouped

C, K = 48, 4
# Key kinds: (dtype, how to draw C values). Narrow ranges force ties on every digit.
KINDS = {
    "int32 narrow": (np.int32, lambda r: r.integers(-3, 3, C)),
    "int32 wide": (np.int32, lambda r: r.integers(-2**31, 2**31, C)),
    "uint32 wide": (np.uint32, lambda r: r.integers(0, 2**32, C)),
    "uint32 high": (np.uint32, lambda r: 2**32 - 1 - r.integers(0, 600, C)),
    # (no denormals: XLA:CPU flushes them to zero, so they tie with 0.0 there)
    "float32": (np.float32, lambda r: r.choice(
        np.float32([-np.inf, -2.5, -1e-30, -0.0, 0.0, 1e-30, 0.75, 3e38, np.inf]), C)),
    "float32 random": (np.float32, lambda r: r.standard_normal(C) * 1e3),
}
SMALL_KK = 12
_PROGRAMS = {}


def program(n_keys, kk, executor="first_by_group"):
  """A jitted executor of the grouped selection: the radix select (``first_by_group``, the
  CPU's beside the top-k stages) or the one sort (``sort_by_group``, a GPU's)."""
  fn = getattr(grouped, executor)
  if (n_keys, kk, executor) not in _PROGRAMS:
    _PROGRAMS[(n_keys, kk, executor)] = jax.jit(lambda gid, keys, take: fn(gid, keys, take, kk))
  return _PROGRAMS[(n_keys, kk, executor)]


@pytest.mark.parametrize("executor", ["first_by_group", "sort_by_group"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=2),
       st.integers(0, 2**32 - 1), st.booleans())
def test_first_by_group_matches_a_sort(executor, kinds, seed, small_kk):
  rng = np.random.default_rng(seed)
  gid = rng.integers(0, K + 1, C).astype(np.int32)       # K: in no group
  keys = [KINDS[k][1](rng).astype(KINDS[k][0]) for k in kinds]
  sizes = np.bincount(gid, minlength=K + 1)[:K]
  take = np.array([rng.integers(0, s + 1) for s in sizes], np.int32)
  kk = C
  if small_kk:  # fewer positions than slots (still enough for the rows)
    kk = SMALL_KK
    while take.sum() > kk:
      take[np.argmax(take)] -= 1
  ordered, start = program(len(keys), kk, executor)(jnp.asarray(gid), tuple(map(jnp.asarray, keys)),
                                          jnp.asarray(take))
  ordered, start = np.asarray(ordered), np.asarray(start)
  assert ordered.shape == (kk,)
  # Python's float order ties -0.0 with 0.0 as the radix select does (ties by slot).
  py = [[float(v) if k.dtype.kind == "f" else int(v) for v in k] for k in keys]
  for g in range(K):
    members = sorted((s for s in range(C) if gid[s] == g),
                     key=lambda s: (*(k[s] for k in py), s))
    got = ordered[start[g]:start[g] + take[g]].tolist()
    assert got == members[:take[g]], (g, kinds)
  assert (ordered[int(take.sum()):] == C).all()  # the rest: no slot


def _state(col):
  """What ``group_ids`` reads of a ``TableState``: ``occupied`` and ``metadata``."""
  return types.SimpleNamespace(occupied=jnp.ones(col.shape, bool),
                               metadata={"task": jnp.asarray(col, jnp.int32)})


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 2 * grouped.COMPARE_MAX_GROUPS), st.booleans())
def test_group_ids_by_lookup_and_by_search_match_the_first_equal_value(seed, k, codes):
  rng = np.random.default_rng(seed)
  v = 6  # vocabulary size
  if codes:
    values = rng.integers(0, v, k)  # repeats: the padding of a request repeats a value
    col = rng.integers(-1, v + 1, C)  # codes outside [0, v) match nothing
  else:
    values = rng.choice(np.int32([-2**31, -7, 0, 5, 2**31 - 1]), k)
    col = rng.choice(np.int32([-2**31, -7, -1, 0, 5, 6, 2**31 - 1]), C)
  state = _state(col)
  ref = np.array([next((i for i, x in enumerate(values) if x == c), k) for c in col])
  by_search = grouped.group_ids(state, "task", jnp.asarray(values, jnp.int32))
  np.testing.assert_array_equal(np.asarray(by_search), ref)
  if codes:
    by_lookup = grouped.group_ids(state, "task", jnp.asarray(values, jnp.int32), num_codes=v)
    np.testing.assert_array_equal(np.asarray(by_lookup), ref)


SELECT_K = 2 * grouped.TOPK_MAX_GROUPS  # past the top-k stages: the radix select
_SPEC = fr.TableSpec(40, {"x": jax.ShapeDtypeStruct((), jnp.int32)}, sampler=fr.StalestFirst(),
                     metadata=("task",))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32 - 1), st.integers(1, 40))
def test_select_by_many_groups_takes_each_groups_stalest(seed, n):
  rng = np.random.default_rng(seed)
  if "select" not in _PROGRAMS:
    pure = fr.make_table(_SPEC)
    _PROGRAMS["select"] = (pure.init(), jax.jit(pure.insert), jax.jit(
        lambda state, counts: grouped.select_by(_SPEC, state, "task",
                                                jnp.arange(SELECT_K, dtype=jnp.int32) - 1,
                                                counts, batch_size=64)))
  empty, insert, select = _PROGRAMS["select"]
  state = insert(empty, {"x": jnp.zeros(40, jnp.int32)}, mask=jnp.arange(40) < n,
                 version=jnp.asarray(rng.integers(-3, 3, 40), jnp.int32),
                 metadata={"task": jnp.asarray(rng.integers(-1, SELECT_K, 40), jnp.int32)})
  counts = rng.integers(0, 6, SELECT_K).astype(np.int32)
  got, grp, avail = map(np.asarray, select(state, jnp.asarray(counts)))
  task, ver, occ = (np.asarray(a) for a in (state.metadata["task"], state.version,
                                             state.occupied))
  key = np.asarray(state.key)
  for g in range(SELECT_K):
    members = sorted((s for s in range(40) if occ[s] and task[s] == g - 1),
                     key=lambda s: (ver[s], key[s]))  # stalest, then oldest
    assert int(avail[g]) == len(members)
    assert [int(s) for s, q in zip(got, grp) if q == g and s >= 0] == members[:counts[g]]


def _lowered_for_cuda(*args, default=None, **platforms):
  """``lax.platform_dependent`` as a CUDA lowering picks (its ``cuda`` branch)."""
  return platforms.get("cuda", default)(*args)


@pytest.mark.parametrize("sampler", [fr.StalestFirst(), fr.Uniform(), fr.Prioritized(0.6)],
                         ids=["stalest", "uniform", "prioritized"])
@pytest.mark.parametrize("k", [grouped.TOPK_MAX_GROUPS, SELECT_K], ids=["top_k", "radix"])
def test_select_by_as_a_gpu_lowers_it_returns_the_cpus_rows(sampler, k, monkeypatch):
  """``select_by`` with the GPU's executor (one sort, ``sort_by_group``) against the
  CPU's (the top-k stages up to ``TOPK_MAX_GROUPS`` groups, the radix select beyond),
  on tables with ties, empty groups and more rows asked for than a group holds."""
  spec = _SPEC.replace(sampler=sampler)
  pure = fr.make_table(spec)

  def select(state, counts, key):
    return grouped.select_by(spec, state, "task", jnp.arange(k, dtype=jnp.int32) - 1, counts,
                             batch_size=64, rng=None if spec.sampler == fr.StalestFirst() else key)

  rng = np.random.default_rng(7)
  for n in (5, 40):
    state = jax.jit(pure.insert)(
        pure.init(), {"x": jnp.zeros(40, jnp.int32)}, mask=jnp.arange(40) < n,
        version=jnp.asarray(rng.integers(-3, 3, 40), jnp.int32),
        priority=jnp.asarray(rng.choice([0.0, 0.5, 2.0, 3e38], 40), jnp.float32),
        metadata={"task": jnp.asarray(rng.integers(-1, k, 40), jnp.int32)})
    args = (state, jnp.asarray(rng.integers(0, 6, k), jnp.int32), jax.random.PRNGKey(n))
    want = jax.jit(select)(*args)
    with monkeypatch.context() as m:
      m.setattr(jax.lax, "platform_dependent", _lowered_for_cuda)
      got = jax.jit(lambda *a: select(*a))(*args)  # a new function: traced anew
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
