"""Rollout-group benchmark (issue 28): a 4-task take in one call vs its peers, and the
memory per stored token of ragged leaves.

**Take.** A buffer of ``--groups`` rollout groups over 4 tasks (each group: a ragged
token leaf of 8 responses of uniform [16, 512] tokens, rewards [8], a task, a status and
a version); the learner takes ``{math: 16, code: 8, chat: 4, tool: 4}`` completed groups
stalest first (xtuner's ``StalenessReplayPolicy``: ``sort by (-staleness, timestamp)``)
and the taken groups are deleted. Peers, on the same data in the same process:

* ``take_batch``: ``Table.take_batch(counts, where={"status": "completed"})``: one call,
  one pass (``StalestFirst`` sampler);
* ``4 x sample``: one ``Table.sample(n, where={"task": t, "status": "completed"})`` per task
  on a table with ``max_times_sampled=1`` (so a sample consumes): today's way;
* ``pandas``: a reimplementation of xtuner's ``PandasStorage`` query per task (boolean
  filter on a DataFrame, sort by ``(-staleness, timestamp_id)``, head, ``isin`` delete);
* ``naive``: xtuner's ``NaiveStorage`` pattern (a dict of records, a filtering scan and a
  sort per task, deletes by uid).

Every round refills each buffer with the groups it gave away (untimed), then times one
take; rounds interleave the peers; medians are reported, as ratios (> 1: funcreplay's
one-call take is faster). Every taken field is read (token values, rewards, metadata).

**Memory.** Bytes the table holds per stored token for the ragged leaf (arena buffer +
per-slot offsets and lengths) vs padding every response to 512, for response lengths
uniform in [16, 512] and long-tailed (lognormal, median 128, sigma 1, clipped to [16, 512]:
most responses short, a few at the cap, as LLM outputs are).

**Programs.** The grouped selection alone (``core.ops.grouped.select_by``, jitted; its
slots, groups and counts are the program's outputs), K groups of a vocabulary column at C
slots, B = 32 rows, through its two paths in the same run: two ``lax.top_k`` stages over
``[K, C]`` (``TOPK_MAX_GROUPS`` raised past K) and the O(C) radix select
(``TOPK_MAX_GROUPS = 0``); ``select_by`` itself uses the top-k stages up to K = 4.

  python experiments/bench_rollout.py --groups=4096 --rounds=30 --out=results/bench_rollout.json
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_integer("groups", 4096, "groups in each buffer")
flags.DEFINE_integer("rounds", 30, "timed takes per peer (median reported)")
flags.DEFINE_integer("group_size", 8, "responses per group")
flags.DEFINE_integer("max_len", 512, "max tokens per response (lengths in [16, max_len])")
flags.DEFINE_list("program_capacities", ["4160", "65536"], "C of the program timings ([] = skip)")
flags.DEFINE_list("program_groups", ["4", "8", "16"], "K of the program timings")
flags.DEFINE_string("out", "", "JSON output ('' = none)")

TASKS = ("math", "code", "chat", "tool")
STATUS = ("completed", "aborted", "expired")
COUNTS = {"math": 16, "code": 8, "chat": 4, "tool": 4}


MIN_LEN = 16
LOGNORMAL_MEDIAN, LOGNORMAL_SIGMA = 128, 1.0  # long-tailed lengths: ~5% reach 512


class Source:
  """Deterministic synthetic groups: ``next(n)`` gives n new ones (dicts); response lengths
  ``"uniform"`` in [MIN_LEN, max_len] or ``"lognormal"`` (clipped to the same range)."""

  def __init__(self, seed, g, max_len, lengths="uniform"):
    self.rng, self.g, self.max_len, self.t = np.random.default_rng(seed), g, max_len, 0
    self.dist = lengths

  def lengths(self):
    if self.dist == "uniform":
      return self.rng.integers(MIN_LEN, self.max_len + 1, self.g)
    x = self.rng.lognormal(np.log(LOGNORMAL_MEDIAN), LOGNORMAL_SIGMA, self.g)
    return np.clip(np.round(x), MIN_LEN, self.max_len).astype(np.int64)

  def next(self, n):
    out = []
    for _ in range(n):
      lengths = self.lengths()
      out.append(dict(tokens=self.rng.integers(0, 32_000, lengths.sum()).astype(np.int32),
                      reward=self.rng.random(self.g).astype(np.float32),
                      task=TASKS[self.rng.integers(4)],
                      status=STATUS[0] if self.rng.random() < 0.9 else STATUS[1],
                      version=self.t // 64 - int(self.rng.integers(0, 4))))
      self.t += 1
    return out


def spec(groups, g, max_len, sampler, max_times_sampled=0):
  sig = {"tokens": fr.Ragged(g * max_len, jnp.int32),
         "reward": jax.ShapeDtypeStruct((g,), jnp.float32)}
  # Room for one refill: a take frees what the next refill fills (no evictions).
  return fr.TableSpec(groups + 64, sig, sampler=sampler, remover=fr.Fifo(fill_holes=True),
                      max_times_sampled=max_times_sampled,
                      metadata=(fr.Column("task", vocab=TASKS), fr.Column("status", vocab=STATUS)))


def fr_insert(table, groups):
  for i in range(0, len(groups), 256):
    part = groups[i:i + 256]
    table.insert({"tokens": [x["tokens"] for x in part],
                  "reward": np.stack([x["reward"] for x in part])},
                 version=np.int32([x["version"] for x in part]),
                 metadata={"task": [x["task"] for x in part],
                           "status": [x["status"] for x in part]})


def consume_fr(samples) -> float:
  total = 0.0
  for s in samples:
    total += float(s.data["tokens"].values.sum() % 7) + float(s.data["reward"].sum())
    total += float(np.asarray(s.info.key).sum() % 3) + float(np.asarray(s.valid).sum())
  return total


class PandasBuffer:
  """xtuner's PandasStorage + StalenessReplayPolicy query, reimplemented (not copied)."""

  def __init__(self, pd):
    self.pd, self.uid = pd, 0
    self.df = pd.DataFrame(columns=["uid", "timestamp_id", "task_name", "status", "staleness",
                                    "item"])

  def put(self, groups, version_now):
    rows = []
    for x in groups:
      self.uid += 1
      rows.append(dict(uid=self.uid, timestamp_id=self.uid, task_name=x["task"],
                       status=x["status"], staleness=version_now - x["version"], item=x))
    new = self.pd.DataFrame(rows)
    self.df = new if self.df.empty else self.pd.concat([self.df, new], ignore_index=True)

  def take(self, counts):
    out = {}
    for task, n in counts.items():
      df = self.df
      sel = df[(df["task_name"] == task) & (df["status"] == "completed")]
      sel = sel.sort_values(["staleness", "timestamp_id"], ascending=[False, True]).head(n)
      self.df = df[~df["uid"].isin(sel["uid"].tolist())]
      out[task] = [r for r in sel["item"]]
    return out


class NaiveBuffer:
  """xtuner's NaiveStorage + StalenessReplayPolicy: a dict scan and a sort per task."""

  def __init__(self):
    self.items, self.uid = {}, 0

  def put(self, groups, version_now):
    for x in groups:
      self.uid += 1
      self.items[self.uid] = (self.uid, x["task"], x["status"], version_now - x["version"], x)

  def take(self, counts):
    out = {}
    for task, n in counts.items():
      rec = [r for r in self.items.values() if r[1] == task and r[2] == "completed"]
      rec.sort(key=lambda r: (-r[3], r[0]))
      for r in rec[:n]:
        del self.items[r[0]]
      out[task] = [r[4] for r in rec[:n]]
    return out


def consume_py(taken) -> float:
  return sum(float(x["tokens"].sum() % 7) + float(x["reward"].sum())
             for rows in taken.values() for x in rows)


def bench_take(groups, rounds, g, max_len):
  import pandas as pd
  src = Source(0, g, max_len)
  data = src.next(groups)
  take_t = fr.Table(spec(groups, g, max_len, fr.StalestFirst()))
  samp_t = fr.Table(spec(groups, g, max_len, fr.StalestFirst(), max_times_sampled=1))
  pdb, nvb = PandasBuffer(pd), NaiveBuffer()
  for t in (take_t, samp_t):
    fr_insert(t, data)
  pdb.put(data, 0)
  nvb.put(data, 0)
  where = {"status": "completed"}

  def take_once():
    return [*take_t.take_batch(COUNTS, where=where, timeout=10).values()]

  def sample_once():
    return [samp_t.sample(n, where={"task": t, "status": "completed"}, timeout=10)
            for t, n in COUNTS.items()]

  peers = {"take_batch": (take_once, consume_fr, lambda d: fr_insert(take_t, d)),
           "4 x sample": (sample_once, consume_fr, lambda d: fr_insert(samp_t, d)),
           "pandas": (lambda: pdb.take(COUNTS), consume_py, lambda d: pdb.put(d, 0)),
           "naive": (lambda: nvb.take(COUNTS), consume_py, lambda d: nvb.put(d, 0))}
  times = {k: [] for k in peers}
  for r in range(rounds + 1):  # round 0 warms up (compiles)
    new = src.next(sum(COUNTS.values()))
    order = list(peers) if r % 2 == 0 else list(reversed(peers))
    for k in order:
      fn, consume, put = peers[k]
      t0 = time.perf_counter()
      out = fn()
      consume(out)
      dt = time.perf_counter() - t0
      if r:
        times[k].append(dt)
      put(new)
  med = {k: float(np.median(v)) for k, v in times.items()}
  return {k: {"median_ms": 1e3 * v, "ratio_vs_take_batch": v / med["take_batch"]}
          for k, v in med.items()}


def bench_memory(groups, g, max_len, lengths):
  src = Source(1, g, max_len, lengths)
  t = fr.Table(spec(groups, g, max_len, fr.StalestFirst()))
  fr_insert(t, src.next(groups))
  # Churn: take and refill (holes, compactions); 64 groups a task, or an eighth of a
  # task's share of a smaller table (64 a task waited for groups a small one never had).
  take = max(1, min(64, groups // (8 * len(TASKS))))
  for _ in range(3):
    for vals in t.take_batch({k: take for k in TASKS}, include_stale=True,
                             timeout=60).values():
      del vals
    fr_insert(t, src.next(take * len(TASKS)))
  m = t.ragged_memory()["['tokens']"]
  tokens = m["live_values"]
  responses = len(t) * g
  return {"bytes_per_token_ragged": m["nbytes"] / tokens,
          "payload_bytes_per_token": 4.0,
          "ratio_ragged": m["nbytes"] / m["live_bytes"],
          "bytes_per_token_padded": responses * max_len * 4 / tokens,
          "ratio_padded": responses * max_len * 4 / m["live_bytes"],
          "mean_length": tokens / responses, "compactions": m["compactions"]}


def bench_programs(capacities, ks, reps=40, rounds=5):
  """Median us of ``select_by`` through each path, interleaved; ``topk / radix`` ratios."""
  from funcreplay.core.ops import grouped
  out = []
  for sampler in (fr.StalestFirst(), fr.Prioritized(1.0)):
    for c in capacities:
      for k in ks:
        vocab = tuple(f"t{i}" for i in range(k))
        spec = fr.TableSpec(c, {"x": jax.ShapeDtypeStruct((), jnp.int32)}, sampler=sampler,
                            metadata=(fr.Column("task", vocab=vocab),))
        rng = np.random.default_rng(0)
        t = fr.Table(spec)
        for i in range(0, c, 4096):
          n = min(4096, c - i)
          t.insert({"x": np.zeros(n, np.int32)}, metadata={"task": rng.integers(0, k, n)},
                   version=np.int32(rng.integers(0, 50)))  # versions in bursts, as producers
        state = t.snapshot()
        values = jnp.arange(k, dtype=jnp.int32)
        counts = jnp.full((k,), 32 // k, jnp.int32)
        key = jax.random.PRNGKey(0)
        programs = {}
        for name, cap in (("topk", 1 << 30), ("radix", 0)):
          grouped.TOPK_MAX_GROUPS = cap  # read when the program is traced (just below)
          f = jax.jit(lambda s, v, n, r, spec=spec: grouped.select_by(
              spec, s, "task", v, n, batch_size=32, rng=r, version=jnp.int32(50)))
          jax.block_until_ready(f(state, values, counts, key))
          programs[name] = functools.partial(f, state, values, counts, key)
        grouped.TOPK_MAX_GROUPS = 4
        same = [np.asarray(p()[0]) for p in programs.values()]
        assert np.array_equal(*same), "the two paths chose different rows"
        times = {name: [] for name in programs}
        for r in range(rounds):
          for name in (list(programs) if r % 2 == 0 else list(reversed(programs))):
            for _ in range(reps):
              t0 = time.perf_counter()
              jax.block_until_ready(programs[name]())
              times[name].append(time.perf_counter() - t0)
        med = {name: 1e6 * float(np.median(v)) for name, v in times.items()}
        out.append({"sampler": type(sampler).__name__, "C": c, "K": k, **med,
                    "topk_over_radix": med["topk"] / med["radix"]})
        t.close()
  return out


def main(argv):
  del argv
  load = os.getloadavg()
  programs = bench_programs([int(c) for c in FLAGS.program_capacities],
                            [int(k) for k in FLAGS.program_groups])
  take = bench_take(FLAGS.groups, FLAGS.rounds, FLAGS.group_size, FLAGS.max_len)
  mem = {d: bench_memory(FLAGS.groups, FLAGS.group_size, FLAGS.max_len, d)
         for d in ("uniform", "lognormal")}
  print(f"take {COUNTS} from {FLAGS.groups} groups (stalest first, taken groups deleted); "
        f"load {load[0]:.1f}:")
  for k, v in take.items():
    print(f"  {k:12s} {v['median_ms']:8.3f} ms   {v['ratio_vs_take_batch']:6.2f}x the one-call "
          "take's time")
  for d, m in mem.items():
    what = (f"uniform [{MIN_LEN}, {FLAGS.max_len}]" if d == "uniform" else
            f"lognormal (median {LOGNORMAL_MEDIAN}, sigma {LOGNORMAL_SIGMA}) clipped to "
            f"[{MIN_LEN}, {FLAGS.max_len}]")
    print(f"memory per stored token (int32 tokens, lengths {what}, mean "
          f"{m['mean_length']:.0f}): ragged {m['bytes_per_token_ragged']:.3f} B "
          f"({m['ratio_ragged']:.3f}x the payload), padded to {FLAGS.max_len}: "
          f"{m['bytes_per_token_padded']:.3f} B ({m['ratio_padded']:.3f}x)")
  print("select_by program alone (B = 32; > 1: the radix select is faster):")
  for p in programs:
    print(f"  {p['sampler']:13s} C={p['C']:6d} K={p['K']:2d}: top-k stages {p['topk']:8.1f} us, "
          f"radix {p['radix']:8.1f} us: {p['topk_over_radix']:5.2f}x")
  if FLAGS.out:
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump({"take": take, "memory": mem, "programs": programs, "groups": FLAGS.groups,
                 "load": load}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
