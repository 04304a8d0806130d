"""Trajectory tables (issue 26): windows, boundaries, masks, wrap-around, the uniform draw.

Reference model: ``tests/core/trajectory/trajectory_model.py`` (every step kept, windows
recomputed from their definition).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst
from scipy import stats as sstats

import funcreplay as fr
from funcreplay.core.trajectory import rows
from tests.core.trajectory.trajectory_model import TrajectoryModel

STEP = {"x": jax.ShapeDtypeStruct((), jnp.int32), "y": jax.ShapeDtypeStruct((2,), jnp.float32)}
P_MIN = 1e-3  # chi-square: a correct sampler fails one fixed-seed test with probability 1e-3


@functools.lru_cache(maxsize=None)
def jitted(spec):
  t = fr.make_trajectory_table(spec)
  return t, jax.jit(t.add), jax.jit(t.sample, static_argnames=("batch_size", "replace"))


def steps_of(payload):
  payload = np.asarray(payload, np.int32)
  return {"x": jnp.asarray(payload),
          "y": jnp.asarray(np.stack([payload, -payload], -1).astype(np.float32))}


def check_against_model(spec, state, model, rng, batch_size, replace=False):
  t, _, sample = jitted(spec)
  want = model.windows()
  eligible = np.asarray(t.eligible(state))
  assert set(np.flatnonzero(eligible)) == set(want.values())
  assert int(t.count(state)) == len(want)
  by_id = {w: ea for ea, w in want.items()}
  state, b = sample(state, rng, batch_size=batch_size, replace=replace)
  valid = np.asarray(b.valid)
  n = len(want)
  assert valid.sum() == (min(batch_size, n) if not replace else (batch_size if n else 0))
  assert int(b.num_eligible) == n
  slots = np.asarray(b.info.slot)
  if not replace:
    assert len(set(slots[valid])) == valid.sum()
  for i in np.flatnonzero(valid):
    e, a = by_id[int(slots[i])]
    np.testing.assert_array_equal(np.asarray(b.data["x"][i]), model.data(e, a))
    np.testing.assert_array_equal(np.asarray(b.data["y"][i, :, 1]), -np.asarray(model.data(e, a)))
    assert int(b.info.key[i]) == model.key(e, a)
    assert int(b.info.version[i]) == model.version[e][a]
    assert b.info.probability[i] == pytest.approx(1.0 / n)
    model.times[(e, a)] = model.times.get((e, a), 0) + 1
  for i in np.flatnonzero(valid):
    e, a = by_id[int(slots[i])]
    assert int(b.info.times_sampled[i]) == model.times[(e, a)] or replace
  assert not np.asarray(b.data["x"])[~valid].any()
  assert (slots[~valid] == -1).all()
  return state


@settings(max_examples=10)
@given(num_envs=hst.integers(1, 3), period=hst.sampled_from([1, 2, 3]),
       length=hst.integers(1, 5), reps=hst.integers(1, 3), cross=hst.booleans(),
       ops=hst.lists(hst.tuples(hst.integers(1, 4), hst.integers(0, 2**16), hst.integers(0, 3)),
                     min_size=1, max_size=10),
       seed=hst.integers(0, 2**31 - 1))
def test_matches_reference_model(num_envs, period, length, reps, cross, ops, seed):
  cap = period * max(reps, -(-length // period))
  spec = fr.TrajectorySpec(num_envs, cap, length, period, STEP, cross_episodes=cross)
  t, add, _ = jitted(spec)
  model = TrajectoryModel(spec)
  state = t.init()
  rs = np.random.RandomState(seed % 2**32)
  counter = 1
  for i, (tt, bits_, version) in enumerate(ops):
    tt = min(tt, cap)
    payload = counter + np.arange(num_envs * tt).reshape(num_envs, tt)
    counter += num_envs * tt
    mask = np.array([(bits_ >> e) & 1 == 0 or e == i % num_envs for e in range(num_envs)])
    first = None if cross else rs.rand(num_envs, tt) < 0.3
    state = add(state, steps_of(payload), version=version, mask=jnp.asarray(mask),
                first=None if first is None else jnp.asarray(first))
    model.add(payload, version, mask, first)
    if i % 3 == 2 or i == len(ops) - 1:
      state = check_against_model(spec, state, model, jax.random.key(seed + i), 4,
                                  replace=bool(i % 2))


GRID = [(1, 1), (1, 5), (2, 2), (3, 4), (4, 8), (8, 3)]  # (period, length)


@pytest.mark.parametrize("num_envs,period,length,cross", [
    (3, p, ln, c) for p, ln in GRID for c in (True, False)] + [
    pytest.param(e, p, ln, c, marks=pytest.mark.slow)
    for e in (1, 5) for p, ln in GRID for c in (True, False)])
def test_increasing_payload_windows_are_consecutive(num_envs, period, length, cross):
  """flashbax PR #51's invariant: across many wraps, every sampled window is consecutive
  steps (payload = the env's step counter), starts at a multiple of period and was
  fully written before the sample (never spans the write head or overwritten steps)."""
  cap = 24
  spec = fr.TrajectorySpec(num_envs, cap, length, period, {"x": jnp.zeros((), jnp.int32)},
                           cross_episodes=cross)
  table = fr.make_trajectory_table(spec)
  n_rounds, t, b = 60, 5, 16  # 60 * 5 = 300 steps per env: 12 wraps

  def body(carry, key):
    state, count = carry
    k_mask, k_sample = jax.random.split(key)
    mask = jax.random.bernoulli(k_mask, 0.7, (num_envs,))
    payload = count[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    state = table.add(state, {"x": payload}, mask=mask)
    count = count + jnp.where(mask, t, 0)
    state, s = table.sample(state, k_sample, batch_size=b, replace=True)
    x = s.data["x"]
    env = jnp.maximum(s.info.slot, 0) // spec.windows_per_env
    consecutive = jnp.all(x[:, 1:] - x[:, :-1] == 1, axis=1)
    aligned = x[:, 0] % period == 0
    written = x[:, -1] < count[env]
    kept = x[:, 0] >= count[env] - cap
    ok = jnp.where(s.valid, consecutive & aligned & written & kept, True)
    return (state, count), (jnp.all(ok), jnp.sum(s.valid))

  run = jax.jit(lambda s, keys: jax.lax.scan(body, (s, jnp.zeros((num_envs,), jnp.int32)), keys))
  _, (ok, n_valid) = run(table.init(), jax.random.split(jax.random.key(length * 7 + period),
                                                         n_rounds))
  assert bool(jnp.all(ok))
  assert int(n_valid[-1]) == b  # the table filled: the check ran on real windows


@pytest.mark.parametrize("cross", [True, False])
def test_uniform_window_frequencies_chi_square(cross):
  spec = fr.TrajectorySpec(2, 16, 4, 2, {"x": jnp.zeros((), jnp.int32)}, cross_episodes=cross)
  table = fr.make_trajectory_table(spec)
  state = table.init()
  # Env 0: 21 steps (wrapped), env 1: 9 steps (a hole-free partial axis).
  state = table.add(state, {"x": jnp.zeros((2, 9), jnp.int32)})
  state = table.add(state, {"x": jnp.zeros((2, 12), jnp.int32)}, mask=jnp.array([True, False]))
  n = int(table.count(state))
  eligible = np.asarray(table.eligible(state))
  assert n == eligible.sum() == 6 + 3
  b = 4

  def draw(key):
    return table.sample(state, key, batch_size=b)[1].info.slot
  slots = np.asarray(jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(3), 4000)))
  assert (slots >= 0).all() and eligible[slots].all()
  assert all(len(set(r)) == b for r in slots[:200])  # without replacement
  counts = np.bincount(slots.reshape(-1), minlength=spec.num_windows)
  p = sstats.chisquare(counts[eligible]).pvalue
  assert p > P_MIN, f"uniform window chi-square p={p}"


def test_episode_starts_split_windows():
  spec = fr.TrajectorySpec(1, 16, 3, 1, {"x": jnp.zeros((), jnp.int32)})
  table = fr.make_trajectory_table(spec)
  state = table.init()
  first = jnp.zeros((1, 10), bool).at[0, 4].set(True)
  state = table.add(state, {"x": jnp.arange(10, dtype=jnp.int32)[None]}, first=first)
  # Windows [a, a+3) with a in 0..7, except those holding step 4 after their start: a = 2, 3.
  assert set(np.flatnonzero(np.asarray(table.eligible(state)))) == {0, 1, 4, 5, 6, 7}
  # The same without tracking: every window.
  spec2 = spec.replace(cross_episodes=True)
  t2 = fr.make_trajectory_table(spec2)
  s2 = t2.add(t2.init(), {"x": jnp.arange(10, dtype=jnp.int32)[None]})
  assert int(t2.count(s2)) == 8


def test_jit_scan_vmap():
  spec = fr.TrajectorySpec(4, 32, 8, 4, STEP)
  table = fr.make_trajectory_table(spec)

  def run(key):
    def body(state, k):
      state = table.add(state, steps_of(np.zeros((4, 2))))
      state, s = table.sample(state, k, batch_size=3)
      return state, jnp.sum(s.valid)
    return jax.lax.scan(body, table.init(), jax.random.split(key, 20))

  states, n = jax.jit(jax.vmap(run))(jax.random.split(jax.random.key(0), 3))
  assert states.head.shape == (3, 4) and states.data.shape == (3, 4, 32, 3)  # packed rows
  y = rows.unpack(spec, states.data, 3)["y"]
  assert y.shape == (3, 4, 32, 2) and y.dtype == jnp.float32
  assert n.shape == (3, 20) and int(n[0, -1]) == 3
  assert int(states.counters[0, 0, 1]) == 4 * 2 * 20  # steps counter, low word


def test_bad_input_is_named():
  spec = fr.TrajectorySpec(4, 16, 4, 2, STEP)
  table = fr.make_trajectory_table(spec)
  state = table.init()
  with pytest.raises(ValueError, match="axis 0 must be the env axis of size num_envs=4"):
    table.add(state, steps_of(np.zeros((3, 2))))
  with pytest.raises(ValueError, match=r"t=17 steps per env .* time_capacity=16"):
    table.add(state, steps_of(np.zeros((4, 17))))
  with pytest.raises(ValueError, match=r"step leaf \[.y.\]: expected shape"):
    table.add(state, {"x": jnp.zeros((4, 2), jnp.int32), "y": jnp.zeros((4, 2, 3), jnp.float32)})
  with pytest.raises(TypeError, match=r"step leaf \[.x.\]: expected dtype int32, got float32"):
    table.add(state, {"x": jnp.zeros((4, 2)), "y": jnp.zeros((4, 2, 2), jnp.float32)})
  with pytest.raises(ValueError, match=r"mask must be bool\[4\]"):
    table.add(state, steps_of(np.zeros((4, 2))), mask=jnp.ones((3,), bool))
  with pytest.raises(ValueError, match=r"first must be bool\[num_envs=4, t=2\]"):
    table.add(state, steps_of(np.zeros((4, 2))), first=jnp.ones((4, 3), bool))
  with pytest.raises(TypeError, match=r"add: version must be an integer"):  # was truncated
    table.add(state, steps_of(np.zeros((4, 2))), version=2.5)
  with pytest.raises(ValueError, match=r"add: version must fit int32"):
    table.add(state, steps_of(np.zeros((4, 2))), version=2**31)
  with pytest.raises(ValueError, match="sequence_length=17 exceeds time_capacity=16"):
    fr.TrajectorySpec(4, 16, 17, 1, STEP)
  with pytest.raises(ValueError, match="multiple of period=3"):
    fr.TrajectorySpec(4, 16, 4, 3, STEP)
  with pytest.raises(ValueError, match="num_envs must be an int >= 1"):
    fr.TrajectorySpec(0, 16, 4, 1, STEP)
  with pytest.raises(ValueError, match="cross_episodes=True"):
    t2 = fr.make_trajectory_table(spec.replace(cross_episodes=True))
    t2.add(t2.init(), steps_of(np.zeros((4, 2))), first=jnp.ones((4, 2), bool))
  with pytest.raises(ValueError, match="batch_size must be a static int >= 1"):
    table.sample(state, jax.random.key(0), batch_size=0)
  stale = fr.make_trajectory_table(spec.replace(max_staleness=2))
  with pytest.raises(ValueError, match="pass version="):
    stale.sample(stale.init(), jax.random.key(0), batch_size=2)
  with pytest.raises(ValueError, match="needs sampler=fr.Prioritized|sampler=fr.Prioritized"):
    table.update_priorities(state, jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.uint32),
                            jnp.ones((2,)))
  # The state is untouched by the refused calls (pure functions; nothing half-applied).
  assert int(table.count(state)) == 0
