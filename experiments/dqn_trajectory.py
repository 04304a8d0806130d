"""n-step double DQN on JAX CartPole from a trajectory table, all inside one jitted ``lax.scan``.

Each vector step stores one step per env, ``{obs, action, reward, discount}``
(``discount = gamma * (1 - done)``), in a ``fr.make_trajectory_table`` time
axis: every step is stored once. The learner samples windows of ``n + 1``
consecutive steps (period 1: every step starts a window) and builds the
n-step double-DQN target with ``fr.n_step_returns``: the discounted sum of
rewards ``0 .. n-1`` (cut at an episode end by the zero discount) plus the
bootstrap discount times ``Q_target(obs[n], argmax Q(obs[n]))``. Compare
``experiments/dqn_anakin.py``, which keeps a sliding window of the last n
transitions per env in the scan carry and inserts each n-step transition as
an item (obs stored twice).

Windows here may cross episode starts (``cross_episodes=True``): a window
that runs past an episode end carries a zero discount at that step, so the
n-step return stops there and nothing after it is used. That needs the last
steps of every episode to start windows, which ``cross_episodes=False``
would forbid (their windows cross the next episode's start). Time-limit
truncations (500 steps) are treated as terminal for the bootstrap (the
common simplification; the item-table demo bootstraps them).

  python experiments/dqn_trajectory.py --config=configs/dqn_trajectory.py --workdir=runs/dqn_traj

Writes ``metrics.jsonl``, ``learning_curve.png`` and ``summary.json`` into ``--workdir``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments import common  # noqa: E402
from experiments import jax_cartpole as env  # noqa: E402
from experiments.dqn_parts import QNetwork  # noqa: E402


class Carry(NamedTuple):
  env_state: Any
  obs: jax.Array            # float32[E, 4]
  params: Any
  target_params: Any
  opt_state: Any
  replay: Any               # fr.TrajectoryState
  rng: jax.Array
  env_steps: jax.Array      # int32[]
  learner_steps: jax.Array  # int32[]
  returns: jax.Array        # float32[W] ring of the last W episode returns
  episodes: jax.Array       # int32[]


def step_example():
  return {"obs": jnp.zeros((env.OBS_DIM,), jnp.float32), "action": jnp.zeros((), jnp.int32),
          "reward": jnp.zeros((), jnp.float32), "discount": jnp.zeros((), jnp.float32)}


@functools.lru_cache(maxsize=8)
def build(static_key: str):
  """``(init_fn(seed) -> Carry, chunk_fn(Carry) -> (Carry, metrics))`` for a config."""
  c = json.loads(static_key)
  e, b, n = c["num_envs"], c["batch_size"], c["n_step"]
  sampler = fr.Prioritized(c["priority_exponent"]) if c["prioritized"] else fr.Uniform()
  spec = fr.TrajectorySpec(e, c["time_capacity"], n + 1, 1, step_example(), sampler=sampler,
                           cross_episodes=True)
  table = fr.make_trajectory_table(spec)
  net = QNetwork(tuple(c["hidden"]), env.NUM_ACTIONS)
  lr = optax.linear_schedule(c["learning_rate"], c["lr_end"], max(c["lr_decay_steps"], 1))
  opt = optax.chain(optax.clip_by_global_norm(c["max_grad_norm"]), optax.adam(lr))

  def init_fn(seed):
    rng, k_env, k_net = jax.random.split(jax.random.PRNGKey(seed), 3)
    env_state, obs = jax.vmap(env.reset)(jax.random.split(k_env, e))
    params = net.init(k_net, obs)
    return Carry(env_state, obs, params, params, opt.init(params), table.init(), rng,
                 jnp.int32(0), jnp.int32(0), jnp.zeros((c["return_window"],), jnp.float32),
                 jnp.int32(0))

  def loss_fn(params, target_params, win, valid):
    """Huber loss of the n-step double-DQN TD error at window position 0."""
    ret, disc, idx = fr.n_step_returns(win["reward"], win["discount"], n)  # [B, 1]
    boot = win["obs"][:, idx[0]]
    a_star = jnp.argmax(net.apply(params, boot), axis=1)
    q_next = jnp.take_along_axis(net.apply(target_params, boot), a_star[:, None], axis=1)[:, 0]
    target = jax.lax.stop_gradient(ret[:, 0] + disc[:, 0] * q_next)
    q = net.apply(params, win["obs"][:, 0])
    q_a = jnp.take_along_axis(q, win["action"][:, :1], axis=1)[:, 0]
    td = q_a - target
    w = valid.astype(jnp.float32)
    return jnp.sum(w * optax.huber_loss(td)) / jnp.maximum(jnp.sum(w), 1.0), td

  def learn(carry, rng):
    rs, smp = table.sample(carry.replay, rng, batch_size=b)
    grads, td = jax.grad(loss_fn, has_aux=True)(carry.params, carry.target_params, smp.data,
                                                smp.valid)
    updates, opt_state = opt.update(grads, carry.opt_state, carry.params)
    params = optax.apply_updates(carry.params, updates)
    if c["prioritized"]:
      rs = table.update_priorities(rs, smp.info.slot, smp.info.key, jnp.abs(td) + 1e-3)
    steps = carry.learner_steps + 1
    target = optax.periodic_update(params, carry.target_params, steps, c["target_update_period"])
    return carry._replace(params=params, target_params=target, opt_state=opt_state, replay=rs,
                          learner_steps=steps), jnp.mean(optax.huber_loss(td))

  def step(carry: Carry, _):
    rng, k_act, k_eps, k_env, k_learn = jax.random.split(carry.rng, 5)
    frac = jnp.minimum(carry.env_steps / c["eps_decay_steps"], 1.0)
    eps = c["eps_start"] + frac * (c["eps_end"] - c["eps_start"])
    greedy = jnp.argmax(net.apply(carry.params, carry.obs), axis=1).astype(jnp.int32)
    random_a = jax.random.randint(k_act, (e,), 0, env.NUM_ACTIONS, jnp.int32)
    action = jnp.where(jax.random.uniform(k_eps, (e,)) < eps, random_a, greedy)
    out = jax.vmap(env.step)(carry.env_state, action, jax.random.split(k_env, e))
    new = {"obs": carry.obs, "action": action, "reward": out.reward,
           "discount": c["gamma"] * (1.0 - out.done.astype(jnp.float32))}
    rs = table.add(carry.replay, jax.tree_util.tree_map(lambda x: x[:, None], new))
    w = c["return_window"]
    rank = jnp.cumsum(out.done.astype(jnp.int32)) - 1
    pos = jnp.where(out.done, (carry.episodes + rank) % w, w)
    returns = carry.returns.at[pos].set(out.episode_return, mode="drop")
    carry = carry._replace(env_state=out.state, obs=out.obs, replay=rs, rng=rng,
                           env_steps=carry.env_steps + e, returns=returns,
                           episodes=carry.episodes + jnp.sum(out.done, dtype=jnp.int32))

    def do_learn(carry):
      carry, loss = jax.lax.scan(learn, carry, jax.random.split(k_learn, c["updates_per_iter"]))
      return carry, jnp.mean(loss), jnp.float32(1.0)

    carry, loss, learned = jax.lax.cond(
        carry.env_steps >= c["learning_starts"], do_learn,
        lambda carry: (carry, jnp.float32(0.0), jnp.float32(0.0)), carry)
    return carry, (loss, learned, eps)

  def chunk_fn(carry: Carry):
    carry, (loss, learned, eps) = jax.lax.scan(step, carry, None, length=c["chunk_iters"])
    valid = jnp.minimum(carry.episodes, c["return_window"])
    mean_ret = jnp.where(valid > 0, jnp.sum(carry.returns) / jnp.maximum(valid, 1), jnp.nan)
    return carry, {"env_steps": carry.env_steps, "learner_steps": carry.learner_steps,
                   "episodes": carry.episodes, "mean_return": mean_ret, "epsilon": eps[-1],
                   "loss": jnp.sum(loss) / jnp.maximum(jnp.sum(learned), 1.0),
                   "windows": table.count(carry.replay)}

  return jax.jit(init_fn, static_argnums=0), jax.jit(chunk_fn, donate_argnums=0)


def run(config, workdir: str, verbose: bool = True) -> dict:
  """Train per ``config``; write metrics, plot and summary to ``workdir``; return the summary."""
  timer = common.Timer()
  d = config.to_dict()
  for k in ("seed", "total_env_steps", "stop_at_return", "target_return"):
    d.pop(k)
  init_fn, chunk_fn = build(json.dumps(d, sort_keys=True, default=str))
  carry = init_fn(int(config.seed))
  compiled = chunk_fn.lower(carry).compile()
  per_chunk = config.num_envs * config.chunk_iters
  n_chunks = max(1, -(-int(config.total_env_steps) // per_chunk))
  log = print if verbose else (lambda *_: None)
  steps_hist, ret_hist, reached_at, best, run_wall = [], [], None, -np.inf, 0.0
  with common.MetricsWriter(workdir) as writer:
    for _ in range(n_chunks):
      t = time.perf_counter()
      carry, m = compiled(carry)
      m = {k: common.to_python(v) for k, v in jax.device_get(m).items()}
      dt = time.perf_counter() - t
      run_wall += dt
      m["sps"] = per_chunk / dt
      rec = writer.write(m["env_steps"], m)
      ret = rec["mean_return"]
      steps_hist.append(m["env_steps"])
      ret_hist.append(ret)
      if ret is not None:
        best = max(best, ret)
        if reached_at is None and ret >= config.target_return:
          reached_at = m["env_steps"]
      log(f"[{m['env_steps']:>7d} steps] {m['sps']:>8.0f} steps/s  return(last "
          f"{config.return_window}) {ret if ret is not None else float('nan'):6.1f}  "
          f"eps {m['epsilon']:.2f}  loss {m['loss']:.3f}  windows {m['windows']}")
      if config.stop_at_return and reached_at is not None:
        break
  wall, cpu = timer.elapsed()
  plot = common.plot_curve(os.path.join(workdir, "learning_curve.png"), steps_hist, ret_hist,
                           f"{config.n_step}-step DQN from a trajectory table, seed {config.seed}",
                           f"mean return (last {config.return_window} episodes)",
                           hline=config.target_return)
  summary = {
      "env_steps": int(steps_hist[-1]), "final_mean_return": ret_hist[-1],
      "best_mean_return": None if best == -np.inf else float(best),
      "target_return": config.target_return, "reached_target": reached_at is not None,
      "reached_target_at_env_steps": reached_at, "wall_s": round(wall, 2),
      "cpu_s": round(cpu, 2), "env_steps_per_s": round(int(steps_hist[-1]) / run_wall, 1),
      "seed": int(config.seed), "plot": plot}
  common.write_json(os.path.join(workdir, "summary.json"), summary)
  log("dqn_trajectory summary: " + json.dumps(summary))
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  from ml_collections import config_flags
  _CONFIG = config_flags.DEFINE_config_file(
      "config", "configs/dqn_trajectory.py", "config file (configs/dqn_trajectory.py[:tiny])")
  _WORKDIR = flags.DEFINE_string("workdir", "runs/dqn_trajectory", "where metrics and plots go")
  app.run(main)
