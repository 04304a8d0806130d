"""Storage layout, measured: one column per leaf (today's ``TableState.data``) vs one packed row.

Issue 25's uniform (insert b16 + sample b256) and insert-b1 targets were not met
with the column layout (``bench_scan.py``: portable 0.55-0.65x and 0.38-0.44x
flashbax). This experiment asks whether the *layout* is the lever, outside
funcreplay's programs, with the bare operations only (no metadata, no
without-replacement draw, same random indices in both layouts):

* ``columns``: the 524-byte transition of ``bench_core`` as five arrays
  ``obs f32[C, 64]``, ``next_obs f32[C, 64]``, ``action s32[C]``, ``reward
  f32[C]``, ``discount f32[C]`` (flashbax's layout and ours): a sample is one
  gather per leaf, an insert one ``dynamic_update_slice`` per leaf;
* ``rows``: the same transition bit-cast into one ``u32[C, 136]`` array (131
  words of payload + 5 words standing in for the per-slot metadata:
  occupied, key, version, times_sampled, priority): a sample is one gather of
  contiguous rows then free bit-casts, an insert one ``dynamic_update_slice``
  of one packed row.

Cases inside one ``lax.scan`` of 50 steps (capacity 262,144, every sampled
field consumed so XLA keeps every gather): ``sample b256``, ``insert b16 +
sample b256``, ``insert b1``. Printed: microseconds per step of both layouts
and the ratio ``columns / rows`` (> 1: rows faster), wall and process CPU time,
medians of interleaved rounds.

  PYTHONPATH=. python experiments/bench_layout.py --rounds=7
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.timing import Holder, consume, measure, transitions  # noqa: E402

CAPACITY = 1 << 18
STEPS, INS, SMP = 50, 16, 256
# Words per packed row: the 131 payload words of the transition plus 5 for the
# per-slot metadata a table keeps (occupied, key, version, times_sampled, priority).
META_WORDS = 5

flags.DEFINE_integer("rounds", 7, "interleaved measurement rounds (medians reported)")
flags.DEFINE_float("target_s", 0.15, "seconds per measurement")
FLAGS = flags.FLAGS


def _layout(example):
  """Leaf names in a fixed order and their word widths in a packed row."""
  names = sorted(example)
  widths = [int(np.prod(example[k].shape[1:], dtype=np.int64)) for k in names]
  return names, widths


def pack(x, names):
  """Leaves ``[n, ...]`` (4-byte dtypes) -> ``u32[n, words]``, bit for bit."""
  n = x[names[0]].shape[0]
  return jnp.concatenate([lax.bitcast_convert_type(x[k], jnp.uint32).reshape(n, -1)
                          for k in names], axis=1)


def unpack(rows, example, names, widths):
  """``u32[n, words]`` -> the leaves again (slices + bit-casts, fused into consumers)."""
  out, at = {}, 0
  for k, w in zip(names, widths):
    shape, dtype = example[k].shape[1:], example[k].dtype
    out[k] = lax.bitcast_convert_type(rows[:, at:at + w], dtype).reshape((rows.shape[0],) + shape)
    at += w
  return out


def _draw(v):
  return jax.random.randint(jax.random.PRNGKey(v), (SMP,), 0, CAPACITY)


def column_programs(example):
  def insert(data, pos, x):
    return jax.tree_util.tree_map(lambda c, u: lax.dynamic_update_slice_in_dim(c, u, pos, 0),
                                  data, x)

  def sample(data, v):
    i = _draw(v)
    return consume(jax.tree_util.tree_map(lambda c: c[i], data))

  return insert, sample


def row_programs(example):
  names, widths = _layout(example)

  def insert(rows, pos, x):
    n = x[names[0]].shape[0]
    packed = jnp.concatenate([pack(x, names), jnp.zeros((n, META_WORDS), jnp.uint32)], axis=1)
    return lax.dynamic_update_slice_in_dim(rows, packed, pos, 0)

  def sample(rows, v):
    got = rows[_draw(v)]
    meta = got[:, -META_WORDS:]  # consumed too: a table reads the slot's metadata with its rows
    return consume(unpack(got, example, names, widths)) + jnp.sum(meta).astype(jnp.float32)

  return insert, sample


def scans(insert, sample, b):
  """The three in-scan cases on one layout's programs; state = (storage, write position)."""
  def smp(s, i0, xs):
    def body(c, _):
      s, acc, v = c
      return (s, acc + sample(s[0], v), v + 1), None
    (s, acc, _), _ = lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), None, length=STEPS)
    return s, acc

  def ins_smp(s, i0, xs):
    def body(c, x):
      (store, pos), acc, v = c
      store = insert(store, pos, x)
      s = (store, (pos + b) % CAPACITY)
      return (s, acc + sample(store, v), v + 1), None
    (s, acc, _), _ = lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc

  def ins(s, i0, xs):
    def body(s, x):
      store, pos = s
      return (insert(store, pos, x), (pos + 1) % CAPACITY), None
    s, _ = lax.scan(body, s, xs)
    return s, None

  return {"sample b256": smp, "insert b16 + sample b256": ins_smp, "insert b1": ins}


def main(argv):
  del argv
  fill = transitions(CAPACITY, seed=1)
  example = {k: v[:1] for k, v in fill.items()}
  steps = transitions(STEPS * INS, seed=3)
  xs = {"sample b256": None,
        "insert b16 + sample b256": jax.device_put(
            {k: v.reshape((STEPS, INS) + v.shape[1:]) for k, v in steps.items()}),
        "insert b1": jax.device_put({k: v[:STEPS, None] for k, v in steps.items()})}
  names, _ = _layout(example)
  stores = {"columns": lambda: jax.device_put(fill),
            "rows": lambda: jnp.concatenate(
                [pack(jax.device_put(fill), names),
                 jnp.zeros((CAPACITY, META_WORDS), jnp.uint32)], axis=1)}
  runners = {}
  for layout, programs in (("columns", column_programs), ("rows", row_programs)):
    for case, fn in scans(*programs(example), INS).items():
      if case == "insert b1":
        fn = scans(*programs(example), 1)[case]
      h = Holder((stores[layout](), jnp.int32(0)))
      runners[(layout, case)] = h.runner(jax.jit(fn, donate_argnums=0), xs[case],
                                         target_s=FLAGS.target_s)
  print(f"capacity {CAPACITY:,}, jax {jax.__version__}, {jax.default_backend()}, {STEPS} steps "
        f"per scan, {FLAGS.rounds} interleaved rounds (medians); load {os.getloadavg()[0]:.1f}")
  secs = measure(runners, FLAGS.rounds)
  cpu = {k: float(np.median(r.cpu_times)) for k, r in runners.items()}
  for case in xs:
    c, r = secs[("columns", case)], secs[("rows", case)]
    cc, rc = cpu[("columns", case)], cpu[("rows", case)]
    print(f"{case:<26} columns {c / STEPS * 1e6:8.2f} us/step  rows {r / STEPS * 1e6:8.2f} "
          f"us/step  columns/rows {c / r:5.2f}x  (process CPU time {cc / rc:5.2f}x)")


if __name__ == "__main__":
  app.run(main)
