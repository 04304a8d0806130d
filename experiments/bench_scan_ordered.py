"""``bench_scan.py --cases=ordered``: the deterministic samplers inside ``lax.scan``.

One step: insert 64 items, then sample 64 (each item sampled once, so the 64 leave the
table), every sampled field consumed; 20 steps per jitted scan call, C = 65,536, the
table at C - 64 items between steps. Kinds:

- ``stack``: Reverb's stack (``fr.stack``: Lifo sampler and remover; the newest first);
- ``min-heap``: a priority queue (``MinHeap`` sampler, the ring remover, random integer
  priorities in [0, 100): the lowest first, ties by the least recent insert);
- ``stalest``: ``StalestFirst`` over versions that advance by one every step (the
  async-RL learner's order: the oldest policy version first).

There is no JAX peer (flashbax has no ordered sampler but its queue, see
``bench_scan_queue.py``); the peer is this library's previous program, the sort of all C
slots by the sampler's order (``ordering.sorted_eligible``), traced in the same process
by pointing ``ordering.first_eligible`` at it. ``> 1``: the selection by top-k passes is
faster. On a GPU ``first_eligible`` is itself one sort (``ordering.sort_first``: XLA:GPU
sorts the table for each top-k), so there both sides sort and the ratio is ~1.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import funcreplay as fr
from experiments.timing import Holder, consume, example, transitions
from funcreplay.core import ordering

CAPACITY = 1 << 16
STEPS, BATCH = 20, 64
KINDS = ("stack", "min-heap", "stalest")


def _spec(kind):
  if kind == "stack":
    return fr.stack(CAPACITY, example())
  sampler = fr.MinHeap() if kind == "min-heap" else fr.StalestFirst()
  return fr.TableSpec(CAPACITY, example(), sampler=sampler, remover=fr.Fifo(),
                      max_times_sampled=1)


def _by_sort(selector, state, eligible, b):
  """The previous selection: every slot sorted, the first ``b`` kept."""
  order, ok = ordering.sorted_eligible(selector, state, eligible)
  return jnp.where(ok[:b], order[:b], -1), jnp.sum(ok, dtype=jnp.int32)


@contextlib.contextmanager
def _selection(name):
  """Trace the sample with ``name``'s selection (``select``: the library's own)."""
  keep = ordering.first_eligible
  if name == "sort":
    ordering.first_eligible = _by_sort
  try:
    yield
  finally:
    ordering.first_eligible = keep


def _runner(kind, name, fill, xs, prio, target_s):
  spec = _spec(kind)
  t = fr.make_table(spec, native=False)
  state = jax.jit(t.insert)(t.init(), fill, priority=prio[0], version=0)

  def f(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s = t.insert(s, x, priority=prio[1][v % STEPS], version=v)
      s, smp = t.sample(s, jax.random.PRNGKey(v), batch_size=BATCH)
      return (s, acc + consume((smp.data, smp.info)), v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc

  with _selection(name):  # the Runner compiles its program here
    return Holder(state).runner(jax.jit(f, donate_argnums=0), xs, target_s=target_s)


def runners(target_s):
  """``{"select <kind>": Runner, "sort <kind>": Runner}`` for every kind."""
  fill = jax.device_put(transitions(CAPACITY - BATCH, seed=1))
  xs = jax.device_put({k: v.reshape((STEPS, BATCH) + v.shape[1:])
                       for k, v in transitions(STEPS * BATCH, seed=3).items()})
  rng = np.random.default_rng(5)
  prio = (jnp.asarray(rng.integers(0, 100, CAPACITY - BATCH), jnp.float32),
          jnp.asarray(rng.integers(0, 100, (STEPS, BATCH)), jnp.float32))
  return {f"{name} {kind}": _runner(kind, name, fill, xs, prio, target_s)
          for kind in KINDS for name in ("select", "sort")}
