"""funcreplay.ray against a naive Ray actor and Reverb's own client, in the same run.

Ingestion: ``--producers`` producer *processes* (Ray actors; Reverb: spawned processes
with their own ``reverb.Client``), started together, each putting ``--items`` single
524-byte transitions (obs float32[64], action int32, reward float32, discount float32,
next_obs float32[64]); items/s from the first start to the last producer's end, when
every item is in the table (the writers' ``close`` waits for the acknowledgements):

* funcreplay.ray: ``RemoteTable.writer(batch_size, max_wait_s, max_in_flight)`` and one
  ``put`` per item (validated in the producer, batched locally, numpy batches through
  Ray's object store into the actor's host ``Table``);
* naive: a plain Ray actor holding a Python list, ``add.remote(item)`` per item (the
  producer waits for its calls every 256, i.e. pipelined, the fast way to use it);
* Reverb 0.14 (``experiments/reverb_peer.py`` run with ``--reverb_python``, a separate
  venv with dm-reverb and TensorFlow): ``client.insert`` per item, and a
  ``TrajectoryWriter`` (``append`` + ``create_item`` per item, flushed every 128).

Sampling from a full table of ``--capacity`` items: the latency of one blocking remote
``sample(256)`` (returning numpy arrays) and the batches/s of ``Prefetcher`` (k calls
in flight) and of ``funcreplay.torch.RemoteTorchSampler``, every field consumed; Reverb:
``list(client.sample(table, 256))`` latency and a ``TrajectoryDataset.batch(256)`` with
``prefetch``.

funcreplay rounds run before and after the Reverb subprocess (whose rounds run inside
it); medians are reported, and ratios of medians. A shared, loaded 2-core machine
moves these numbers by tens of percent: the JSON keeps every round.

  python experiments/bench_ray.py --reverb_python=/work/venv-reverb/bin/python
"""

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
import funcreplay.ray as frr  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("producers", 4, "producer processes")
flags.DEFINE_integer("items", 50_000, "items per funcreplay producer per round")
flags.DEFINE_integer("naive_items", 2_000, "items per naive-actor producer per round")
flags.DEFINE_integer("reverb_items", 5_000, "items per Reverb producer per round")
flags.DEFINE_integer("rounds", 3, "rounds per system (funcreplay: this many before and after "
                     "Reverb)")
flags.DEFINE_integer("batch_size", 2048, "RemoteWriter batch_size")
flags.DEFINE_integer("max_in_flight", 4, "RemoteWriter max_in_flight")
flags.DEFINE_float("max_wait_s", 0.05, "RemoteWriter max_wait_s")
flags.DEFINE_integer("capacity", 1 << 17, "table capacity")
flags.DEFINE_integer("sample_calls", 100, "remote sample(256) calls for the latency")
flags.DEFINE_integer("prefetch_batches", 300, "batches for the prefetch throughput")
flags.DEFINE_integer("prefetch", 4, "samples in flight")
flags.DEFINE_string("reverb_python", "/work/venv-reverb/bin/python",
                    "a Python with dm-reverb + tensorflow ('' = skip Reverb)")
flags.DEFINE_string("out", "results/bench_ray.json", "JSON output ('' = none)")

OBS = 64
START_DELAY_S = 1.0  # producers start together this long after the call (all are alive)


def make_items(n: int = 256):
  rng = np.random.default_rng(0)
  return [dict(obs=rng.standard_normal(OBS, dtype=np.float32), action=np.int32(i % 7),
               reward=np.float32(rng.standard_normal()), discount=np.float32(0.99),
               next_obs=rng.standard_normal(OBS, dtype=np.float32)) for i in range(n)]


def wait_until(t: float) -> None:
  while time.time() < t:
    time.sleep(min(0.001, max(0.0, t - time.time())))


def actors():
  """The benchmark's Ray actor classes (defined after ``ray`` is imported)."""
  import ray

  @ray.remote(num_cpus=0)
  class FrProducer:
    def __init__(self, table, batch_size, max_in_flight, max_wait_s):
      self.table, self.items = table, make_items()
      self.kw = dict(batch_size=batch_size, max_in_flight=max_in_flight, max_wait_s=max_wait_s)
      with table.writer(**self.kw) as w:  # warm: imports, the item checker, one round trip
        for it in self.items[:8]:
          w.put(it)

    def run(self, start_at: float, n: int):
      items = self.items
      wait_until(start_at)
      t0 = time.time()
      with self.table.writer(**self.kw) as w:
        for i in range(n):
          w.put(items[i & 255])
      return t0, time.time(), w.stats().inserted

  @ray.remote(num_cpus=0)
  class ListActor:
    def __init__(self):
      self.items = []

    def add(self, item):
      self.items.append(item)

    def size(self):
      return len(self.items)

  @ray.remote(num_cpus=0)
  class NaiveProducer:
    def __init__(self, target):
      self.target, self.items = target, make_items()
      ray.get(self.target.add.remote(self.items[0]))

    def run(self, start_at: float, n: int):
      items, refs = self.items, []
      wait_until(start_at)
      t0 = time.time()
      for i in range(n):
        refs.append(self.target.add.remote(items[i & 255]))
        if len(refs) == 256:
          ray.get(refs)
          refs = []
      ray.get(refs)
      return t0, time.time(), n

  return FrProducer, ListActor, NaiveProducer


def rate(results) -> float:
  t0 = min(r[0] for r in results)
  t1 = max(r[1] for r in results)
  return sum(r[2] for r in results) / (t1 - t0)


def spec():
  return fr.TableSpec(FLAGS.capacity, make_items(1)[0])


def warm(table, batch_size: int) -> int:
  """In the actor: compile every insert bucket a writer's batches may hit."""
  ing = table.ingestor(batch_size=batch_size)
  try:
    return ing.warmup()
  finally:
    ing.close()


def fr_ingest_round(FrProducer, name: str) -> float:
  import ray
  rt = frr.connect(name, spec(), num_cpus=0)
  # Compile every insert bucket first (partial batches are padded to powers of two).
  rt.run(warm, FLAGS.batch_size)
  ps = [FrProducer.remote(rt, FLAGS.batch_size, FLAGS.max_in_flight, FLAGS.max_wait_s)
        for _ in range(FLAGS.producers)]
  start = time.time() + START_DELAY_S + 0.5 * FLAGS.producers
  res = ray.get([p.run.remote(start, FLAGS.items) for p in ps], timeout=600)
  st = rt.stats()
  want = FLAGS.producers * (FLAGS.items + 8)
  assert st["inserts"] == want, (st["inserts"], want)
  for p in ps:
    ray.kill(p)
  rt.close()
  return rate(res)


def naive_round(ListActor, NaiveProducer) -> float:
  import ray
  target = ListActor.remote()
  ps = [NaiveProducer.remote(target) for _ in range(FLAGS.producers)]
  ray.get([p.__ray_ready__.remote() for p in ps], timeout=600)
  start = time.time() + START_DELAY_S
  res = ray.get([p.run.remote(start, FLAGS.naive_items) for p in ps], timeout=600)
  assert ray.get(target.size.remote()) == FLAGS.producers * (FLAGS.naive_items + 1)
  for a in ps + [target]:
    ray.kill(a)
  return rate(res)


def consume(smp) -> float:
  """Reads every sampled field (the data leaves and the info columns)."""
  total = sum(float(np.asarray(x, np.float64).sum()) for x in
              [*smp.data.values(), smp.valid, smp.info.slot, smp.info.key,
               smp.info.probability, smp.info.times_sampled])
  return total


def fr_sampling(name: str) -> dict:
  import torch

  import funcreplay.torch as frt
  rt = frr.connect(name, spec(), num_cpus=0)
  items = make_items(8192)
  chunk = {k: np.stack([it[k] for it in items]) for k in items[0]}
  for _ in range(FLAGS.capacity // 8192):
    rt.insert(chunk)
  assert rt.size == FLAGS.capacity
  for _ in range(10):
    rt.sample(256, timeout=60)
  lat = []
  chk = 0.0
  for _ in range(FLAGS.sample_calls):
    t = time.perf_counter()
    smp = rt.sample(256, timeout=60)
    lat.append(time.perf_counter() - t)
    chk += consume(smp)
  out = {"sample_latency_s": statistics.median(lat)}
  for k in (1, FLAGS.prefetch):
    it = rt.prefetch(256, prefetch=k, max_batches=FLAGS.prefetch_batches + 5)
    for _ in range(5):
      next(it)
    t = time.perf_counter()
    for smp in it:
      chk += consume(smp)
    out[f"prefetch{k}_batches_per_s"] = FLAGS.prefetch_batches / (time.perf_counter() - t)
  sampler = frt.RemoteTorchSampler(rt, 256, prefetch=FLAGS.prefetch,
                                   num_batches=FLAGS.prefetch_batches + 5)
  for _ in range(5):
    next(sampler)
  t = time.perf_counter()
  for b in sampler:
    chk += float(sum(x.double().sum() for x in b.data.values()) + b.info.key.double().sum())
  out["torch_prefetch_batches_per_s"] = FLAGS.prefetch_batches / (time.perf_counter() - t)
  out["checksum"] = chk
  del torch
  rt.close()
  return out


def run_reverb() -> dict:
  if not FLAGS.reverb_python:
    return {"skipped": "no --reverb_python"}
  if not os.path.exists(FLAGS.reverb_python):
    return {"skipped": f"{FLAGS.reverb_python} does not exist (see reverb_peer.py's doc)"}
  peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reverb_peer.py")
  cmd = [FLAGS.reverb_python, peer, f"--producers={FLAGS.producers}",
         f"--items={FLAGS.reverb_items}", f"--rounds={FLAGS.rounds}",
         f"--capacity={FLAGS.capacity}", f"--prefetch={FLAGS.prefetch}",
         f"--dataset_batches={FLAGS.prefetch_batches}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
  env.pop("PYTHONPATH", None)
  p = subprocess.run(cmd, capture_output=True, text=True, timeout=3000, env=env)
  if p.returncode != 0:
    return {"error": p.stderr[-3000:]}
  return json.loads(p.stdout.strip().splitlines()[-1])


def main(_):
  import ray
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  ray.init(num_cpus=FLAGS.producers + 2, include_dashboard=False, log_to_driver=False)
  FrProducer, ListActor, NaiveProducer = actors()
  load = [os.getloadavg()]
  res = {"funcreplay": [], "naive": []}
  for r in range(FLAGS.rounds):
    res["funcreplay"].append(fr_ingest_round(FrProducer, f"bench{r}"))
    res["naive"].append(naive_round(ListActor, NaiveProducer))
    print(f"round {r}: funcreplay {res['funcreplay'][-1]:,.0f} items/s, naive actor "
          f"{res['naive'][-1]:,.0f} items/s", flush=True)
  sampling = [fr_sampling("bench-sample0")]
  load.append(os.getloadavg())
  res["reverb"] = run_reverb()
  print("reverb:", {k: v for k, v in res["reverb"].items() if k != "error"},
        res["reverb"].get("error", ""), flush=True)
  load.append(os.getloadavg())
  for r in range(FLAGS.rounds):
    res["funcreplay"].append(fr_ingest_round(FrProducer, f"bench-b{r}"))
    print(f"round {FLAGS.rounds + r}: funcreplay {res['funcreplay'][-1]:,.0f} items/s",
          flush=True)
  sampling.append(fr_sampling("bench-sample1"))
  load.append(os.getloadavg())
  med = statistics.median
  summary = {"funcreplay_items_per_s": med(res["funcreplay"]),
             "naive_items_per_s": med(res["naive"])}
  summary["vs_naive"] = summary["funcreplay_items_per_s"] / summary["naive_items_per_s"]
  for k in ("sample_latency_s", "prefetch1_batches_per_s",
            f"prefetch{FLAGS.prefetch}_batches_per_s", "torch_prefetch_batches_per_s"):
    summary[k] = med([s[k] for s in sampling])
  rv = res["reverb"]
  if "insert" in rv:
    for mode in ("insert", "trajectory_writer"):
      summary[f"reverb_{mode}_items_per_s"] = med(rv[mode])
      summary[f"vs_reverb_{mode}"] = summary["funcreplay_items_per_s"] / med(rv[mode])
    summary["reverb_sample_latency_s"] = rv["sample_latency_s"]
    summary["reverb_dataset_batches_per_s"] = rv["dataset_batches_per_s"]
    summary["sample_latency_vs_reverb"] = rv["sample_latency_s"] / summary["sample_latency_s"]
    summary["prefetch_vs_reverb_dataset"] = (
        summary[f"prefetch{FLAGS.prefetch}_batches_per_s"] / rv["dataset_batches_per_s"])
  res.update(summary=summary, sampling=sampling, loadavg=load,
             flags={k: FLAGS[k].value for k in ("producers", "items", "naive_items",
                                                 "reverb_items", "rounds", "batch_size",
                                                 "max_in_flight", "max_wait_s", "capacity",
                                                 "prefetch")})
  for k, v in summary.items():
    print(f"{k:>36}: {v:,.6g}")
  if FLAGS.out:
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump(res, f, indent=1)
  ray.shutdown()


if __name__ == "__main__":
  app.run(main)
