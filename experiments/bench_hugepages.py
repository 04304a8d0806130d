"""How much do transparent huge pages speed up sampling? An A/B in one process.

Two full tables of the same spec; after filling, the large buffers (>= 2 MiB)
of table B are collapsed onto huge pages with ``madvise(MADV_COLLAPSE)``
(Linux >= 6.1; numpy advises its own large arrays onto huge pages, XLA's
allocator does not). Then the same jitted, donated programs run on A and B,
interleaved round-robin, medians of ``--repeats``:

* uniform ``sample`` b256 / b1024 (masks on, without replacement);
* prioritized ``sample`` + ``update_priorities`` b256 / b1024;
* ``insert`` b256.

Measurement only: the library does not collapse its buffers (BUILD.md,
"Measured, not shipped: huge pages for the large buffers"). Every buffer
is a donated state leaf updated in place, so B keeps its pages throughout
(the script checks ``/proc/self/smaps`` and says so). Prints ``speed-up =
A time / B time`` per case. Without THP, or when the collapse leaves B on
4 KiB pages (Linux < 6.1), it says so and stops: there is nothing to compare.

  python experiments/bench_hugepages.py --capacity=1000000 --repeats=7
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import bench_core as bc  # noqa: E402

import funcreplay as fr  # noqa: E402

_CAPACITY = flags.DEFINE_integer("capacity", 1_000_000, "table capacity (every slot filled)")
_REPEATS = flags.DEFINE_integer("repeats", 7, "round-robin repeats; the median is reported")
_CALLS = flags.DEFINE_integer("calls", 500, "calls per measurement")
_OUT = flags.DEFINE_string("out", "", "JSON output ('' = none)")

MADV_COLLAPSE = 25
HUGE = 2 << 20


def _thp_mode() -> str:
  try:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
      return f.read().split("[", 1)[1].split("]", 1)[0]
  except (OSError, IndexError):
    return "unavailable"


def _huge_kib(address: int) -> int:
  """AnonHugePages (KiB) of the mapping that holds ``address``."""
  with open("/proc/self/smaps") as f:
    inside = False
    for line in f:
      head = line.split()[0]
      if "-" in head and not head.endswith(":"):
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= address < hi
      elif inside and head == "AnonHugePages:":
        return int(line.split()[1])
  return 0


def _collapse(state) -> int:
  """Collapses the 2 MiB-aligned interior of every large leaf; returns the leaves done."""
  libc = ctypes.CDLL(None, use_errno=True)
  libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
  done = 0
  for leaf in jax.tree_util.tree_leaves(state):
    if leaf.nbytes < HUGE:
      continue
    p = leaf.unsafe_buffer_pointer()
    lo, hi = (p + HUGE - 1) & ~(HUGE - 1), (p + leaf.nbytes) & ~(HUGE - 1)
    if hi > lo and libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
      done += 1
  return done


def _on_huge_pages(state) -> bool:
  """True if the middle of every leaf of >= 4 MiB (sure to hold an aligned 2 MiB page) is."""
  big = [x for x in jax.tree_util.tree_leaves(state) if x.nbytes >= 2 * HUGE]
  return all(_huge_kib(x.unsafe_buffer_pointer() + x.nbytes // 2) > 0 for x in big)


def fill_fn(t):
  """Jitted, donated ``insert(state, i, items)`` (default priorities)."""
  return jax.jit(lambda s, i, x: t.insert(s, x, version=0), donate_argnums=0)


def _pair(spec, fill):
  """Two full states of ``spec``; the second collapsed onto huge pages."""
  t = fr.make_table(spec)
  ins = fill_fn(t)
  states = []
  for k in range(2):
    s = jax.jit(t.init)()
    for i, chunk in enumerate(fill):
      s = ins(s, i, chunk)
    jax.block_until_ready(s)
    if k == 1:
      n = _collapse(s)
      on_huge = _on_huge_pages(s)
      print(f"collapsed {n} large buffers of table B; on huge pages: {on_huge}")
      if not on_huge:  # the A/B would compare 4 KiB pages with 4 KiB pages
        raise SystemExit("MADV_COLLAPSE left table B on 4 KiB pages (Linux < 6.1, or no free "
                         "huge pages): nothing to compare")
    states.append(s)
  return t, states


def _measure(states, fn, repeats, calls):
  times = ([], [])
  for _ in range(repeats):
    for k in (0, 1):
      s = states[k]
      for i in range(5):
        s, out = fn(s, i)
      jax.block_until_ready(s)
      t0 = time.perf_counter()
      for i in range(calls):
        s, out = fn(s, i)
      jax.block_until_ready((s, out))
      times[k].append((time.perf_counter() - t0) / calls)
      states[k] = s
  return [float(np.median(t)) for t in times]


def main(argv):
  del argv
  mode = _thp_mode()
  print(f"transparent huge pages: {mode}; jax {jax.__version__} on {jax.devices()[0].platform}")
  if mode not in ("always", "madvise"):
    print("no transparent huge pages here: nothing to compare")
    return
  c = _CAPACITY.value
  chunk = min(c, 50_000)
  fill = [jax.device_put(bc.transitions(chunk, seed=1))] * -(-c // chunk)  # every slot filled
  b256 = jax.device_put(bc.transitions(256, seed=2))
  rows = []

  def report(case, ta, tb):
    rows.append(dict(case=case, small_pages_us=ta * 1e6, huge_pages_us=tb * 1e6,
                     speedup=ta / tb))
    print(f"{case:<36} 4 KiB pages {ta * 1e6:8.1f} us   huge pages {tb * 1e6:8.1f} us   "
          f"speed-up {ta / tb:5.2f}x", flush=True)

  uni = fr.TableSpec(c, bc.example(), max_staleness=1 << 30, max_times_sampled=1 << 30)
  t, states = _pair(uni, fill)
  for b in (256, 1024):
    f = jax.jit(lambda s, i, b=b: t.sample(s, jax.random.PRNGKey(i), batch_size=b, version=i),
                donate_argnums=0)
    report(f"uniform sample b{b}", *_measure(states, f, _REPEATS.value, _CALLS.value))
  ins = fill_fn(t)
  report("insert b256", *_measure(states, lambda s, i: (ins(s, i, b256), None),
                                  _REPEATS.value, _CALLS.value))
  print(f"table B still on huge pages: {_on_huge_pages(states[1])}")
  del states

  pri = fr.TableSpec(c, bc.example(), sampler=fr.Prioritized(0.6))
  t, states = _pair(pri, fill)

  def step(s, i, b):
    k1, k2 = jax.random.split(jax.random.PRNGKey(i))
    s, smp = t.sample(s, k1, batch_size=b)
    s = t.update_priorities(s, smp.info.slot, smp.info.key, jax.random.uniform(k2, (b,)) + 0.01)
    return s, (smp.data, smp.info.probability)

  for b in (256, 1024):
    f = jax.jit(lambda s, i, b=b: step(s, i, b), donate_argnums=0)
    report(f"prioritized sample+update b{b}", *_measure(states, f, _REPEATS.value,
                                                        _CALLS.value))
  if _OUT.value:
    os.makedirs(os.path.dirname(_OUT.value) or ".", exist_ok=True)
    with open(_OUT.value, "w") as fh:
      json.dump(dict(jax=jax.__version__, capacity=c, thp=mode, rows=rows), fh, indent=1)


if __name__ == "__main__":
  app.run(main)
