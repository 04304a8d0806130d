"""Asynchronous grouped rollouts on Ray: producer processes, a learner process, one replay actor.

``experiments/async_rollouts.py`` with the threads made processes (xtuner's /
MineStudio's layout): ``num_producers`` Ray actors generate groups of ``G`` rollouts
with a policy that lags the learner (they refresh their policy version from the
table every ``sync_every`` rounds) and put them through a ``RemoteWriter`` into
the replay actor (``funcreplay.ray.connect(table_name, spec, namespace=...)``); a
learner Ray actor waits until every task has enough trainable groups
(``count(where={"task": t, "status": [0, 1]})``), samples one batch per task with
``where``, trains (the same stand-in GRPO step), bumps the version
(``set_version``) and expires stale groups (``evict_stale``). ``max_times_sampled``
caps reuse. The driver prints per-task / per-status counts (inserted by each
producer, left in the table), the policy lag at insert, the staleness of what was
trained, evictions by cause and the mean reuse at eviction; it writes
``<workdir>/metrics.jsonl`` and ``<workdir>/summary.json``.

  python experiments/async_rollouts_ray.py --config=configs/async_rollouts_ray.py \
      --workdir=runs/async_ray
  # on a running cluster (ray start --head ... on the machines; see README):
  python experiments/async_rollouts_ray.py --config=configs/async_rollouts_ray.py:full \
      --address=auto

Processes free-run: counts differ a little from run to run (no lockstep here).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from absl import app, flags
from ml_collections import config_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import funcreplay as fr  # noqa: E402
import funcreplay.ray as frr  # noqa: E402
from experiments import async_rollouts as ar  # noqa: E402
from experiments import common  # noqa: E402

STATUS, TRAINABLE = ar.STATUS, ar.TRAINABLE


def produce(table, i: int, config, seed) -> dict:
  """One producer process's loop (runs in a Ray actor); returns its counts."""
  rng = np.random.default_rng(seed)
  k = len(config.tasks)
  probs = np.asarray(config.task_probs, np.float64) / np.sum(config.task_probs)
  inserted = np.zeros((k, 3), np.int64)
  lags = []
  policy_version = 0
  with table.writer(batch_size=config.writer_batch, max_wait_s=0.01, max_in_flight=4) as w:
    for r in range(config.max_rounds):
      current = table.version  # one call; the learner's version now
      if current >= config.learner_steps:
        break
      if (r + i) % config.sync_every == 0:  # weight refresh, staggered: the policy lags
        policy_version = current
      for _ in range(config.groups_per_round):
        task = int(rng.choice(k, p=probs))
        u = rng.random()
        status = 2 if u < config.failed_prob else (
            1 if u < config.failed_prob + config.truncated_prob else 0)
        group = ar.make_group(rng, config, task, policy_version, status)
        if config.gen_time_s:
          time.sleep(config.gen_time_s)
        w.put({key: v[0] for key, v in group.items()}, version=policy_version,
              metadata={"task": task, "status": status})
        inserted[task, status] += 1
        lags.append(current - policy_version)
  return {"inserted": inserted.tolist(), "lags": lags, "writer": w.stats().inserted}


def train_step(reward, length, valid):
  """The stand-in learner step of ``async_rollouts.py`` in numpy: GRPO group-relative
  advantages and a length-weighted "loss". reward float32[N, G], length int32[N, G],
  valid bool[N] -> (loss, mean reward of the valid groups)."""
  adv = (reward - reward.mean(axis=1, keepdims=True)) / (reward.std(axis=1, keepdims=True) + 1e-6)
  w = valid[:, None].astype(np.float32)
  loss = -np.sum(w * adv * length) / max(float(np.sum(w * length)), 1.0)
  return loss, np.sum(w * reward) / max(float(np.sum(w)) * reward.shape[1], 1.0)


def learn(table, config) -> dict:
  """The learner process's loop (runs in a Ray actor); returns per-step metrics."""
  k = len(config.tasks)
  timeout = config.sample_timeout_s
  steps, stale_sum, stale_n, evicted_total, waits = [], 0, 0, 0, 0
  for version in range(config.learner_steps):
    deadline = time.monotonic() + timeout
    while not all(table.count(where={"task": t, "status": list(TRAINABLE)}, version=version)
                  >= config.batch_groups[t] for t in range(k)):
      waits += 1
      if time.monotonic() > deadline:
        raise TimeoutError(f"async_rollouts_ray: learner not ready within {timeout} s at "
                           f"version {version}.")
      time.sleep(0.005)
    rewards, lengths, valids, staleness = [], [], [], []
    for t in range(k):
      smp = table.sample(config.batch_groups[t], where={"task": t, "status": list(TRAINABLE)},
                         version=version, timeout=timeout)
      staleness.append(version - smp.info.version[smp.valid])
      rewards.append(smp.data["reward"])
      lengths.append(smp.data["length"])
      valids.append(smp.valid)
    loss, mean_reward = train_step(np.concatenate(rewards), np.concatenate(lengths),
                                   np.concatenate(valids))
    st = np.concatenate(staleness)
    stale_sum += int(st.sum())
    stale_n += st.size
    table.set_version(version + 1)
    evicted = table.evict_stale()
    evicted_total += evicted
    steps.append({"loss": float(loss), "mean_reward": float(mean_reward),
                  "batch_staleness": float(st.mean()), "evicted_stale": evicted})
  return {"steps": steps, "stale_sum": stale_sum, "stale_n": stale_n,
          "evicted_stale": evicted_total, "not_ready_polls": waits}


def run(config, workdir: str, address=None, verbose: bool = True) -> dict:
  import ray
  tasks, k = tuple(config.tasks), len(config.tasks)
  log = print if verbose else (lambda *a: None)
  timer = common.Timer()
  started_ray = not ray.is_initialized()
  if started_ray:
    if address is None:  # a local cluster: its workers import funcreplay from here
      os.environ["PYTHONPATH"] = os.pathsep.join(
          [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    ray.init(address=address, num_cpus=None if address else config.num_cpus,
             namespace=config.namespace, include_dashboard=False, log_to_driver=verbose)
  # The experiment's functions travel by value: workers need funcreplay, not experiments/.
  ray.cloudpickle.register_pickle_by_value(ar)
  ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
  spec = fr.TableSpec(config.capacity, ar.item_example(config), sampler=fr.Uniform(),
                      remover=fr.Fifo(), max_times_sampled=config.max_times_sampled,
                      max_staleness=config.max_staleness, metadata=("task", "status"))
  table = frr.connect(config.table_name, spec, namespace=config.namespace, seed=config.seed,
                      num_cpus=0)
  worker = ray.remote(num_cpus=0)(lambda fn, *a: fn(*a))
  seeds = np.random.SeedSequence(config.seed).spawn(config.num_producers)
  try:
    learner = worker.remote(learn, table, config)
    producers = [worker.remote(produce, table, i, config, seeds[i])
                 for i in range(config.num_producers)]
    limit = config.sample_timeout_s * 10 + config.learner_steps * 5.0
    out = ray.get(learner, timeout=limit)
    logs = ray.get(producers, timeout=limit)
    stats = table.stats()
    counts = {tasks[t]: {STATUS[s]: table.count(where={"task": t, "status": s})
                         for s in range(3)} for t in range(k)}
  finally:
    table.close()
  with common.MetricsWriter(workdir) as writer:
    for v, m in enumerate(out["steps"], 1):
      writer.write(v, m)
  inserted = np.sum([np.asarray(lg["inserted"]) for lg in logs], axis=0)
  lags = np.concatenate([np.asarray(lg["lags"], np.int64) for lg in logs])
  wall, cpu = timer.elapsed()
  summary = {
      "learner_steps": len(out["steps"]), "not_ready_polls": out["not_ready_polls"],
      "inserted": {tasks[t]: {STATUS[s]: int(inserted[t, s]) for s in range(3)}
                   for t in range(k)},
      "inserted_per_producer": [int(np.sum(lg["inserted"])) for lg in logs],
      "in_table_at_end": counts,
      "mean_policy_lag_at_insert": float(lags.mean()) if lags.size else 0.0,
      "mean_staleness_trained": out["stale_sum"] / max(out["stale_n"], 1),
      "table_stats": stats, "evicted_stale_total": out["evicted_stale"],
      "final_mean_reward": float(np.mean([m["mean_reward"] for m in out["steps"][-10:]])),
      "wall_s": round(wall, 2), "seed": int(config.seed),
  }
  assert stats["inserts"] == int(inserted.sum()), (stats["inserts"], int(inserted.sum()))
  assert stats["size"] + stats["deletes"] + stats["evicted_capacity"] + stats["evicted_stale"] \
      + stats["evicted_reuse"] == stats["inserts"]
  summary["plot"] = common.plot_metric(workdir, "mean_reward",
                                       "async_rollouts_ray: mean reward per learner step")
  common.write_json(os.path.join(workdir, "summary.json"), summary)
  log("inserted per producer: " + ", ".join(map(str, summary["inserted_per_producer"])))
  log("inserted (task: ok/truncated/failed): " + ", ".join(
      f"{tasks[t]} {'/'.join(str(int(x)) for x in inserted[t])}" for t in range(k)))
  log("in table at end: " + ", ".join(
      f"{tasks[t]} {'/'.join(str(counts[tasks[t]][s]) for s in STATUS)}" for t in range(k)))
  log(f"async_rollouts_ray summary: {summary['learner_steps']} learner steps, mean policy lag "
      f"at insert {summary['mean_policy_lag_at_insert']:.2f}, mean staleness trained "
      f"{summary['mean_staleness_trained']:.2f}, evicted stale {stats['evicted_stale']}, reuse "
      f"{stats['evicted_reuse']}, capacity {stats['evicted_capacity']}, mean reuse at eviction "
      f"{stats['mean_reuse_at_eviction']:.2f}, wall {wall:.1f} s (cpu of the driver {cpu:.1f} s)")
  if started_ray:
    ray.shutdown()
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("pass --config=configs/async_rollouts_ray.py")
  run(_CONFIG.value, _WORKDIR.value, address=_ADDRESS.value)


if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "ml_collections config file (configs/async_rollouts_ray.py[:tiny|:full]).")
  _WORKDIR = flags.DEFINE_string("workdir", "runs/async_rollouts_ray", "where metrics go")
  _ADDRESS = flags.DEFINE_string("address", None, "Ray cluster address ('auto': the running "
                                 "cluster); default: start a local one")
  app.run(main)
