"""Experiments: CartPole dynamics vs gymnasium, configs, smoke runs, learning, determinism.

Everything runs in-process with tiny configs (the compiled chunk function is
cached per config, so repeated runs of one config compile once).
"""

import math
import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from configs import async_rollouts as async_cfg  # noqa: E402
from configs import dqn_anakin as dqn_cfg  # noqa: E402
from experiments import async_rollouts, common, dqn_anakin, dqn_parts  # noqa: E402
from experiments import jax_cartpole as jc  # noqa: E402

_TIMING_KEYS = ("wall", "sps", "wall_s", "cpu_s", "compile_s", "train_wall_s", "env_steps_per_s",
                "reached_target_at_wall_s", "plot")


def _strip(d):
  return {k: v for k, v in d.items() if k not in _TIMING_KEYS}


def _finite_numbers(rec):
  vals = [v for v in rec.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
  return vals and all(math.isfinite(v) for v in vals)


# --- jax_cartpole -----------------------------------------------------------------------

def _step_fn():
  return jax.jit(jc.step)


def test_cartpole_matches_gymnasium():
  gym = pytest.importorskip("gymnasium")
  env = gym.make("CartPole-v1")
  step = _step_fn()
  rng = np.random.default_rng(0)
  obs, _ = env.reset(seed=1)
  st = jc.from_physics(env.unwrapped.state)
  ends = 0
  for i in range(300):
    a = int(rng.integers(2)) if i % 3 else int(obs[2] > 0)
    obs, r, term, trunc, _ = env.step(a)
    out = step(st, np.int32(a), jax.random.PRNGKey(i))
    np.testing.assert_allclose(np.asarray(out.final_obs), obs, atol=2e-5, rtol=1e-5)
    assert float(out.reward) == r
    assert bool(out.terminated) == term and bool(out.truncated) == trunc
    if term or trunc:
      ends += 1
      assert bool(out.done) and float(out.episode_return) == float(out.episode_length)
      obs, _ = env.reset()
      st = jc.from_physics(env.unwrapped.state)
    else:
      st = out.state
  assert ends >= 5  # the comparison covered several terminations


def test_cartpole_hand_checked_step():
  # From rest and upright, pushing right: x_dot += tau * F/M_total-ish, theta_dot goes negative.
  out = jc.step(jc.from_physics(np.zeros(4, np.float32)), 1, jax.random.PRNGKey(0))
  x, x_dot, theta, theta_dot = np.asarray(out.final_obs)
  temp = 10.0 / 1.1
  thetaacc = -temp / (0.5 * (4 / 3 - 0.1 / 1.1))
  xacc = temp - 0.05 * thetaacc / 1.1
  np.testing.assert_allclose([x, x_dot, theta, theta_dot], [0, 0.02 * xacc, 0, 0.02 * thetaacc],
                             rtol=1e-6)
  assert not bool(out.done)


def test_cartpole_truncates_at_500_and_auto_resets():
  st = jc.from_physics(np.zeros(4, np.float32))._replace(t=np.int32(499),
                                                        episode_return=np.float32(499.0))
  out = jc.step(st, 1, jax.random.PRNGKey(3))
  assert bool(out.truncated) and not bool(out.terminated) and bool(out.done)
  assert float(out.episode_return) == 500.0 and int(out.episode_length) == 500
  assert int(out.state.t) == 0 and float(out.state.episode_return) == 0.0
  assert np.all(np.abs(np.asarray(out.obs)) <= 0.05)
  np.testing.assert_array_equal(np.asarray(out.obs), np.asarray(out.state.physics))
  # Termination wins over truncation on the same step (gymnasium reports terminated).
  edge = st._replace(physics=np.array([2.4, 1.0, 0, 0], np.float32))
  out = jc.step(edge, 1, jax.random.PRNGKey(3))
  assert bool(out.terminated) and not bool(out.truncated)


def test_cartpole_vmaps():
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  st, obs = jax.vmap(jc.reset)(keys)
  out = jax.vmap(jc.step)(st, np.ones(5, np.int32), keys)
  assert out.obs.shape == (5, 4) and out.done.shape == (5,)
  assert len({tuple(np.asarray(o)) for o in obs}) == 5


# --- configs ----------------------------------------------------------------------------

@pytest.mark.parametrize("mod", [dqn_cfg, async_cfg])
def test_configs_load_variants_and_override(mod):
  default, tiny, full = mod.get_config(), mod.get_config("tiny"), mod.get_config("full")
  assert default.seed == 0 and tiny.seed == 0
  assert full.to_dict() != default.to_dict() != tiny.to_dict()
  default.seed = 3
  assert default.seed == 3
  with pytest.raises(ValueError, match="unknown variant"):
    mod.get_config("huge")


def test_config_file_flag_overrides():
  from absl import flags
  from ml_collections import config_flags
  fv = flags.FlagValues()
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "configs", "dqn_anakin.py")
  argv = ["prog", f"--config={path}:tiny", "--config.seed=3", "--config.replay.max_times_sampled=5"]
  # Override flags (--config.x=...) are registered from the argv given at definition time.
  config_flags.DEFINE_config_file("config", None, "cfg", flag_values=fv, sys_argv=argv)
  fv(argv)
  assert fv.config.seed == 3 and fv.config.replay.max_times_sampled == 5
  assert fv.config.num_envs == dqn_cfg.get_config("tiny").num_envs


# --- dqn_anakin ---------------------------------------------------------------------------

def _tiny_dqn(**overrides):
  c = dqn_cfg.get_config("tiny")
  c.total_env_steps = 800
  for k, v in overrides.items():
    c[k] = v
  return c


@pytest.mark.timeout(120)
def test_dqn_smoke_metrics_and_determinism(tmp_path):
  c = _tiny_dqn()
  s1 = dqn_anakin.run(c, str(tmp_path / "a"), verbose=False)
  s2 = dqn_anakin.run(c, str(tmp_path / "b"), verbose=False)
  for d in ("a", "b"):
    assert os.path.exists(tmp_path / d / "learning_curve.png")
    assert os.path.exists(tmp_path / d / "summary.json")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / d)) \
        or common.tensorboardX is None
  m1 = common.read_metrics(str(tmp_path / "a"))
  m2 = common.read_metrics(str(tmp_path / "b"))
  assert len(m1) == 2 and all(_finite_numbers(r) for r in m1)
  # n-step: the first n - 1 vector steps complete no transition.
  assert m1[-1]["env_steps"] == 800
  assert m1[-1]["replay/inserts"] == 800 - (c.n_step - 1) * c.num_envs
  assert m1[-1]["replay/samples"] > 0 and m1[-1]["replay/evicted_reuse"] > 0
  # Same seed, same curve (everything but timings).
  assert [_strip(r) for r in m1] == [_strip(r) for r in m2]
  assert _strip(s1) == _strip(s2)
  # Another seed gives another curve.
  dqn_anakin.run(_tiny_dqn(seed=1), str(tmp_path / "c"), verbose=False)
  assert [_strip(r) for r in common.read_metrics(str(tmp_path / "c"))] != [_strip(r) for r in m1]


def test_dqn_n_step_transition_cuts_at_episode_ends():
  # Window of 3 steps, rewards 1, gamma 0.5. Env 0 terminates at step 1: R = 1 + 0.5, no
  # bootstrap. Env 1 is truncated at step 2: R = 1.75, bootstrap from that step with 0.5**3.
  # Env 2 runs on: R = 1.75, bootstrap from step 2 with 0.5**3.
  obs = np.arange(3 * 3 * 4, dtype=np.float32).reshape(3, 3, 4)
  window = {"obs": obs, "action": np.array([[1, 0, 1], [0, 0, 1], [1, 1, 1]], np.int32),
            "reward": np.ones((3, 3), np.float32), "next_obs": -obs,
            "terminated": np.array([[0, 1, 0], [0, 0, 0], [0, 0, 0]], bool),
            "done": np.array([[0, 1, 0], [0, 0, 1], [0, 0, 0]], bool)}
  t = jax.device_get(dqn_parts.n_step_transition(window, 0.5))
  np.testing.assert_array_equal(t["obs"], obs[:, 0])
  np.testing.assert_array_equal(t["action"], [1, 0, 1])
  np.testing.assert_allclose(t["reward"], [1.5, 1.75, 1.75])
  np.testing.assert_array_equal(t["next_obs"], [-obs[0, 1], -obs[1, 2], -obs[2, 2]])
  np.testing.assert_allclose(t["discount"], [0.0, 0.125, 0.125])


@pytest.mark.timeout(120)
def test_dqn_noop_replay_runs(tmp_path):
  c = _tiny_dqn(replay_noop=True)
  s = dqn_anakin.run(c, str(tmp_path), verbose=False)
  m = common.read_metrics(str(tmp_path))
  assert s["replay_noop"] and "replay/samples" not in m[-1]
  assert m[-1]["replay/size"] == 800 - (c.n_step - 1) * c.num_envs


@pytest.mark.timeout(300)
def test_dqn_learns_beyond_random_policy(tmp_path):
  # A uniformly random policy averages ~22 on CartPole; a short fixed-seed run must clearly beat it.
  c = dqn_cfg.get_config("ci_learn")
  s = dqn_anakin.run(c, str(tmp_path), verbose=False)
  assert s["best_mean_return"] >= 150, s  # seed 0 reaches ~239


# --- async_rollouts ---------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_async_rollouts_smoke_and_determinism(tmp_path):
  c = async_cfg.get_config("tiny")
  s1 = async_rollouts.run(c, str(tmp_path / "a"), verbose=False)
  s2 = async_rollouts.run(c, str(tmp_path / "b"), verbose=False)
  m = common.read_metrics(str(tmp_path / "a"))
  assert len(m) == c.learner_steps and all(_finite_numbers(r) for r in m)
  assert _strip(s1) == _strip(s2)
  assert [_strip(r) for r in m] == [_strip(r) for r in common.read_metrics(str(tmp_path / "b"))]
  st = s1["table_stats"]
  assert s1["learner_steps"] == c.learner_steps
  # README: every experiment writes a learning-curve PNG (these three wrote none).
  assert s1["plot"] == str(tmp_path / "a" / "learning_curve.png")
  assert os.path.getsize(s1["plot"]) > 1000
  inserted = sum(sum(v.values()) for v in s1["inserted"].values())
  assert st["inserts"] == inserted
  # Every group that left the table did so for a counted reason, and the reuse cap held.
  assert st["size"] + st["evicted_stale"] + st["evicted_reuse"] + st["evicted_capacity"] == inserted
  assert 0.0 < s1["mean_staleness_trained"] <= c.max_staleness
  assert s1["table_stats"]["mean_staleness_sampled"] == pytest.approx(s1["mean_staleness_trained"])
  assert st["evicted_stale"] > 0 and st["evicted_reuse"] > 0
  assert st["samples"] == c.learner_steps * sum(c.batch_groups)
  assert st["mean_reuse_at_eviction"] <= c.max_times_sampled
  # Failed groups are never trained on: they only leave by expiring.
  assert sum(v["failed"] for v in s1["inserted"].values()) > 0


# --- bench_hugepages (a subprocess: it madvises its own buffers) -------------------------

def test_bench_hugepages_smoke(tmp_path):
  import json
  import subprocess
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = tmp_path / "hp.json"
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "experiments", "bench_hugepages.py"),
       "--capacity=20000", "--repeats=1", "--calls=3", f"--out={out}"],
      capture_output=True, text=True, timeout=240, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  if "no transparent huge pages here" in proc.stdout or "nothing to compare" in proc.stderr:
    pytest.skip("no transparent huge pages on this machine: " + proc.stdout.strip()[-200:])
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads(out.read_text())["rows"]
  assert [r["case"] for r in rows] == [
      "uniform sample b256", "uniform sample b1024", "insert b256",
      "prioritized sample+update b256", "prioritized sample+update b1024"]
  assert all(r["small_pages_us"] > 0 and r["huge_pages_us"] > 0 for r in rows)
  assert "table B still on huge pages: True" in proc.stdout


# --- async_grpo (issue 28) ---------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_async_grpo_tiny(tmp_path):
  from configs import async_grpo as grpo_cfg
  from experiments import async_grpo
  c = grpo_cfg.get_config("tiny")
  s = async_grpo.run(c, str(tmp_path), verbose=False)
  m = common.read_metrics(str(tmp_path))
  assert len(m) == c.learner_steps and all(_finite_numbers(r) for r in m)
  assert s["staleness_max"] <= c.max_staleness and s["reuse_max"] <= c.max_times_sampled
  assert os.path.getsize(tmp_path / "learning_curve.png") > 1000
  assert s["groups"]["complete"] > 0 and s["ragged_bytes_per_token"] < s["padded_bytes_per_token"]
