"""Double DQN with prioritized replay on a JAX CartPole, all inside one jitted ``lax.scan``.

The "Anakin" layout (Hessel et al., 2021, Podracer architectures): acting in a
vector of environments, inserting the transitions into a funcreplay table,
sampling a prioritized batch, the learner update (flax MLP + optax) and the
priority update are one pure step function; ``lax.scan`` runs
``chunk_iters`` of them per jitted call with the whole training state
(networks, optimiser, replay ``TableState``, envs) as the donated carry. The
host only prints progress between chunks.

  python experiments/dqn_anakin.py --config=configs/dqn_anakin.py --workdir=runs/dqn_anakin
  python experiments/dqn_anakin.py --config=configs/dqn_anakin.py:tiny --config.seed=3 ...

Writes ``metrics.jsonl``, TensorBoard events, ``learning_curve.png`` and
``summary.json`` into ``--workdir``. ``--config.replay_noop=True`` swaps the
table for a plain ring buffer with uniform random indices (no priorities, no
staleness, no reuse cap); ``--profile_replay_share`` times chunks of both
variants, interleaved, and reports the share of step time spent in the replay
operations (written to ``replay_share.json``).

Default config (``configs/dqn_anakin.py``): 8 envs, 2 updates of batch 64
per vector step, 128x128 MLP, 3-step double-DQN targets, Huber loss, Adam
2.3e-3 decayed linearly to 1e-4 with gradient clipping, hard target copies
every 128 updates, epsilon 1 -> 0.01 over 8k env steps, PER alpha 0.6 with
beta annealed 0.4 -> 1, ``max_staleness`` 20k learner versions,
``max_times_sampled`` 256 (the config's docstring says why these values). The
goal is ``target_return`` = 475, the mean return of the last 20 (training,
epsilon-greedy) episodes, checked after every chunk; the run stops at the
first chunk that reaches it (at most 150k env steps) and ``summary.json``
says whether and when it did. DQN on CartPole is not monotone: run longer
(``--config.stop_at_return=False``) and the return can collapse and recover.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import common  # noqa: E402
from experiments import jax_cartpole as env  # noqa: E402
from experiments.dqn_parts import QNetwork, make_noop_replay, make_replay, n_step_transition  # noqa: E402

# --- the training step ------------------------------------------------------------------

class Carry(NamedTuple):
  env_state: Any
  obs: jax.Array            # float32[E, 4]
  params: Any
  target_params: Any
  opt_state: Any
  replay: Any
  rng: jax.Array
  env_steps: jax.Array      # int32[]
  learner_steps: jax.Array  # int32[] = the learner version
  returns: jax.Array        # float32[W] ring of the last W episode returns
  episodes: jax.Array       # int32[] episodes finished
  window: Any               # the last n one-step transitions per env, leaves [E, n, ...]


def _static_key(config) -> str:
  """Config fields that shape the compiled program (seed / run length excluded)."""
  d = config.to_dict()
  for k in ("seed", "total_env_steps", "stop_at_return", "target_return"):
    d.pop(k, None)
  return json.dumps(d, sort_keys=True, default=str)


@functools.lru_cache(maxsize=8)
def build(static_key: str):
  """``(init_fn(seed) -> Carry, chunk_fn(Carry) -> (Carry, metrics))``, compiled per config."""
  c = json.loads(static_key)
  rc = types.SimpleNamespace(**c["replay"])
  e, b, upd = c["num_envs"], c["batch_size"], c["updates_per_iter"]
  replay = (make_noop_replay if c["replay_noop"] else make_replay)(rc, b)
  net = QNetwork(tuple(c["hidden"]), env.NUM_ACTIONS)
  # Learning rate: linear from learning_rate to lr_end over lr_decay_steps learner steps (a
  # decaying rate keeps a policy that has reached the 500 cap from drifting away again).
  lr = optax.linear_schedule(c["learning_rate"], c["lr_end"], max(c["lr_decay_steps"], 1))
  opt = optax.chain(optax.clip_by_global_norm(c["max_grad_norm"]), optax.adam(lr))

  def init_fn(seed):
    rng = jax.random.PRNGKey(seed)
    rng, k_env, k_net = jax.random.split(rng, 3)
    env_state, obs = jax.vmap(env.reset)(jax.random.split(k_env, e))
    params = net.init(k_net, obs)
    ns = c["n_step"]
    window = {"obs": jnp.zeros((e, ns, env.OBS_DIM), jnp.float32),
              "action": jnp.zeros((e, ns), jnp.int32), "reward": jnp.zeros((e, ns), jnp.float32),
              "next_obs": jnp.zeros((e, ns, env.OBS_DIM), jnp.float32),
              "terminated": jnp.zeros((e, ns), bool), "done": jnp.zeros((e, ns), bool)}
    return Carry(env_state, obs, params, params, opt.init(params), replay.init(), rng,
                 jnp.int32(0), jnp.int32(0), jnp.zeros((c["return_window"],), jnp.float32),
                 jnp.int32(0), window)

  def td_error(params, target_params, data):
    """Double-DQN TD errors float32[N] and Q(s, a) float32[N] of a batch of transitions."""
    q = net.apply(params, data["obs"])
    q_a = jnp.take_along_axis(q, data["action"][:, None], axis=1)[:, 0]
    a_star = jnp.argmax(net.apply(params, data["next_obs"]), axis=1)  # double DQN
    q_next = jnp.take_along_axis(net.apply(target_params, data["next_obs"]), a_star[:, None],
                                 axis=1)[:, 0]
    target = data["reward"] + data["discount"] * q_next
    return q_a - jax.lax.stop_gradient(target), q_a

  def loss_fn(params, target_params, data, weights):
    td, q_a = td_error(params, target_params, data)
    loss = jnp.sum(weights * optax.huber_loss(td)) / jnp.maximum(jnp.sum(weights > 0), 1)
    return loss, (td, jnp.mean(q_a))

  def learn(carry, rng, beta):
    rs, data, weights, slots, keys = replay.sample(carry.replay, rng, carry.learner_steps, beta)
    grads, (td, q_mean) = jax.grad(loss_fn, has_aux=True)(
        carry.params, carry.target_params, data, weights)
    updates, opt_state = opt.update(grads, carry.opt_state, carry.params)
    params = optax.apply_updates(carry.params, updates)
    rs = replay.update(rs, slots, keys, td)
    steps = carry.learner_steps + 1
    if c["target_tau"] < 1.0:  # Polyak averaging every learner step
      target = optax.incremental_update(params, carry.target_params, c["target_tau"])
    else:  # hard copy every target_update_period learner steps
      target = optax.periodic_update(params, carry.target_params, steps,
                                     c["target_update_period"])
    loss = jnp.mean(optax.huber_loss(td))
    return carry._replace(params=params, target_params=target, opt_state=opt_state, replay=rs,
                          learner_steps=steps), (loss, q_mean)

  def step(carry: Carry, _):
    rng, k_act, k_eps, k_env, k_learn = jax.random.split(carry.rng, 5)
    frac = jnp.minimum(carry.env_steps / c["eps_decay_steps"], 1.0)
    eps = c["eps_start"] + frac * (c["eps_end"] - c["eps_start"])
    greedy = jnp.argmax(net.apply(carry.params, carry.obs), axis=1).astype(jnp.int32)
    random_a = jax.random.randint(k_act, (e,), 0, env.NUM_ACTIONS, jnp.int32)
    action = jnp.where(jax.random.uniform(k_eps, (e,)) < eps, random_a, greedy)
    out = jax.vmap(env.step)(carry.env_state, action, jax.random.split(k_env, e))
    # Slide each env's window of the last n one-step transitions; the n-step transition that
    # starts at its oldest step is complete now (steps after an episode end are cut off).
    new = {"obs": carry.obs, "action": action, "reward": out.reward, "next_obs": out.final_obs,
           "terminated": out.terminated, "done": out.done}
    window = jax.tree_util.tree_map(lambda w, x: jnp.concatenate([w[:, 1:], x[:, None]], axis=1),
                                    carry.window, new)
    items = n_step_transition(window, c["gamma"])

    def insert(rs):
      td_new = (td_error(carry.params, carry.target_params, items)[0]
                if rc.initial_priority == "td" else None)
      return replay.insert(rs, items, carry.learner_steps, td_new)

    # The first n - 1 vector steps have no complete window yet.
    rs = jax.lax.cond(carry.env_steps >= (c["n_step"] - 1) * e, insert, lambda rs: rs,
                      carry.replay)
    # Finished episodes go into the ring of the last W returns, in env order.
    w = c["return_window"]
    rank = jnp.cumsum(out.done.astype(jnp.int32)) - 1
    pos = jnp.where(out.done, (carry.episodes + rank) % w, w)
    returns = carry.returns.at[pos].set(out.episode_return, mode="drop")
    n_done = jnp.sum(out.done, dtype=jnp.int32)
    carry = carry._replace(env_state=out.state, obs=out.obs, replay=rs, rng=rng,
                           env_steps=carry.env_steps + e, returns=returns,
                           episodes=carry.episodes + n_done, window=window)
    # PER beta: linear from beta_start to beta_end over beta_decay_steps env steps.
    beta_frac = jnp.minimum(carry.env_steps / max(rc.beta_decay_steps, 1), 1.0)
    beta = rc.beta_start + beta_frac * (rc.beta_end - rc.beta_start)

    def do_learn(carry):
      def one(carry, k):
        return learn(carry, k, beta)
      carry, (loss, q) = jax.lax.scan(one, carry, jax.random.split(k_learn, upd))
      return carry, jnp.mean(loss), jnp.mean(q), jnp.float32(1.0)

    def skip(carry):
      return carry, jnp.float32(0.0), jnp.float32(0.0), jnp.float32(0.0)

    carry, loss, q, learned = jax.lax.cond(carry.env_steps >= c["learning_starts"], do_learn,
                                           skip, carry)
    ep_ret_sum = jnp.sum(out.episode_return)
    return carry, (loss, q, learned, n_done, ep_ret_sum, eps)

  def chunk_fn(carry: Carry):
    carry, (loss, q, learned, n_done, ret_sum, eps) = jax.lax.scan(
        step, carry, None, length=c["chunk_iters"])
    rs = replay.end_chunk(carry.replay, carry.learner_steps)
    carry = carry._replace(replay=rs)
    n_learn = jnp.maximum(jnp.sum(learned), 1.0)
    valid = jnp.minimum(carry.episodes, c["return_window"])
    mean_ret = jnp.where(valid > 0, jnp.sum(carry.returns) / jnp.maximum(valid, 1), jnp.nan)
    metrics = {
        "env_steps": carry.env_steps, "learner_steps": carry.learner_steps,
        "episodes": carry.episodes, "mean_return": mean_ret,
        "chunk_episode_return": jnp.where(jnp.sum(n_done) > 0,
                                          jnp.sum(ret_sum) / jnp.maximum(jnp.sum(n_done), 1),
                                          jnp.nan),
        "loss": jnp.sum(loss) / n_learn, "q_mean": jnp.sum(q) / n_learn, "epsilon": eps[-1],
        "replay": replay.stats(rs, carry.learner_steps),
    }
    return carry, metrics

  return jax.jit(init_fn, static_argnums=0), jax.jit(chunk_fn, donate_argnums=0)


def _flat_metrics(m) -> dict:
  """Host dict of scalars from the chunk metrics (replay stats flattened as ``replay/...``)."""
  m = jax.device_get(m)
  rep = m.pop("replay")
  out = {k: common.to_python(v) for k, v in m.items()}
  if "stats" in rep:
    st = rep["stats"].to_dict()
    for k in ("size", "inserts", "samples", "evicted_capacity", "evicted_stale",
              "evicted_reuse", "mean_reuse_at_eviction", "mean_staleness_sampled"):
      out[f"replay/{k}"] = st[k]
    out["replay/eligible"] = int(rep["eligible"])
  else:
    out["replay/size"] = int(rep["size"])
  return out


def run(config, workdir: str, verbose: bool = True) -> dict:
  """Train per ``config``; write metrics, plot and summary to ``workdir``; return the summary."""
  if config.num_envs < 1 or config.chunk_iters < 1 or config.batch_size < 1:
    raise ValueError("dqn_anakin: num_envs, chunk_iters and batch_size must be >= 1.")
  if config.batch_size > config.replay.capacity:
    raise ValueError(f"dqn_anakin: batch_size {config.batch_size} exceeds replay.capacity "
                     f"{config.replay.capacity}.")
  timer = common.Timer()
  init_fn, chunk_fn = build(_static_key(config))
  carry = init_fn(int(config.seed))
  t0 = time.perf_counter()
  compiled = chunk_fn.lower(carry).compile()
  compile_s = time.perf_counter() - t0
  per_chunk = config.num_envs * config.chunk_iters
  n_chunks = max(1, -(-int(config.total_env_steps) // per_chunk))
  log = print if verbose else logging.info
  log(f"dqn_anakin: {config.num_envs} envs x {config.chunk_iters} steps per chunk, {n_chunks} "
      f"chunks, replay={'noop' if config.replay_noop else 'funcreplay PER'}, "
      f"compile {compile_s:.1f} s")
  steps_hist, ret_hist, reached_at, best = [], [], None, -np.inf
  run_wall = 0.0
  with common.MetricsWriter(workdir) as writer:
    for _ in range(n_chunks):
      t = time.perf_counter()
      carry, m = compiled(carry)
      m = _flat_metrics(m)
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
          reached_at = (m["env_steps"], timer.elapsed()[0])
      rep = (f"replay size {m['replay/size']}" + (
          f" eligible {m['replay/eligible']} staleness {m['replay/mean_staleness_sampled']:.0f}"
          f" evicted stale/reuse {m['replay/evicted_stale']}/{m['replay/evicted_reuse']}"
          if "replay/eligible" in m else ""))
      log(f"[{m['env_steps']:>7d} steps] {m['sps']:>8.0f} steps/s  return(last "
          f"{config.return_window}) {ret if ret is not None else float('nan'):6.1f}  "
          f"eps {m['epsilon']:.2f}  loss {m['loss']:.3f}  {rep}")
      if config.stop_at_return and reached_at is not None:
        break
  wall, cpu = timer.elapsed()
  env_steps = int(steps_hist[-1])
  plot = common.plot_curve(os.path.join(workdir, "learning_curve.png"), steps_hist, ret_hist,
                           f"DQN (PER) on JAX CartPole, seed {config.seed}",
                           f"mean return (last {config.return_window} episodes)",
                           hline=config.target_return)
  summary = {
      "env_steps": env_steps, "final_mean_return": ret_hist[-1],
      "best_mean_return": None if best == -np.inf else float(best),
      "target_return": config.target_return, "reached_target": reached_at is not None,
      "reached_target_at_env_steps": None if reached_at is None else reached_at[0],
      "reached_target_at_wall_s": None if reached_at is None else round(reached_at[1], 2),
      "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "compile_s": round(compile_s, 2),
      "train_wall_s": round(run_wall, 2), "env_steps_per_s": round(env_steps / run_wall, 1),
      "replay_noop": bool(config.replay_noop), "seed": int(config.seed), "plot": plot,
  }
  common.write_json(os.path.join(workdir, "summary.json"), summary)
  log(f"dqn_anakin: seed {config.seed} " + (
      f"reached mean return {config.target_return:g} at {reached_at[0]} env steps"
      if reached_at else f"did not reach {config.target_return:g} in {env_steps} env steps"))
  log("dqn_anakin summary: " + json.dumps(summary))
  return summary


def replay_share(config, chunks: int = 6, verbose: bool = True) -> dict:
  """Time chunks with the real replay and with the no-op stand-in, interleaved; report the share.

  The step is fixed-shape (every iteration acts in every env, inserts, samples
  and updates ``updates_per_iter`` times once learning has started), so the
  two variants do the same non-replay work whatever the policy does. Both
  start from a carry past ``learning_starts``; the median chunk time of each
  is reported with ``share = 1 - t_noop / t_replay``.
  """
  times = {}
  carries, fns = {}, {}
  for noop in (False, True):
    c = config.copy_and_resolve_references()
    c.replay_noop = noop
    init_fn, chunk_fn = build(_static_key(c))
    carry = init_fn(int(c.seed))
    fns[noop] = chunk_fn.lower(carry).compile()
    while int(carry.env_steps) < c.learning_starts:  # warm up: fill the table, start learning
      carry = fns[noop](carry)[0]
    carries[noop] = fns[noop](carry)[0]
    times[noop] = []
  for _ in range(chunks):
    for noop in (False, True):
      t = time.perf_counter()
      carries[noop], m = fns[noop](carries[noop])
      jax.block_until_ready(m)
      times[noop].append(time.perf_counter() - t)
  per_chunk = config.num_envs * config.chunk_iters
  t_rep, t_noop = float(np.median(times[False])), float(np.median(times[True]))
  out = {"chunk_s_replay": t_rep, "chunk_s_noop": t_noop, "share_replay": 1.0 - t_noop / t_rep,
         "env_steps_per_s_replay": per_chunk / t_rep, "env_steps_per_s_noop": per_chunk / t_noop,
         "chunks": chunks}
  if verbose:
    print(f"replay share: {100 * out['share_replay']:.1f}% of step time "
          f"({t_rep * 1e3:.0f} ms vs {t_noop * 1e3:.0f} ms per {per_chunk}-step chunk; "
          f"{out['env_steps_per_s_replay']:.0f} vs {out['env_steps_per_s_noop']:.0f} env steps/s)")
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("pass --config=configs/dqn_anakin.py")
  if _PROFILE.value:
    common.write_json(os.path.join(_WORKDIR.value, "replay_share.json"),
                      replay_share(_CONFIG.value))
    return
  run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  # Flags are defined only when run as a script, so tests can import several experiments.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "ml_collections config file (e.g. configs/dqn_anakin.py[:tiny|:full]).")
  _WORKDIR = flags.DEFINE_string("workdir", "runs/dqn_anakin", "where metrics and plots go")
  _PROFILE = flags.DEFINE_bool("profile_replay_share", False,
                               "instead of training, time chunks with the real replay and the "
                               "no-op one (interleaved) and report the replay share of step time")
  app.run(main)
