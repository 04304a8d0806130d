"""Async GRPO with rollout groups on the host ``Table`` (issue 28).

A tiny policy (per-task logits over a small vocabulary) is trained with GRPO from
groups of ``G`` responses that producer threads generate with lagging weights:

* a dispatcher queues ``G`` work items per prompt; ``num_producers`` threads take them,
  so the responses of one group come from different producers (and policy versions);
  each response goes to an ``fr.GroupWriter`` by group id, which inserts the group as
  one item when its G-th response arrives (or, when a response was lost, at
  ``group_timeout_s`` with a mask and status "aborted");
* an item holds the group's tokens and log-probs as ``fr.Ragged`` leaves (no padding:
  lengths are uniform in [min_len, max_len]), per-response lengths, rewards and mask;
  metadata ``task`` / ``status`` are vocabulary columns, ``prompt`` a plain one;
* the learner takes one multi-task batch per step in one call,
  ``take_batch({task: n, ...}, where={"status": "completed"}, consume=False)``,
  stalest first (``fr.StalestFirst``), each group at most ``max_times_sampled`` times
  (N) and at most ``max_staleness`` versions old (k); after each update it bumps its
  version and re-queues the prompts of the groups ``evict_stale(receipt=True)``
  removed (their receipt carries the prompt ids).

Printed: per-task counts (``count_by``), mean reward, staleness and reuse of what was
trained on, and memory per stored token of the ragged leaves vs their payload (and vs
padding to ``max_len``). Written: ``metrics.jsonl``, ``summary.json`` under ``--workdir``.

  python experiments/async_grpo.py --config=configs/async_grpo.py --workdir=runs/async_grpo

Threads run free: counts vary a little from run to run.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from typing import List

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments import common  # noqa: E402

STATUS = ("completed", "aborted", "expired")


def make_spec(config) -> fr.TableSpec:
  g, cap = config.group_size, config.group_size * config.max_len
  sig = {"tokens": fr.Ragged(cap, jnp.int32), "logp": fr.Ragged(cap, jnp.float32),
         "tokens_lengths": jax.ShapeDtypeStruct((g,), jnp.int32),
         "reward": jax.ShapeDtypeStruct((g,), jnp.float32),
         "mask": jax.ShapeDtypeStruct((g,), bool)}
  return fr.TableSpec(config.capacity, sig, sampler=fr.StalestFirst(),
                      max_staleness=config.max_staleness,
                      max_times_sampled=config.max_times_sampled,
                      metadata=(fr.Column("task", vocab=tuple(config.tasks)),
                                fr.Column("status", vocab=STATUS), "prompt"))


class Weights:
  """The learner's published policy: (version, logits [tasks, vocab]) under a lock."""

  def __init__(self, logits):
    self._lock = threading.Lock()
    self._value = (0, np.asarray(logits))

  def publish(self, version, logits):
    with self._lock:
      self._value = (version, np.asarray(logits))

  def get(self):
    with self._lock:
      return self._value


def respond(rng, logits, task: int, config):
  """One response: tokens ~ softmax(logits[task]), its log-probs and reward (the share of
  the task's target token, ``task % vocab``)."""
  z = logits[task] - logits[task].max()
  logp = z - np.log(np.exp(z).sum())
  n = int(rng.integers(config.min_len, config.max_len + 1))
  tokens = rng.choice(config.vocab, size=n, p=np.exp(logp)).astype(np.int32)
  reward = np.float32(np.mean(tokens == task % config.vocab))
  return {"tokens": tokens, "logp": logp[tokens].astype(np.float32), "reward": reward}


@jax.jit
def grpo_step(logits, tokens, task_ids, old_logp, adv, mask, lr, clip):
  """One clipped policy-gradient step on the logits; token arrays are [T] (padded, mask)."""

  def loss_fn(lg):
    new = jax.nn.log_softmax(lg, axis=-1)[task_ids, tokens]
    ratio = jnp.exp(new - old_logp)
    obj = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip, 1 + clip) * adv)
    return -jnp.sum(mask * obj) / jnp.maximum(jnp.sum(mask), 1.0)

  loss, grad = jax.value_and_grad(loss_fn)(logits)
  return logits - lr * grad, loss


def batch_arrays(batch: dict, tasks, min_bucket: int = 1024):
  """Token arrays of a multi-task batch: group-normalised advantages per token."""
  toks, tids, logps, advs = [], [], [], []
  for t, name in enumerate(tasks):
    s = batch[name]
    lengths, reward = s.data["tokens_lengths"], s.data["reward"]
    adv = (reward - reward.mean(1, keepdims=True)) / (reward.std(1, keepdims=True) + 1e-6)
    toks.append(s.data["tokens"].values)
    logps.append(s.data["logp"].values)
    advs.append(np.repeat(adv.reshape(-1), lengths.reshape(-1)))
    tids.append(np.full(s.data["tokens"].values.shape[0], t, np.int32))
  toks, tids, logps, advs = (np.concatenate(x) for x in (toks, tids, logps, advs))
  n = toks.shape[0]
  size = max(min_bucket, 1 << (n - 1).bit_length())  # few shapes: few compilations

  def pad(x):
    return np.concatenate([x, np.zeros(size - n, x.dtype)])

  return (pad(toks), pad(tids), pad(logps), pad(advs.astype(np.float32)),
          pad(np.ones(n, np.float32)))


def run(config, workdir: str, verbose: bool = True) -> dict:
  """Producers + dispatcher + learner per ``config``; returns (and writes) the summary."""
  tasks = tuple(config.tasks)
  log = print if verbose else logging.info
  timer = common.Timer()
  spec = make_spec(config)
  table = fr.Table(spec, seed=config.seed)
  writer = fr.GroupWriter(table, config.group_size, timeout_s=config.group_timeout_s,
                          poll_s=0.02)
  weights = Weights(np.zeros((len(tasks), config.vocab), np.float32))
  work: queue.Queue = queue.Queue(maxsize=4 * config.group_size * config.num_producers)
  requeue: queue.Queue = queue.Queue()
  stop = threading.Event()
  errors: List[BaseException] = []
  seeds = np.random.SeedSequence(config.seed).spawn(config.num_producers + 1)
  dropped = [0]

  def guarded(fn):
    def body(*a):
      try:
        fn(*a)
      except BaseException as e:  # noqa: BLE001 (surfaced by the learner)
        errors.append(e)
        stop.set()
    return body

  @guarded
  def dispatcher():
    rng = np.random.default_rng(seeds[-1])
    gid = 0
    while not stop.is_set():
      try:
        prompt, task = requeue.get_nowait()
      except queue.Empty:
        prompt, task = gid, int(rng.integers(len(tasks)))
      for i in range(config.group_size):
        while not stop.is_set():
          try:
            work.put((gid, prompt, task, i), timeout=0.1)
            break
          except queue.Full:
            pass
      gid += 1

  @guarded
  def producer(p: int):
    rng = np.random.default_rng(seeds[p])
    version, logits = weights.get()
    n = 0
    while not stop.is_set():
      try:
        gid, prompt, task, _ = work.get(timeout=0.1)
      except queue.Empty:
        continue
      if n % config.sync_every == 0:  # weight refresh: between refreshes the policy lags
        version, logits = weights.get()
      n += 1
      if rng.random() < config.drop_prob:
        dropped[0] += 1
        continue
      writer.add(gid, respond(rng, logits, task, config), version=version,
                 metadata={"task": tasks[task], "prompt": prompt})

  threads = [threading.Thread(target=producer, args=(p,), daemon=True)
             for p in range(config.num_producers)]
  threads.append(threading.Thread(target=dispatcher, daemon=True))
  for th in threads:
    th.start()
  counts = dict(zip(tasks, config.batch_groups, strict=True))
  logits = jnp.zeros((len(tasks), config.vocab), jnp.float32)
  staleness, reuse, rewards, requeued = [], [], [], 0
  mem, size_end = {}, 0
  try:
    with common.MetricsWriter(workdir) as metrics:
      for version in range(config.learner_steps):
        if errors:
          raise errors[0]
        batch = table.take_batch(counts, where={"status": "completed"}, consume=False,
                                 ragged="packed", timeout=config.ready_timeout_s)
        logits, loss = grpo_step(logits, *batch_arrays(batch, tasks), config.learning_rate,
                                 config.clip)
        st = np.concatenate([version - b.info.version for b in batch.values()])
        ru = np.concatenate([b.info.times_sampled for b in batch.values()])
        rw = {t: float(b.data["reward"].mean()) for t, b in batch.items()}
        staleness.append(st)
        reuse.append(ru)
        rewards.append(np.mean(list(rw.values())))
        table.set_version(version + 1)  # before the weights: no group is ahead of the table
        weights.publish(version + 1, logits)
        receipt = table.evict_stale(receipt=True)
        for prompt, task in zip(receipt.metadata["prompt"], receipt.metadata["task"]):
          requeue.put((int(prompt), tasks.index(task)))
        requeued += len(receipt)
        mem, size_end = table.ragged_memory(), len(table)
        per_token = {k.strip("[]'"): v["nbytes"] / max(v["live_bytes"], 1)
                     for k, v in mem.items()}
        metrics.write(version + 1, {"loss": loss, "mean_reward": rewards[-1],
                                    "staleness": float(st.mean()), "reuse": float(ru.mean()),
                                    "size": len(table), "requeued": len(receipt),
                                    **{f"bytes_per_token_{k}": v for k, v in per_token.items()}})
        if verbose and (version + 1) % max(1, config.learner_steps // 6) == 0:
          ready = table.count_by("task", tasks, where={"status": "completed"})
          per_task = ", ".join(f"{t} {r:.2f}" for t, r in rw.items())
          log(f"[v{version + 1:>4d}] reward {rewards[-1]:.3f} ({per_task})  staleness "
              f"{st.mean():.2f} (max {st.max()})  reuse {ru.mean():.2f} (max {ru.max()})  "
              f"ready {ready}  requeued {requeued}  memory/token "
              + " ".join(f"{k} {v:.3f}x" for k, v in per_token.items()))
  finally:
    stop.set()
    for th in threads:  # producers first: a closed writer refuses responses
      th.join(timeout=10)
    writer.close(flush=False)
    stats = table.stats().to_dict()
    wstats = writer.stats()
    final = {t: table.count_by("status", STATUS, where={"task": t}, include_stale=True)
             for t in tasks}
    table.close()
  if errors:
    raise errors[0]
  st, ru = np.concatenate(staleness), np.concatenate(reuse)
  g, itemsize = config.group_size, 4 + 4  # tokens int32 + log-probs float32
  live = sum(v["live_bytes"] for v in mem.values())
  held = sum(v["nbytes"] for v in mem.values())
  tokens_live = mem["['tokens']"]["live_values"] if mem else 0
  wall, cpu = timer.elapsed()
  summary = {
      "learner_steps": config.learner_steps, "tasks": list(tasks),
      "reward_first10": float(np.mean(rewards[:10])),
      "reward_last10": float(np.mean(rewards[-10:])),
      "staleness_mean": float(st.mean()), "staleness_max": int(st.max()),
      "reuse_mean": float(ru.mean()), "reuse_max": int(ru.max()),
      "max_staleness": config.max_staleness, "max_times_sampled": config.max_times_sampled,
      "requeued_prompts": requeued, "responses_dropped": dropped[0],
      "groups": {"complete": wstats.complete, "partial": wstats.partial, "late": wstats.late},
      "in_table_at_end": final,
      # bytes held per byte of stored tokens + log-probs: the arenas (buffer, offsets,
      # lengths) vs dense [G, max_len] leaves for the same groups
      "ragged_bytes_per_token": held / max(live, 1),
      "padded_bytes_per_token": size_end * g * config.max_len * itemsize / max(live, 1),
      "stored_tokens": int(tokens_live), "stored_groups": size_end,
      "table_stats": stats, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
  }
  summary["plot"] = common.plot_metric(workdir, "mean_reward", "async_grpo: mean reward per "
                                       "learner step")
  common.write_json(os.path.join(workdir, "summary.json"), summary)
  log(f"async_grpo summary: reward {summary['reward_first10']:.3f} -> "
      f"{summary['reward_last10']:.3f}; staleness mean {st.mean():.2f} max {st.max()} "
      f"(k={config.max_staleness}); reuse mean {ru.mean():.2f} max {ru.max()} "
      f"(N={config.max_times_sampled}); groups {wstats.complete} complete / {wstats.partial} "
      f"partial; {requeued} prompts re-queued; ragged leaves hold "
      f"{summary['ragged_bytes_per_token']:.3f} bytes per stored byte (padded to max_len: "
      f"{summary['padded_bytes_per_token']:.2f}); wall {wall:.1f} s")
  log("at end (task: completed/aborted/expired): " + ", ".join(
      f"{t} {'/'.join(str(final[t][s]) for s in STATUS)}" for t in tasks))
  return summary


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _CONFIG.value is None:
    raise app.UsageError("pass --config=configs/async_grpo.py")
  run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file(
      "config", None, "ml_collections config file (configs/async_grpo.py[:tiny]).")
  _WORKDIR = flags.DEFINE_string("workdir", "runs/async_grpo", "where metrics go")
  app.run(main)
