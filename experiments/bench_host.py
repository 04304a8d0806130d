"""Host ingestion throughput and host sample latency: ``Ingestor -> Table`` vs cpprb.

Producers are threads that each put **one item per call** (a 524-byte
transition: obs float32[64], action int32, reward float32, discount float32,
next_obs float32[64]) until ``--items`` items are in:

* funcreplay: ``Ingestor.put(item)`` from every thread; the time runs until
  ``flush()`` returns, i.e. until every item is in the table (end to end).
  Runs are whole batches and ``max_wait_s=1``, so every insert is one full
  ``batch_size`` batch (one compiled bucket; nothing compiles while timed);
* cpprb: ``ReplayBuffer.add(**item)`` from every thread under one
  ``threading.Lock`` (cpprb's ``ReplayBuffer`` is not thread-safe), and with
  one thread also without the lock;
* Reverb: measured if ``import reverb`` works (it needs TensorFlow; on this
  project's machines it is not installed and the run says so).

Then the latency of one ``Table.sample(256)`` (uniform, full table, until the
batch is ready; a jitted call returning JAX arrays) and of one
``Table.sample_packed(256, out=np.empty(...))`` (the same draw written in place
into a fresh numpy buffer without a jitted call, ``funcreplay.host.direct``)
against cpprb ``sample(256)`` (a dict of fresh numpy arrays). And prioritized
sampling with a priority write-back, each side through its host API on a full
table of ``--capacity`` items (``Prioritized``): ``sample_packed(256, out=...)``
+ ``update_priorities`` (both in place) against cpprb's
``PrioritizedReplayBuffer.sample`` + ``update_priorities``.

Configurations are measured round-robin (``--repeats`` rounds, the order of
the two systems alternating), and the median is reported. Each ingestion row
also reports the process CPU time per item (all threads, XLA's included):
on a shared, loaded machine it is steadier than wall-clock throughput.

  python experiments/bench_host.py --threads=1,4,8 --items=400000 --out=results/bench_host.json
"""

import json
import os
import sys
import threading
import time

import jax
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from funcreplay import Table  # noqa: E402
from funcreplay.core import packing  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("threads", "1,4,8", "comma-separated producer thread counts")
flags.DEFINE_integer("items", 96 * 4096, "items per ingestion measurement (all threads together; "
                     "a multiple of batch_size x every thread count)")
flags.DEFINE_integer("capacity", 1 << 17, "table / buffer capacity (items)")
flags.DEFINE_integer("batch_size", 4096, "Ingestor batch size")
flags.DEFINE_integer("repeats", 5, "measurement rounds; the median is reported")
flags.DEFINE_integer("sample_calls", 200, "sample(256) calls per latency measurement")
flags.DEFINE_string("out", "results/bench_host.json", "JSON output ('' = none)")

OBS = 64
NOTES: list = []  # lines the benchmark driver prints with this section


def make_items(n: int = 1024):
  """``n`` distinct transitions (producers cycle through them)."""
  rng = np.random.default_rng(0)
  return [dict(obs=rng.standard_normal(OBS, dtype=np.float32), action=np.int32(i % 7),
               reward=np.float32(rng.standard_normal()), discount=np.float32(0.99),
               next_obs=rng.standard_normal(OBS, dtype=np.float32)) for i in range(n)]


def item_bytes(item) -> int:
  return sum(np.asarray(v).nbytes for v in item.values())


def _run_threads(n_threads: int, per_thread: int, fn):
  """Run ``fn(per_thread)`` in ``n_threads`` threads started together.

  Returns ``(wall, cpu)``: ``time.perf_counter()`` and ``time.process_time()``
  (CPU seconds of every thread of the process, XLA's included) at the start.
  """
  barrier = threading.Barrier(n_threads + 1)
  errors = []

  def target():
    barrier.wait()
    try:
      fn(per_thread)
    except Exception as e:  # noqa: BLE001 (re-raised below)
      errors.append(e)

  ths = [threading.Thread(target=target, daemon=True) for _ in range(n_threads)]
  for th in ths:
    th.start()
  barrier.wait()
  t0, c0 = time.perf_counter(), time.process_time()
  for th in ths:
    th.join()
  if errors:
    raise errors[0]
  return t0, c0


class Funcreplay:
  name = "funcreplay Ingestor.put -> Table"

  def __init__(self, items, capacity, batch_size):
    self.items = items
    self.table = Table(fr.TableSpec(capacity, items[0]))
    self.batch_size = min(batch_size, capacity)
    # Runs put multiples of batch_size items and max_wait_s is long, so every
    # insert is a full batch: one compiled bucket, compiled here, not timed.
    k = self.batch_size
    self.table.insert({key: np.stack([items[i % len(items)][key] for i in range(k)])
                       for key in items[0]})
    jax.block_until_ready(self.table.sample(256).data)

  def ingest(self, n_threads, total):
    items = self.items
    per = total // n_threads
    assert per * n_threads % self.batch_size == 0, "runs must be whole batches"
    with self.table.ingestor(batch_size=self.batch_size, max_wait_s=1.0) as ing:
      put = ing.put

      def produce(count):
        m = len(items)
        for i in range(count):
          put(items[i % m])

      t0, c0 = _run_threads(n_threads, per, produce)
      t_put = time.perf_counter() - t0
      ing.flush()
      t_all, cpu = time.perf_counter() - t0, time.process_time() - c0
      assert ing.stats().inserted == per * n_threads
    n = per * n_threads
    return n / t_all, n / t_put, cpu / n

  def sample_latency(self, calls):
    t = self.table
    times = []
    for _ in range(calls):
      t0 = time.perf_counter()
      jax.block_until_ready(t.sample(256).data)
      times.append(time.perf_counter() - t0)
    return float(np.median(times))

  def sample_into_latency(self, calls):
    """``sample_packed(256, out=fresh numpy buffer)``: the host-side API (in place, no jit)."""
    t = self.table
    n = packing.layout(t.spec.signature, 256).nbytes
    times = []
    for _ in range(calls):
      t0 = time.perf_counter()
      t.sample_packed(256, out=np.empty(n, np.uint8))
      times.append(time.perf_counter() - t0)
    return float(np.median(times))


class Prioritized:
  """Prioritized ``sample(256)`` + priority write-back through each side's host API, on two
  full tables of ``capacity`` items (alpha 0.6; importance weights with beta 0.4; each
  writes back ``|reward| + 0.01`` of the batch it drew): ``Table.sample_packed(256,
  out=...)`` + ``update_priorities`` (both in place, no jitted call) against cpprb
  ``PrioritizedReplayBuffer.sample`` + ``update_priorities``."""

  def __init__(self, items, capacity):
    import cpprb  # noqa: PLC0415 (optional peer)
    self.table = Table(fr.TableSpec(capacity, items[0], sampler=fr.Prioritized(0.6)))
    self.prb = cpprb.PrioritizedReplayBuffer(capacity, env_dict=_cpprb_env(), alpha=0.6)
    n = min(capacity, 4096)
    chunk = {key: np.stack([items[i % len(items)][key] for i in range(n)]) for key in items[0]}
    for _ in range(-(-capacity // n)):
      self.table.insert(chunk)
      self.prb.add(**chunk)
    self.out = np.empty(packing.layout(self.table.spec.signature, 256).nbytes, np.uint8)

  def ours(self):
    t = self.table
    smp = t.sample_packed(256, out=self.out).numpy()
    # Importance weights (beta 0.4), as cpprb's sample computes them (a learner's input).
    w = (np.maximum(smp.info.probability, 1e-30) * float(smp.num_eligible)) ** -0.4
    self.weights = np.where(smp.valid, w, 0.0) / w[smp.valid].max()
    t.update_priorities(smp.info.slot, smp.info.key, np.abs(smp.data["reward"]) + 0.01)

  def peer(self):
    smp = self.prb.sample(256, beta=0.4)
    self.prb.update_priorities(smp["indexes"], np.abs(smp["reward"]).reshape(-1) + 0.01)

  @staticmethod
  def latency(step, calls):
    step()  # warm up (first call binds / compiles)
    times = []
    for _ in range(calls):
      t0 = time.perf_counter()
      step()
      times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _cpprb_env():
  return dict(obs=dict(shape=OBS, dtype=np.float32), action=dict(dtype=np.int32),
              reward=dict(dtype=np.float32), discount=dict(dtype=np.float32),
              next_obs=dict(shape=OBS, dtype=np.float32))


class Cpprb:
  name = "cpprb ReplayBuffer.add (one lock)"

  def __init__(self, items, capacity):
    import cpprb  # noqa: PLC0415 (optional peer)
    self.rb = cpprb.ReplayBuffer(capacity, env_dict=_cpprb_env())
    self.items = items
    for it in items:
      self.rb.add(**it)

  def ingest(self, n_threads, total, locked=True):
    items, add = self.items, self.rb.add
    lock = threading.Lock()
    per = total // n_threads

    def produce(count):
      m = len(items)
      if locked:
        for i in range(count):
          with lock:
            add(**items[i % m])
      else:
        for i in range(count):
          add(**items[i % m])

    t0, c0 = _run_threads(n_threads, per, produce)
    n = per * n_threads
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n

  def sample_latency(self, calls):
    times = []
    for _ in range(calls):
      t0 = time.perf_counter()
      self.rb.sample(256)
      times.append(time.perf_counter() - t0)
    return float(np.median(times))


def reverb_status() -> str:
  try:
    import reverb  # noqa: F401, PLC0415
  except Exception as e:  # noqa: BLE001
    return f"Reverb not importable ({type(e).__name__}: {e}); skipped"
  return "Reverb importable but not wired into this benchmark; skipped"


def measure(threads, items_per_run, capacity, batch_size, repeats, sample_calls):
  """Raw medians: {("fr"|"cpprb"|"cpprb_nolock", n): items/s, ("fr_put", n): ..., latencies}."""
  items = make_items()
  frp, cp = Funcreplay(items, capacity, batch_size), Cpprb(items, capacity)
  prio = Prioritized(items, capacity)
  raw: dict = {}
  for r in range(repeats):
    for n in threads:
      order = [("fr", frp), ("cpprb", cp)]
      if r % 2:
        order.reverse()
      for key, sysm in order:
        if key == "fr":
          e2e, put_rate, cpu = sysm.ingest(n, items_per_run)
          raw.setdefault(("fr", n), []).append(e2e)
          raw.setdefault(("fr_put", n), []).append(put_rate)
          raw.setdefault(("fr_cpu", n), []).append(cpu)
        else:
          rate, cpu = sysm.ingest(n, items_per_run)
          raw.setdefault(("cpprb", n), []).append(rate)
          raw.setdefault(("cpprb_cpu", n), []).append(cpu)
    rate, cpu = cp.ingest(1, items_per_run, locked=False)
    raw.setdefault(("cpprb_nolock", 1), []).append(rate)
    raw.setdefault(("cpprb_nolock_cpu", 1), []).append(cpu)
    for key, sysm in ([("fr_sample", frp), ("cpprb_sample", cp)] if r % 2 == 0
                      else [("cpprb_sample", cp), ("fr_sample", frp)]):
      raw.setdefault(key, []).append(sysm.sample_latency(sample_calls))
      if key == "fr_sample":
        raw.setdefault("fr_sample_into", []).append(sysm.sample_into_latency(sample_calls))
    for key, step in ([("fr_prio", prio.ours), ("cpprb_prio", prio.peer)] if r % 2 == 0
                      else [("cpprb_prio", prio.peer), ("fr_prio", prio.ours)]):
      raw.setdefault(key, []).append(prio.latency(step, sample_calls))
  return {k: float(np.median(v)) for k, v in raw.items()}, item_bytes(items[0])


def rows_from(med, threads):
  rows = []
  for n in threads:
    ours, peer = med[("fr", n)], med[("cpprb", n)]
    rows.append(dict(section="host_ingest", case=f"{n} producer thread(s), 1 item per put",
                     funcreplay=ours, peer=peer, peer_name=Cpprb.name, unit="items/s",
                     ratio=ours / peer, funcreplay_put_only=med[("fr_put", n)],
                     funcreplay_cpu_us_per_item=med[("fr_cpu", n)] * 1e6,
                     peer_cpu_us_per_item=med[("cpprb_cpu", n)] * 1e6))
  ours, peer = med[("fr", 1)] if 1 in threads else None, med[("cpprb_nolock", 1)]
  if ours is not None:
    rows.append(dict(section="host_ingest", case="1 producer thread, 1 item per put (no lock)",
                     funcreplay=ours, peer=peer, peer_name="cpprb ReplayBuffer.add (no lock)",
                     unit="items/s", ratio=ours / peer,
                     funcreplay_cpu_us_per_item=med[("fr_cpu", 1)] * 1e6,
                     peer_cpu_us_per_item=med[("cpprb_nolock_cpu", 1)] * 1e6))
  ours, peer = med["fr_sample"], med["cpprb_sample"]
  rows.append(dict(section="host_sample", case="sample(256) latency, uniform, full table",
                   funcreplay=ours * 1e6, peer=peer * 1e6, peer_name="cpprb ReplayBuffer.sample",
                   unit="us", ratio=peer / ours))
  ours = med["fr_sample_into"]
  rows.append(dict(section="host_sample",
                   case="sample_packed(256, out=np.empty(...)) latency (in place, no jit)",
                   funcreplay=ours * 1e6, peer=peer * 1e6, peer_name="cpprb ReplayBuffer.sample",
                   unit="us", ratio=peer / ours))
  ours, peer = med["fr_prio"], med["cpprb_prio"]
  rows.append(dict(section="host_sample",
                   case="prioritized sample_packed(256, out=...) + update_priorities latency",
                   funcreplay=ours * 1e6, peer=peer * 1e6,
                   peer_name="cpprb PrioritizedReplayBuffer.sample + update_priorities",
                   unit="us", ratio=peer / ours))
  return rows


def run(small: bool) -> list:
  """The ``host`` section of ``experiments/benchmark.py`` (``small``: < ~60 s here)."""
  threads = [1, 4, 8]
  if small:
    med, _ = measure(threads, 16 * 1024, 1 << 14, 1024, 3, 50)
  else:
    med, _ = measure(threads, 96 * 4096, 1 << 17, 4096, 5, 200)
  NOTES[:] = [reverb_status(),
              "cpprb's ReplayBuffer is not thread-safe: its producers share one threading.Lock",
              f"1-minute load average during the run: {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} CPUs"]
  print("\n".join(NOTES))
  return rows_from(med, threads)


def main(_):
  threads = [int(x) for x in FLAGS.threads.split(",")]
  print(f"jax {jax.__version__} ({jax.devices()[0].platform}), {os.cpu_count()} CPUs, "
        f"{FLAGS.items} items per run, capacity {FLAGS.capacity}, Ingestor batch "
        f"{FLAGS.batch_size}, {FLAGS.repeats} rounds (median)")
  med, nbytes = measure(threads, FLAGS.items, FLAGS.capacity, FLAGS.batch_size, FLAGS.repeats,
                        FLAGS.sample_calls)
  print(f"item: {nbytes} bytes; 1-minute load average now {os.getloadavg()[0]:.1f} on "
        f"{os.cpu_count()} CPUs (other processes share them)")
  print(reverb_status())
  rows = rows_from(med, threads)
  print(f"{'section':>12} {'case':>45} {'funcreplay':>12} {'peer':>12} {'unit':>8} {'ratio':>7}")
  for r in rows:
    print(f"{r['section']:>12} {r['case']:>45} {r['funcreplay']:>12,.1f} {r['peer']:>12,.1f} "
          f"{r['unit']:>8} {r['ratio']:>7.2f}")
  for n in threads:
    print(f"  {n} thread(s): funcreplay puts returned at {med[('fr_put', n)]:,.0f} items/s; "
          f"process CPU per item: funcreplay {med[('fr_cpu', n)] * 1e6:.2f} us, cpprb "
          f"{med[('cpprb_cpu', n)] * 1e6:.2f} us")
  if FLAGS.out:
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump(dict(jax=jax.__version__, platform=jax.devices()[0].platform, cpus=os.cpu_count(),
                     item_bytes=nbytes, reverb=reverb_status(),
                     flags={k: FLAGS[k].value for k in ("threads", "items", "capacity",
                                                         "batch_size", "repeats",
                                                         "sample_calls")},
                     rows=rows), f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  app.run(main)
