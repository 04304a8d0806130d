"""A PyTorch double DQN on gymnasium CartPole-v1, trained from a funcreplay table.

Layout (Reverb style, in one process):

* ``num_actors`` actor threads each run a gymnasium env with an epsilon-greedy
  copy of the online network (numpy forward pass; weights refreshed every
  ``actor_sync_period`` learner updates) and feed transitions to the table
  (through ``Table.ingestor()`` when ``funcreplay.host.ingest`` is available, else
  ``Table.insert``), tagged with the learner version of their weights;
* the table is prioritized (``fr.Prioritized``) with a ``SampleToInsertRatio``
  rate limiter (a fixed update-to-data ratio whatever the thread speeds) and a
  staleness limit in learner versions;
* the learner (main thread) samples through ``funcreplay.torch.TorchSampler``
  (zero-copy DLPack batches, prefetched on a background thread, PER
  importance weights), takes an Adam step on the Huber double-DQN loss and
  writes ``|td| + eps`` back with ``funcreplay.torch.update_priorities``.

  python experiments/dqn_torch.py --config=configs/dqn_torch.py:full --workdir=runs/dqn_torch
  python experiments/dqn_torch.py --config=configs/dqn_torch.py --config.seed=3   # CI smoke

Writes ``metrics.jsonl`` (+ TensorBoard events when available),
``learning_curve.png``, ``replay_stats.json`` (table stats and a run summary)
into ``--workdir``. Seeds are fixed, but the actor threads interleave
nondeterministically, so two runs with one seed differ in detail.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import threading
from typing import Any, Dict, List

import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments import common  # noqa: E402

common.set_platform_flags("cpu", single_thread_eigen=True)

import gymnasium as gym  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import funcreplay as fr  # noqa: E402
import funcreplay.torch as frt  # noqa: E402

try:
  from funcreplay import IngestorClosedError
except ImportError:  # no Ingestor in this checkout: actors insert directly
  class IngestorClosedError(RuntimeError):
    """Placeholder (never raised)."""

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "ml_collections config file (configs/dqn_torch.py[:full]).")
_WORKDIR = flags.DEFINE_string("workdir", "runs/dqn_torch", "where metrics and plots go")


def q_network(obs_dim: int, hidden, num_actions: int) -> nn.Sequential:
  """MLP: float32[..., obs_dim] -> float32[..., num_actions] action values."""
  layers, d = [], obs_dim
  for h in hidden:
    layers += [nn.Linear(d, h), nn.ReLU()]
    d = h
  layers.append(nn.Linear(d, num_actions))
  return nn.Sequential(*layers)


def _numpy_weights(net: nn.Sequential) -> List[tuple]:
  """[(W^T float32[in, out], b float32[out])] copies for the actors' numpy forward pass."""
  return [(m.weight.detach().numpy().T.copy(), m.bias.detach().numpy().copy())
          for m in net if isinstance(m, nn.Linear)]


def _numpy_q(weights, obs: np.ndarray) -> np.ndarray:
  x = obs
  for i, (w, b) in enumerate(weights):
    x = x @ w + b
    if i < len(weights) - 1:
      x = np.maximum(x, 0.0)
  return x


class _Shared:
  """State shared by the actor threads and the learner (guarded by ``lock``)."""

  def __init__(self, cfg, net):
    self.cfg = cfg
    self.lock = threading.Lock()
    self.stop = threading.Event()
    self.env_steps = 0
    self.episodes: List[tuple] = []      # (env_steps at the end, return, actor)
    self.errors: List[BaseException] = []
    self.policy = (0, _numpy_weights(net))  # (learner version, weights): swapped atomically

  def epsilon(self, steps: int) -> float:
    c = self.cfg
    frac = min(1.0, steps / max(1, c.eps_decay_steps))
    return c.eps_start + frac * (c.eps_end - c.eps_start)

  def mean_return(self) -> float:
    with self.lock:
      last = [r for _, r, _ in self.episodes[-self.cfg.return_window:]]
    return float(np.mean(last)) if last else float("nan")


def _item(obs_dim: int) -> Dict[str, np.ndarray]:
  """One transition: obs, action, reward, discount (0 at termination), next_obs."""
  return dict(obs=np.zeros(obs_dim, np.float32), action=np.zeros((), np.int32),
              reward=np.zeros((), np.float32), discount=np.zeros((), np.float32),
              next_obs=np.zeros(obs_dim, np.float32))


class _Writer:
  """An actor's way into the table: the shared Ingestor if there is one, else ``Table.insert``.

  Both wait in short slices so that a stop request is noticed while the table's
  rate limiter holds the actors back.
  """

  def __init__(self, table: fr.Table, ingestor, stop: threading.Event, insert_batch: int):
    self.table, self.ingestor, self.stop, self.insert_batch = table, ingestor, stop, insert_batch
    self.rows: List[Dict[str, np.ndarray]] = []

  def write(self, row: Dict[str, np.ndarray], version: int) -> None:
    if self.ingestor is not None:
      while not self.stop.is_set():
        try:
          self.ingestor.put(row, version=version)
          return
        except TimeoutError:  # queue full: the rate limiter waits for the learner
          continue
      return
    self.rows.append(row)
    if len(self.rows) < self.insert_batch:
      return
    batch = {k: np.stack([r[k] for r in self.rows]) for k in row}
    self.rows = []
    while not self.stop.is_set():
      try:
        self.table.insert(batch, version=version, timeout=0.1)
        return
      except TimeoutError as e:  # the rate limiter waits for the learner; keep the rest
        batch = {k: v[e.inserted:] for k, v in batch.items()}


def _make_ingestor(table: fr.Table, cfg):
  """One Ingestor shared by every actor thread, or None (config off / module missing)."""
  if not cfg.use_ingestor:
    return None
  try:
    return table.ingestor(batch_size=cfg.insert_batch, max_queue=4 * cfg.insert_batch,
                          put_timeout=0.1)
  except ImportError:
    logging.warning("funcreplay.Ingestor is not available: actors call Table.insert directly")
    return None


def _actor(idx: int, table: fr.Table, ingestor, shared: _Shared) -> None:
  cfg = shared.cfg
  try:
    env = gym.make(cfg.env_id)
    rng = np.random.default_rng([cfg.seed, idx])
    obs, _ = env.reset(seed=cfg.seed * 1000 + idx)
    writer = _Writer(table, ingestor, shared.stop, cfg.insert_batch)
    version, weights = shared.policy
    ep_return = 0.0
    while not shared.stop.is_set():
      if shared.policy[0] != version:
        version, weights = shared.policy
      if rng.random() < shared.epsilon(shared.env_steps):
        action = int(rng.integers(env.action_space.n))
      else:
        action = int(np.argmax(_numpy_q(weights, obs.astype(np.float32))))
      next_obs, reward, term, trunc, _ = env.step(action)
      ep_return += reward
      with shared.lock:
        shared.env_steps += 1
        if term or trunc:
          shared.episodes.append((shared.env_steps, ep_return, idx))
        done = shared.env_steps >= cfg.total_env_steps
      # Termination cuts the bootstrap (discount 0); truncation at 500 steps does not.
      writer.write(dict(obs=obs.astype(np.float32), action=np.int32(action),
                        reward=np.float32(reward), discount=np.float32(0.0 if term else 1.0),
                        next_obs=next_obs.astype(np.float32)), version)
      obs = next_obs
      if term or trunc:
        obs, _ = env.reset()
        ep_return = 0.0
      if done:
        shared.stop.set()
  except (fr.TableClosedError, IngestorClosedError):
    pass  # shutdown
  except BaseException as e:  # noqa: BLE001 (surfaced in the learner)
    shared.errors.append(e)
    shared.stop.set()


def _beta_fn(cfg):
  r = cfg.replay
  return lambda i: r.beta_start + min(1.0, i / max(1, r.beta_decay_steps)) * (r.beta_end
                                                                                - r.beta_start)


def run(cfg, workdir: str) -> Dict[str, Any]:
  """Train; write metrics, learning curve and replay stats into ``workdir``; return a summary."""
  os.makedirs(workdir, exist_ok=True)
  torch.manual_seed(cfg.seed)
  torch.set_num_threads(cfg.torch_threads)
  probe = gym.make(cfg.env_id)
  obs_dim, num_actions = int(probe.observation_space.shape[0]), int(probe.action_space.n)
  net = q_network(obs_dim, tuple(cfg.hidden), num_actions)
  target = copy.deepcopy(net)
  opt = torch.optim.Adam(net.parameters(), lr=cfg.learning_rate)
  huber = nn.SmoothL1Loss(reduction="none")

  r = cfg.replay
  spec = fr.TableSpec(
      r.capacity, _item(obs_dim), sampler=fr.Prioritized(r.priority_exponent),
      max_staleness=r.max_staleness,
      rate_limiter=fr.SampleToInsertRatio(r.samples_per_insert, r.learning_starts,
                                          r.error_buffer))
  table = fr.Table(spec, seed=cfg.seed)
  shared = _Shared(cfg, net)
  learner = {"step": 0}
  sampler = frt.TorchSampler(table, cfg.batch_size, version_fn=lambda: learner["step"],
                             beta=_beta_fn(cfg), prefetch=cfg.prefetch, timeout=2.0)
  ingestor = _make_ingestor(table, cfg)
  actors = [threading.Thread(target=_actor, args=(i, table, ingestor, shared),
                             name=f"actor-{i}", daemon=True) for i in range(cfg.num_actors)]
  writer = common.MetricsWriter(workdir)
  timer = common.Timer()
  for t in actors:
    t.start()
  solved_at, losses = None, []
  it = iter(sampler)
  try:
    while not shared.stop.is_set():
      try:
        batch = next(it)
      except TimeoutError:
        if shared.stop.is_set():
          break
        it = iter(sampler)  # actors are slow (e.g. a loaded machine): keep waiting
        continue
      d = batch.data
      with torch.no_grad():
        next_a = net(d["next_obs"]).argmax(dim=1, keepdim=True)   # double DQN: online argmax
        next_q = target(d["next_obs"]).gather(1, next_a).squeeze(1)
        y = d["reward"] + cfg.gamma * d["discount"] * next_q
      q = net(d["obs"]).gather(1, d["action"].long().unsqueeze(1)).squeeze(1)
      loss = (batch.weights * huber(q, y)).mean()
      opt.zero_grad(set_to_none=True)
      loss.backward()
      nn.utils.clip_grad_norm_(net.parameters(), cfg.max_grad_norm)
      opt.step()
      # TD errors straight from the loss (requires_grad is fine: the bridge detaches).
      frt.update_priorities(table, batch.info, (q - y).abs() + r.priority_eps)
      learner["step"] += 1
      step = learner["step"]
      losses.append(loss.item())
      if step % cfg.target_update_period == 0:
        target.load_state_dict(net.state_dict())
      if step % cfg.actor_sync_period == 0:
        shared.policy = (step, _numpy_weights(net))
      if shared.errors:
        raise shared.errors[0]
      if step % cfg.log_every == 0:
        mean_ret = shared.mean_return()
        env_steps = shared.env_steps
        wall, _ = timer.elapsed()
        writer.write(env_steps, dict(mean_return=mean_ret, loss=float(np.mean(losses)),
                                     updates=step, epsilon=shared.epsilon(env_steps),
                                     episodes=len(shared.episodes), wall=wall))
        logging.info("env steps %7d  updates %7d  episodes %5d  mean return(%d) %6.1f  "
                     "loss %.4f  eps %.3f  %.0f updates/s", env_steps, step,
                     len(shared.episodes), cfg.return_window, mean_ret, np.mean(losses),
                     shared.epsilon(env_steps), step / max(wall, 1e-9))
        losses = []
      if solved_at is None and len(shared.episodes) >= cfg.return_window \
          and shared.mean_return() >= cfg.target_return:
        solved_at = shared.env_steps
        logging.info("mean return over the last %d episodes reached %.0f at %d env steps",
                     cfg.return_window, cfg.target_return, solved_at)
        if cfg.stop_at_return:
          break
  finally:
    shared.stop.set()
    sampler.close()
    if ingestor is not None:
      # The learner stopped sampling, so the rate limiter may hold queued items forever.
      ingestor.close(discard_pending=True)
    for t in actors:
      t.join(timeout=30)
    stats = table.stats().to_dict()
    ingest_stats = None if ingestor is None else dataclasses.asdict(ingestor.stats())
    table.close()
    writer.close()
  if shared.errors:
    raise shared.errors[0]
  wall, cpu = timer.elapsed()
  final = shared.mean_return()
  # The curve: the running mean over the last return_window episodes, at every episode end.
  ends = [e for e, _, _ in shared.episodes]
  rets = np.array([r for _, r, _ in shared.episodes], np.float64)
  w = cfg.return_window
  curve_steps = ends
  curve_returns = [float(rets[max(0, i + 1 - w):i + 1].mean()) for i in range(len(rets))]
  summary = dict(env_steps=shared.env_steps, updates=learner["step"],
                 episodes=len(shared.episodes), final_mean_return=final,
                 return_window=cfg.return_window, target_return=cfg.target_return,
                 solved_at_env_steps=solved_at, wall_s=wall, cpu_s=cpu, seed=cfg.seed,
                 ingestor=ingestor is not None)
  common.write_json(os.path.join(workdir, "replay_stats.json"),
                    dict(table=stats, ingestor=ingest_stats, summary=summary,
                         config=cfg.to_dict()))
  common.plot_curve(os.path.join(workdir, "learning_curve.png"), curve_steps, curve_returns,
                    title=f"PyTorch double DQN on {cfg.env_id} (funcreplay table)",
                    ylabel=f"mean return (last {cfg.return_window} episodes)",
                    hline=cfg.target_return)
  logging.info("done: %s", summary)
  return summary


def main(argv):
  del argv
  cfg = _CONFIG.value
  if cfg is None:
    raise app.UsageError("pass --config=configs/dqn_torch.py[:full]")
  summary = run(cfg, _WORKDIR.value)
  print(f"final mean return (last {cfg.return_window} episodes): "
        f"{summary['final_mean_return']:.1f} after {summary['env_steps']} env steps, "
        f"{summary['updates']} updates, {summary['wall_s']:.0f} s")


if __name__ == "__main__":
  app.run(main)
