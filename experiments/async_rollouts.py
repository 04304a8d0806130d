"""Asynchronous grouped rollouts with staleness, per-task batches and a reuse cap (host ``Table``).

The xtuner / MineStudio situation: several producer threads (inference
workers) generate *groups* of ``G`` rollouts for a prompt of some task (one
table item = one group, as GRPO-style learners normalise rewards within a
group) with a policy whose version lags the learner's. The learner:

1. is *ready* when, for every task ``t``, at least ``batch_groups[t]``
   trainable groups (status ok or truncated, fresh enough) are in the table
   (``table.count(where={"task": t, "status": [0, 1]})``);
2. takes one batch per task (``table.sample(n, where={"task": t, ...})``);
3. trains (here: group-relative advantages and a stand-in loss), bumps its
   version (``table.set_version``) and expires groups older than
   ``max_staleness`` versions (``table.evict_stale``);
4. never trains on a group more than ``max_times_sampled`` times (the table
   frees it on its last sample).

Printed / written: counts per task and status, the staleness of what was
trained on, evictions by cause and mean reuse at eviction (``table.stats()``),
into ``<workdir>/metrics.jsonl`` (+ TensorBoard) and ``<workdir>/summary.json``.

  python experiments/async_rollouts.py --config=configs/async_rollouts.py --workdir=runs/async

With ``lockstep=True`` (default) the threads take turns at fixed points (see
``Turnstile``) and the run is a deterministic function of the seed; with
``lockstep=False`` they free-run.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
import time
from typing import List

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments import common  # noqa: E402

STATUS = ("ok", "truncated", "failed")
TRAINABLE = (0, 1)  # failed groups are kept for accounting but never trained on


class Turnstile:
  """Hands out turns ``0, 1, 2, ...`` to threads in a fixed order (lockstep mode).

  ``wait(n)`` blocks until turn ``n`` is current; ``done()`` passes to the next.
  ``close()`` releases every waiter (they get ``False``): a producer that fails
  closes it, so nobody waits forever on a turn that will never come.
  """

  def __init__(self):
    self._cond = threading.Condition()
    self._turn = 0
    self._closed = False

  def wait(self, n: int) -> bool:
    """Block until turn ``n``; False if the turnstile was closed first."""
    with self._cond:
      self._cond.wait_for(lambda: self._closed or self._turn == n)
      return not self._closed

  def done(self) -> None:
    with self._cond:
      self._turn += 1
      self._cond.notify_all()

  def close(self) -> None:
    with self._cond:
      self._closed = True
      self._cond.notify_all()


@dataclasses.dataclass
class ProducerLog:
  """What one producer made (host counters)."""

  inserted: np.ndarray  # int64[tasks, 3] groups by task and status
  lags: List[int]       # learner version - policy version, per group at insert time


def item_example(config):
  g, t = config.group_size, config.seq_len
  return {"tokens": jnp.zeros((g, t), jnp.int32), "reward": jnp.zeros((g,), jnp.float32),
          "length": jnp.zeros((g,), jnp.int32)}


def make_group(rng: np.random.Generator, config, task: int, policy_version: int, status: int):
  """One group of ``G`` synthetic rollouts (batch of 1 item); the reward improves with version.

  Returns a dict of numpy arrays with a leading axis of 1: tokens int32[1, G, T],
  reward float32[1, G], length int32[1, G].
  """
  g, t = config.group_size, config.seq_len
  skill = 1.0 - 0.8 * np.exp(-policy_version / (50.0 * (task + 1)))  # harder tasks learn slower
  reward = (rng.random(g) < 0.6 * skill).astype(np.float32)
  length = rng.integers(t // 2, t + 1, g).astype(np.int32)
  if status == 1:
    length[:] = t  # truncated: hit the length limit
  tokens = rng.integers(0, 32_000, (g, t)).astype(np.int32)
  tokens[np.arange(t)[None, :] >= length[:, None]] = 0
  return {"tokens": tokens[None], "reward": reward[None], "length": length[None]}


@jax.jit
def _train_step(reward, length, valid):
  """Stand-in learner step: GRPO group-relative advantages and a length-weighted "loss".

  reward float32[N, G], length int32[N, G], valid bool[N] -> (loss float32[], mean reward).
  """
  mean = reward.mean(axis=1, keepdims=True)
  adv = (reward - mean) / (reward.std(axis=1, keepdims=True) + 1e-6)
  w = valid[:, None].astype(jnp.float32)
  loss = -jnp.sum(w * adv * length) / jnp.maximum(jnp.sum(w * length), 1.0)
  return loss, jnp.sum(w * reward) / jnp.maximum(jnp.sum(w) * reward.shape[1], 1.0)


def run(config, workdir: str, verbose: bool = True) -> dict:
  """Run producers + learner per ``config``; write metrics and ``summary.json``; return it."""
  tasks = tuple(config.tasks)
  k = len(tasks)
  if len(config.task_probs) != k or len(config.batch_groups) != k:
    raise ValueError(f"async_rollouts: tasks ({k}), task_probs ({len(config.task_probs)}) and "
                     f"batch_groups ({len(config.batch_groups)}) must have the same length.")
  if sum(config.batch_groups) > config.capacity:
    raise ValueError("async_rollouts: sum(batch_groups) exceeds the table capacity.")
  log = print if verbose else logging.info
  timer = common.Timer()
  spec = fr.TableSpec(config.capacity, item_example(config), sampler=fr.Uniform(),
                      remover=fr.Fifo(), max_times_sampled=config.max_times_sampled,
                      max_staleness=config.max_staleness, metadata=("task", "status"))
  table = fr.Table(spec, seed=config.seed, version=0)
  probs = np.asarray(config.task_probs, np.float64) / np.sum(config.task_probs)
  n_prod = config.num_producers
  turn = Turnstile() if config.lockstep else None
  stop = threading.Event()
  errors: List[BaseException] = []
  logs = [ProducerLog(np.zeros((k, 3), np.int64), []) for _ in range(n_prod)]
  seeds = np.random.SeedSequence(config.seed).spawn(n_prod)
  timeout = config.sample_timeout_s
  # Lockstep schedule: round r = producers 0..P-1 insert (in order), then the learner's turn.
  per_round = n_prod + 1

  def producer(i: int):
    rng = np.random.default_rng(seeds[i])
    policy_version = 0
    r = 0
    try:
      while not stop.is_set():
        # Lockstep: wait for this producer's turn of round r before reading the learner's
        # version, so what it reads (and hence the whole run) does not depend on timing.
        if turn is not None and not turn.wait(r * per_round + i):
          return
        # Weight refresh, staggered across producers: this is what makes the policy lag.
        if (r + i) % config.sync_every == 0:
          policy_version = table.version
        groups = []
        for _ in range(config.groups_per_round):
          task = int(rng.choice(k, p=probs))
          u = rng.random()
          status = 2 if u < config.failed_prob else (
              1 if u < config.failed_prob + config.truncated_prob else 0)
          groups.append((task, status, make_group(rng, config, task, policy_version, status)))
          if config.gen_time_s:
            time.sleep(config.gen_time_s)
        for task, status, items in groups:
          table.insert(items, version=policy_version, metadata={"task": task, "status": status},
                       timeout=timeout)
          logs[i].inserted[task, status] += 1
          logs[i].lags.append(table.version - policy_version)
        if turn is not None:
          turn.done()
        r += 1
    except fr.TableClosedError:
      pass
    except BaseException as e:  # surfaced by the learner
      errors.append(e)
      stop.set()
      if turn is not None:
        turn.close()

  def is_ready(version: int) -> bool:
    return all(table.count(where={"task": t, "status": list(TRAINABLE)}, version=version)
               >= config.batch_groups[t] for t in range(k))

  threads = [threading.Thread(target=producer, args=(i,), daemon=True, name=f"producer{i}")
             for i in range(n_prod)]
  for th in threads:
    th.start()
  version, rounds, not_ready, evicted_total = 0, 0, 0, 0
  stale_sum = stale_n = 0
  reward_hist = []
  try:
    with common.MetricsWriter(workdir) as writer:
      while version < config.learner_steps:
        if errors:
          raise errors[0]
        if turn is not None:
          if not turn.wait(rounds * per_round + n_prod):
            break
          rounds += 1
          ready = is_ready(version)
        else:
          deadline = time.monotonic() + timeout
          while not (ready := is_ready(version)) and time.monotonic() < deadline and not errors:
            time.sleep(0.001)
          if not ready:
            raise TimeoutError(f"async_rollouts: learner not ready within {timeout} s.")
        if not ready:
          not_ready += 1
          turn.done()
          continue
        rewards, lengths, valids, staleness = [], [], [], []
        for t in range(k):
          smp = table.sample(config.batch_groups[t], where={"task": t, "status": list(TRAINABLE)},
                             version=version, timeout=timeout)
          valid = np.asarray(smp.valid)
          staleness.append(version - np.asarray(smp.info.version)[valid])
          rewards.append(smp.data["reward"])
          lengths.append(smp.data["length"])
          valids.append(smp.valid)
        loss, mean_reward = _train_step(jnp.concatenate(rewards), jnp.concatenate(lengths),
                                        jnp.concatenate(valids))
        st = np.concatenate(staleness)
        stale_sum += int(st.sum())
        stale_n += st.size
        version += 1
        table.set_version(version)
        evicted = table.evict_stale()
        evicted_total += evicted
        reward_hist.append(float(mean_reward))
        writer.write(version, {"loss": loss, "mean_reward": mean_reward, "size": table.size,
                               "batch_staleness": float(st.mean()), "evicted_stale": evicted})
        if verbose and (version % max(1, config.learner_steps // 10) == 0):
          s = table.stats().to_dict()
          log(f"[v{version:>5d}] size {s['size']:>4d}  reward {float(mean_reward):.3f}  "
              f"batch staleness {st.mean():.2f}  evicted stale/reuse/capacity "
              f"{s['evicted_stale']}/{s['evicted_reuse']}/{s['evicted_capacity']}  "
              f"mean reuse at eviction {s['mean_reuse_at_eviction']:.2f}")
        # After the last step the learner keeps the turn: no producer can insert between
        # the last step and the final counts below (which would make them timing-dependent).
        if turn is not None and version < config.learner_steps:
          turn.done()
  finally:
    stop.set()
    if turn is not None:
      turn.close()
    stats = table.stats().to_dict()
    counts = {tasks[t]: {STATUS[s]: table.count(where={"task": t, "status": s})
                         for s in range(3)} for t in range(k)}
    table.close()
    for th in threads:
      th.join(timeout=10)
  if errors:
    raise errors[0]
  inserted = sum(lg.inserted for lg in logs)
  lags = np.concatenate([np.asarray(lg.lags, np.int64) for lg in logs]) if logs else np.zeros(0)
  wall, cpu = timer.elapsed()
  summary = {
      "learner_steps": version, "rounds_not_ready": not_ready, "lockstep": bool(config.lockstep),
      "inserted": {tasks[t]: {STATUS[s]: int(inserted[t, s]) for s in range(3)} for t in range(k)},
      "in_table_at_end": counts,
      "mean_policy_lag_at_insert": float(lags.mean()) if lags.size else 0.0,
      "mean_staleness_trained": stale_sum / max(stale_n, 1),
      "table_stats": stats, "evicted_stale_total": evicted_total,
      "final_mean_reward": float(np.mean(reward_hist[-10:])) if reward_hist else None,
      "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "seed": int(config.seed),
  }
  summary["plot"] = common.plot_metric(workdir, "mean_reward", "async_rollouts: mean reward per "
                                       "learner step")
  common.write_json(os.path.join(workdir, "summary.json"), summary)
  log("inserted (task: ok/truncated/failed): " + ", ".join(
      f"{tasks[t]} {'/'.join(str(int(x)) for x in inserted[t])}" for t in range(k)))
  log("in table at end: " + ", ".join(
      f"{tasks[t]} {'/'.join(str(counts[tasks[t]][s]) for s in STATUS)}" for t in range(k)))
  log(f"async_rollouts summary: {version} learner steps, {not_ready} rounds not ready, "
      f"mean policy lag at insert {summary['mean_policy_lag_at_insert']:.2f}, mean staleness "
      f"trained {summary['mean_staleness_trained']:.2f}, evicted stale {stats['evicted_stale']}, "
      f"reuse {stats['evicted_reuse']}, capacity {stats['evicted_capacity']}, mean reuse at "
      f"eviction {stats['mean_reuse_at_eviction']:.2f}, wall {wall:.1f} s")
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("pass --config=configs/async_rollouts.py")
  run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  # Flags are defined only when run as a script, so tests can import several experiments.
  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "ml_collections config file (e.g. configs/async_rollouts.py[:tiny|:full]).")
  _WORKDIR = flags.DEFINE_string("workdir", "runs/async_rollouts", "where metrics go")
  app.run(main)
