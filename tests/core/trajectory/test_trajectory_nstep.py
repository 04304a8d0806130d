"""n-step helpers (``fr.n_step_returns`` / ``fr.n_step_target``) and the trajectory DQN demo."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

import funcreplay as fr

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))))  # the repository root


def reference(rewards, discounts, n):
  b, ln = rewards.shape
  ret = np.zeros((b, ln - n))
  disc = np.ones((b, ln - n))
  for i in range(b):
    for t in range(ln - n):
      g, d = 0.0, 1.0
      for k in range(n):
        g += d * rewards[i, t + k]
        d *= discounts[i, t + k]
      ret[i, t], disc[i, t] = g, d
  return ret, disc


@settings(max_examples=15)
@given(b=hst.integers(1, 3), ln=hst.integers(2, 7), data=hst.data())
def test_n_step_returns_match_a_loop(b, ln, data):
  n = data.draw(hst.integers(1, ln - 1))
  seed = data.draw(hst.integers(0, 2**31 - 1))
  r = np.random.RandomState(seed)
  rewards = r.randn(b, ln).astype(np.float32)
  discounts = (0.9 * (r.rand(b, ln) > 0.3)).astype(np.float32)  # zeros = episode ends
  ret, disc, idx = jax.jit(fr.n_step_returns, static_argnums=2)(rewards, discounts, n)
  want_ret, want_disc = reference(rewards, discounts, n)
  np.testing.assert_allclose(ret, want_ret, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(disc, want_disc, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(idx, np.arange(n, ln))
  values = r.randn(b, ln).astype(np.float32)
  np.testing.assert_allclose(fr.n_step_target(rewards, discounts, values, n),
                             want_ret + want_disc * values[:, n:], rtol=1e-5, atol=1e-5)


def test_n_step_on_sampled_windows_inside_jit():
  spec = fr.TrajectorySpec(2, 16, 4, 1, {"r": jnp.zeros((), jnp.float32),
                                         "d": jnp.zeros((), jnp.float32)})
  table = fr.make_trajectory_table(spec)

  @jax.jit
  def f(key):
    s = table.add(table.init(), {"r": jnp.ones((2, 10)), "d": jnp.full((2, 10), 0.5)})
    s, smp = table.sample(s, key, batch_size=5)
    return fr.n_step_returns(smp.data["r"], smp.data["d"], 2)[:2]
  ret, disc = f(jax.random.key(0))
  np.testing.assert_allclose(ret, 1.5)  # 1 + 0.5 * 1
  np.testing.assert_allclose(disc, 0.25)


def test_bad_n():
  with pytest.raises(ValueError, match=r"n must be a static int in \[1, L=3\)"):
    fr.n_step_returns(jnp.zeros((2, 3)), jnp.zeros((2, 3)), 3)
  with pytest.raises(ValueError, match="discounts shape"):
    fr.n_step_returns(jnp.zeros((2, 3)), jnp.zeros((2, 4)), 1)


def test_dqn_trajectory_tiny_runs(tmp_path):
  from configs import dqn_trajectory as cfg
  from experiments import dqn_trajectory
  c = cfg.get_config("tiny")
  c.total_env_steps = 800
  s = dqn_trajectory.run(c, str(tmp_path), verbose=False)
  assert s["env_steps"] == 800 and s["final_mean_return"] is not None
  assert os.path.exists(tmp_path / "summary.json")
