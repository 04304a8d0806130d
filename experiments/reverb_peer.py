"""Reverb's side of ``bench_ray.py``: run in a Python that has ``dm-reverb`` (and TensorFlow).

Not imported by funcreplay; ``bench_ray.py`` runs it as a subprocess with
``--reverb_python`` (e.g. a separate venv: ``python3 -m venv /work/venv-reverb &&
/work/venv-reverb/bin/pip install dm-reverb==0.14.0 tensorflow==2.15.1``) and reads
the JSON it prints on its last line.

Measures, on one local ``reverb.Server`` (Uniform sampler, Fifo remover, ``MinSize(1)``,
capacity ``--capacity``, the 524-byte transition of the other benchmarks, with a
table signature):

* ingestion: ``--producers`` processes (spawned; each its own ``reverb.Client``), started
  together after a barrier, each inserting ``--items`` single transitions with
  ``client.insert(item, {table: 1.0})`` (one gRPC call per item) or with a
  ``TrajectoryWriter`` (``append`` + ``create_item`` of the last step per item, the
  writer's own batching and streaming; ``flush`` at the end). Items/s from the first
  start to the last producer's end (all items in the table);
* sampling from a full table: the latency of ``list(client.sample(table, 256))`` (one
  batch of 256, blocking) and the throughput of a ``TrajectoryDataset``
  (``from_table_signature``, ``max_in_flight_samples_per_worker=2 * 256``,
  ``batch(256).prefetch(--prefetch)``), every field consumed.
"""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

OBS = 64
# TrajectoryWriter: flush every this many items, keeping at most this many unconfirmed
# (Reverb warns about, and may run out of memory with, unbounded pending items).
FLUSH_EVERY = 128
MAX_IN_FLIGHT_ITEMS = 512


def transition(i):
  import numpy as np
  return {"obs": np.full((OBS,), i, np.float32), "action": np.int32(i % 4),
          "reward": np.float32(1.0), "discount": np.float32(0.99),
          "next_obs": np.full((OBS,), i + 1, np.float32)}


def signature():
  import tensorflow as tf
  return {"obs": tf.TensorSpec([OBS], tf.float32), "action": tf.TensorSpec([], tf.int32),
          "reward": tf.TensorSpec([], tf.float32), "discount": tf.TensorSpec([], tf.float32),
          "next_obs": tf.TensorSpec([OBS], tf.float32)}


def producer(address, mode, n, barrier, out):
  import reverb
  client = reverb.Client(address)
  items = [transition(i) for i in range(256)]
  barrier.wait()
  t0 = time.time()
  if mode == "insert":
    for i in range(n):
      client.insert(items[i % 256], {"t": 1.0})
  else:
    with client.trajectory_writer(num_keep_alive_refs=1) as w:
      for i in range(n):
        w.append(items[i % 256])
        w.create_item("t", 1.0, {k: col[-1] for k, col in w.history.items()})
        if i % FLUSH_EVERY == FLUSH_EVERY - 1:  # Acme's adders bound the unconfirmed items
          w.flush(block_until_num_items=MAX_IN_FLIGHT_ITEMS)
      w.flush()
  out.put((t0, time.time()))


def ingest(address, mode, producers, n):
  ctx = mp.get_context("spawn")
  barrier, out = ctx.Barrier(producers), ctx.Queue()
  ps = [ctx.Process(target=producer, args=(address, mode, n, barrier, out))
        for _ in range(producers)]
  for p in ps:
    p.start()
  times = [out.get(timeout=600) for _ in ps]
  for p in ps:
    p.join(60)
  t0, t1 = min(t for t, _ in times), max(t for _, t in times)
  return producers * n / (t1 - t0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--producers", type=int, default=4)
  ap.add_argument("--items", type=int, default=5000, help="items per producer")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--capacity", type=int, default=1 << 17)
  ap.add_argument("--sample_calls", type=int, default=50)
  ap.add_argument("--dataset_batches", type=int, default=200)
  ap.add_argument("--prefetch", type=int, default=4)
  args = ap.parse_args()
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import numpy as np
  import reverb
  import tensorflow as tf

  def server():
    return reverb.Server(tables=[reverb.Table(
        "t", reverb.selectors.Uniform(), reverb.selectors.Fifo(), args.capacity,
        reverb.rate_limiters.MinSize(1), signature=signature())])

  res = {"insert": [], "trajectory_writer": [], "reverb_version": getattr(reverb, "__version__",
                                                                           "0.14.0"),
         "tensorflow_version": tf.__version__}
  for _ in range(args.rounds):
    for mode in ("insert", "trajectory_writer"):
      s = server()
      res[mode].append(ingest(f"localhost:{s.port}", mode, args.producers, args.items))
      s.stop()
  # Sampling from a full table.
  s = server()
  address = f"localhost:{s.port}"
  client = reverb.Client(address)
  with client.trajectory_writer(num_keep_alive_refs=1) as w:
    for i in range(args.capacity):
      w.append(transition(i))
      w.create_item("t", 1.0, {k: col[-1] for k, col in w.history.items()})
      if i % 4096 == 4095:
        w.flush()
    w.flush()
  lat = []
  for _ in range(args.sample_calls):
    t = time.perf_counter()
    got = list(client.sample("t", num_samples=256, emit_timesteps=False))
    lat.append(time.perf_counter() - t)
    assert len(got) == 256
  res["sample_latency_s"] = statistics.median(lat)
  ds = reverb.TrajectoryDataset.from_table_signature(
      server_address=address, table="t", max_in_flight_samples_per_worker=2 * 256)
  ds = ds.batch(256).prefetch(args.prefetch)
  it = iter(ds)
  total = 0.0
  for _ in range(5):
    next(it)
  t = time.perf_counter()
  for _ in range(args.dataset_batches):
    b = next(it)
    total += float(sum(tf.reduce_sum(tf.cast(x, tf.float32)) for x in tf.nest.flatten(b.data)))
    total += float(tf.reduce_sum(tf.cast(b.info.key, tf.float32)))
  res["dataset_batches_per_s"] = args.dataset_batches / (time.perf_counter() - t)
  res["checksum"] = total
  s.stop()
  del np
  print(json.dumps(res))
  sys.stdout.flush()


if __name__ == "__main__":
  main()
