"""Trajectory tables (issue 26) against flashbax's trajectory buffer, inside one ``lax.scan``.

CPU, flashbax 0.1.3 in the same process, same shapes: 16 envs, time capacity
65,536 (``--small``: 4,096), windows of L = 32 steps, period 1 and 8, the
76-byte step ``{obs float32[16], action int32, reward float32, discount
float32}``. Every scan step adds ``[16, 1]`` steps and samples 64 windows;
every sampled data leaf is consumed (``timing.consume``), so XLA keeps every
gather. Tables are filled first (the time axis wrapped once).

Runners, measured round-robin (``--rounds``), medians, ratio = flashbax
seconds / ours (> 1: ours faster):

* ``ours``: ``cross_episodes=True`` (flashbax's semantics: windows may cross
  episodes), the closed-form uniform draw, without replacement;
* ``ours episodes``: ``cross_episodes=False`` with ``first=`` passed every step
  (the default: windows never cross an episode start; the index-tree draw);
* ``... native`` (``--native``, CPU): the same tables built with ``native=True``:
  the same draws and states, the windows copied by the C++ gather
  (``funcreplay/native/trajectory.py``); the others are ``native=False``;
* flashbax: ``make_trajectory_buffer`` (with replacement; it has no
  without-replacement mode, no per-env masks and no episode tracking);
* prioritized (``--prioritized``): the same plus a priority write-back of the
  64 windows per step, ours ``Prioritized(0.6)`` without replacement against
  ``make_prioritised_trajectory_buffer`` (with replacement).

Memory: state bytes / payload bytes (payload = 16 * T * 76). Each row also gives the
ratio of process CPU time per step (all threads; flashbax / ours).

  PYTHONPATH=. python experiments/bench_trajectory.py   # --hlo: operation counts too
  PYTHONPATH=. python experiments/benchmark.py --sections=trajectory
"""

from __future__ import annotations

import itertools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from experiments import timing  # noqa: E402
from experiments.timing import Holder, consume  # noqa: E402
from funcreplay.core import hlo  # noqa: E402

ENVS, LENGTH, BATCH, STEPS = 16, 32, 64, 50
NOTES: list = []


def _define_flags():
  flags.DEFINE_integer("rounds", 41, "round-robin measurements per runner")
  flags.DEFINE_integer("capacity", 65536, "time capacity per env")
  flags.DEFINE_float("target_s", 0.03, "seconds per measurement (short: fine interleaving "
                                          "on a shared machine)")
  flags.DEFINE_string("periods", "1,8", "comma-separated periods")
  flags.DEFINE_bool("hlo", False, "print the compiled programs' operation counts")
  flags.DEFINE_bool("prioritized", True, "also the prioritized case (add + sample + update)")
  flags.DEFINE_bool("native", True, "also the native=True tables (CPU only)")


def _variants(native: bool):
  """``(name suffix, native argument)`` of the tables to measure."""
  on = native and jax.default_backend() == "cpu"  # elsewhere native=True is the portable
  return (("", False),) + ((" native", True),) if on else (("", False),)


def stepexample():
  return {"obs": jnp.zeros((16,), jnp.float32), "action": jnp.zeros((), jnp.int32),
          "reward": jnp.zeros((), jnp.float32), "discount": jnp.zeros((), jnp.float32)}


def steps(t: int, seed: int = 0):
  """A block ``[ENVS, t]`` of random steps (numpy)."""
  r = np.random.RandomState(seed)
  return {"obs": r.randn(ENVS, t, 16).astype(np.float32),
          "action": r.randint(0, 4, (ENVS, t)).astype(np.int32),
          "reward": r.randn(ENVS, t).astype(np.float32),
          "discount": np.full((ENVS, t), 0.99, np.float32)}


def _nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def _xs():
  """STEPS blocks of [ENVS, 1] steps, stacked on a leading scan axis."""
  return jax.device_put(jax.tree_util.tree_map(
      lambda x: np.moveaxis(x, 1, 0)[:, :, None], steps(STEPS, seed=1)))


def _fill_ours(table, cap, episodes):
  add = jax.jit(lambda s, x, f: table.add(s, x, first=f) if episodes else table.add(s, x),
                donate_argnums=0)
  block = min(cap, 4096)
  chunk = jax.device_put(steps(block))
  first = jnp.zeros((ENVS, block), bool)
  s = table.init()
  for _ in range(cap // block + 1):
    s = add(s, chunk, first)
  return s


def runners_for(period: int, cap: int, target_s: float, native: bool = True):
  import flashbax as fbx
  xs = _xs()
  out, mem = {}, {}
  for (base, episodes), (suffix, nat) in itertools.product(
      (("ours", False), ("ours episodes", True)), _variants(native)):
    name = base + suffix
    spec = fr.TrajectorySpec(ENVS, cap, LENGTH, period, stepexample(),
                             cross_episodes=not episodes)
    table = fr.make_trajectory_table(spec, native=nat)

    def fn(s, i0, xs, table=table, episodes=episodes):
      def body(c, x):
        s, acc, v = c
        if episodes:
          s = table.add(s, x, first=x["discount"] == 0)
        else:
          s = table.add(s, x)
        s, smp = table.sample(s, jax.random.PRNGKey(v), batch_size=BATCH)
        return (s, acc + consume((smp.data, smp.valid)), v + 1), None
      (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
      return s, acc
    h = Holder(_fill_ours(table, cap, episodes))
    mem[name] = _nbytes(h.state)
    out[f"{name} p{period}"] = h.runner(jax.jit(fn, donate_argnums=0), xs, target_s=target_s)
  buf = fbx.make_trajectory_buffer(add_batch_size=ENVS, sample_batch_size=BATCH,
                                   sample_sequence_length=LENGTH, period=period,
                                   min_length_time_axis=LENGTH, max_length_time_axis=cap)
  add = jax.jit(buf.add, donate_argnums=0)
  block = min(cap, 4096)
  chunk = jax.device_put(steps(block))
  s = buf.init(jax.tree_util.tree_map(lambda x: x[0, 0], chunk))
  for _ in range(cap // block + 1):
    s = add(s, chunk)
  mem["flashbax"] = _nbytes(s)

  def ffn(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s = buf.add(s, x)
      return (s, acc + consume(buf.sample(s, jax.random.PRNGKey(v)).experience), v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc
  h = Holder(s)
  out[f"flashbax p{period}"] = h.runner(jax.jit(ffn, donate_argnums=0), xs, target_s=target_s)
  return out, mem


def prioritized_runners(period: int, cap: int, target_s: float, native: bool = True):
  """Add ``[16, 1]`` + sample 64 windows + priority write-back (``|reward[0]| + 0.01``) per
  scan step: ours (``Prioritized(0.6)``, ``cross_episodes=True``, without replacement)
  against flashbax's ``make_prioritised_trajectory_buffer`` (with replacement)."""
  import flashbax as fbx
  xs = _xs()
  out = {}
  spec = fr.TrajectorySpec(ENVS, cap, LENGTH, period, stepexample(),
                           sampler=fr.Prioritized(0.6), cross_episodes=True)
  for suffix, nat in _variants(native):
    table = fr.make_trajectory_table(spec, native=nat)

    def fn(s, i0, xs, table=table):
      def body(c, x):
        s, acc, v = c
        s = table.add(s, x)
        s, smp = table.sample(s, jax.random.PRNGKey(v), batch_size=BATCH)
        s = table.update_priorities(s, smp.info.slot, smp.info.key,
                                    jnp.abs(smp.data["reward"][:, 0]) + 0.01)
        return (s, acc + consume((smp.data, smp.info.probability)), v + 1), None
      (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
      return s, acc
    out[f"ours prio{suffix} p{period}"] = Holder(_fill_ours(table, cap, False)).runner(
        jax.jit(fn, donate_argnums=0), xs, target_s=target_s)
  buf = fbx.make_prioritised_trajectory_buffer(
      add_batch_size=ENVS, sample_batch_size=BATCH, sample_sequence_length=LENGTH, period=period,
      min_length_time_axis=LENGTH, max_length_time_axis=cap, priority_exponent=0.6, device="cpu")
  add = jax.jit(buf.add, donate_argnums=0)
  block = min(cap, 4096)
  chunk = jax.device_put(steps(block))
  s = buf.init(jax.tree_util.tree_map(lambda x: x[0, 0], chunk))
  for _ in range(cap // block + 1):
    s = add(s, chunk)

  def ffn(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s = buf.add(s, x)
      smp = buf.sample(s, jax.random.PRNGKey(v))
      s = buf.set_priorities(s, smp.indices, jnp.abs(smp.experience["reward"][:, 0]) + 0.01)
      return (s, acc + consume((smp.experience, smp.probabilities)), v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc
  out[f"flashbax prio p{period}"] = Holder(s).runner(jax.jit(ffn, donate_argnums=0), xs,
                                                      target_s=target_s)
  return out


def hlo_counts(period: int, cap: int):
  import flashbax as fbx
  spec = fr.TrajectorySpec(ENVS, cap, LENGTH, period, stepexample(), cross_episodes=True)
  t = fr.make_trajectory_table(spec, native=False)
  tn = fr.make_trajectory_table(spec, native=True)
  st = t.init()
  x = jax.tree_util.tree_map(jnp.asarray, steps(1))
  buf = fbx.make_trajectory_buffer(add_batch_size=ENVS, sample_batch_size=BATCH,
                                   sample_sequence_length=LENGTH, period=period,
                                   min_length_time_axis=LENGTH, max_length_time_axis=cap)
  bs = buf.init(stepexample())
  key = jax.random.PRNGKey(0)
  return {
      "ours add [16,1]": hlo.counts(t.add, st, x, donate_argnums=0),
      "ours sample 64": hlo.counts(lambda s, k: t.sample(s, k, batch_size=BATCH), st, key,
                                   donate_argnums=0),
      "ours native sample 64": hlo.counts(lambda s, k: tn.sample(s, k, batch_size=BATCH), st,
                                          key, donate_argnums=0),
      "flashbax add [16,1]": hlo.counts(buf.add, bs, x, donate_argnums=0),
      "flashbax sample 64": hlo.counts(lambda s, k: (s, buf.sample(s, k).experience), bs, key,
                                       donate_argnums=0),
  }


def measure(periods, cap: int, rounds: int, target_s: float, prioritized: bool = True,
            native: bool = True):
  """Rows (``benchmark.ROW_KEYS`` plus ``cpu_ratio``: process CPU time per step, flashbax /
  ours) and the memory table."""
  rows, mems = [], {}
  payload = ENVS * cap * 76
  suffixes = [v[0] for v in _variants(native)]
  for p in periods:
    runners, mem = runners_for(p, cap, target_s, native)
    if prioritized:
      runners.update(prioritized_runners(p, cap, target_s, native))
    secs = timing.measure(runners, rounds)
    cpu = {k: float(np.median(r.cpu_times)) for k, r in runners.items()}

    def row(case, ours, peer, peer_name, secs=secs, cpu=cpu):
      return dict(section="trajectory", case=case, funcreplay=STEPS / secs[ours],
                  peer=STEPS / secs[peer], peer_name=peer_name, unit="steps/s",
                  ratio=secs[peer] / secs[ours], cpu_ratio=cpu[peer] / cpu[ours])
    if prioritized:
      for sfx in suffixes:
        rows.append(row(f"scan add+prioritized sample 64xL{LENGTH}+update p{p}"
                        + (f" ({sfx.strip()})" if sfx else ""), f"ours prio{sfx} p{p}",
                        f"flashbax prio p{p}", "flashbax prioritised trajectory"))
    mems[p] = {k: v / payload for k, v in mem.items()}
    for name in [b + sfx for b in ("ours", "ours episodes") for sfx in suffixes]:
      rows.append(row(f"scan add[16,1]+sample 64xL{LENGTH} p{p} ({name})", f"{name} p{p}",
                      f"flashbax p{p}", "flashbax trajectory"))
  return rows, mems


def run(small: bool) -> list:
  """The ``trajectory`` section of ``experiments/benchmark.py``."""
  rows, mems = measure((1, 8), 4096 if small else 65536, 11 if small else 41, 0.03)
  NOTES[:] = [f"trajectory: state bytes / payload bytes by period: {mems}"]
  return rows


def main(_):
  F = flags.FLAGS
  periods = [int(p) for p in F.periods.split(",")]
  print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()}, "
        f"capacity {F.capacity}, median of {F.rounds}")
  if F.hlo:
    for p in periods:
      for k, v in hlo_counts(p, F.capacity).items():
        print(f"p{p} {k:<22} {v}")
  rows, mems = measure(periods, F.capacity, F.rounds, F.target_s, F.prioritized, F.native)
  print(f"{'case':<62} {'ours steps/s':>13} {'flashbax':>11} {'ratio':>7} {'cpu ratio':>9}")
  for r in rows:
    print(f"{r['case']:<62} {r['funcreplay']:>13.0f} {r['peer']:>11.0f} {r['ratio']:>7.2f} "
          f"{r['cpu_ratio']:>9.2f}")
  for p, m in mems.items():
    print(f"p{p} state bytes / payload bytes: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
  print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
