"""``bench_scan.py --cases=removers``: a full table's in-scan step with each remover.

One step: insert 16 items into a full table (so the remover picks 16 victims), a
prioritized sample of 64 without replacement, and ``update_priorities`` of those 64
(``|reward| + 0.01``), every sampled field and ``info.probability`` consumed; 20 steps
per jitted ``lax.scan`` call, C = 65,536. Ours: ``make_table(spec, native=False)`` with
``Prioritized(0.6)`` and each remover: ``Fifo()`` (the ring), ``Fifo(fill_holes=True)``
(Reverb's FIFO: free slots first), ``Lifo``, ``MinHeap`` (lowest priority first) and a
``Uniform`` remover (random victims; its insert takes an ``rng``).

flashbax has no remover but its ring, so its prioritised buffer (the same step: add 16,
sample 64 with replacement, ``set_priorities``) is the peer for every row: the ratio says
what a remover costs over the ring the JAX world has. BUILD.md finding 14 measured
these steps first (the heap remover's copies of the whole table: 47 ms -> 1.7 ms a step).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import funcreplay as fr
from experiments.timing import Holder, consume, example, transitions

CAPACITY = 1 << 16  # a fill of 2^18 rows through the heap's row-by-row insert takes minutes
STEPS, INS, SMP = 20, 16, 64
FILL_CHUNK = 1 << 12
KINDS = ("removers",)
REMOVERS = {"fifo-ring": fr.Fifo(), "fifo-fill": fr.Fifo(fill_holes=True), "lifo": fr.Lifo(),
            "min-heap": fr.MinHeap(), "uniform": fr.Uniform()}


def _rng(spec, v):
  """The insert's ``rng`` (only a ``Uniform`` remover draws)."""
  return {"rng": jax.random.PRNGKey(v)} if isinstance(spec.remover, fr.Uniform) else {}


def _table_runner(spec, fill, xs, target_s):
  t = fr.make_table(spec, native=False)
  ins = jax.jit(lambda s, x: t.insert(s, x, **_rng(spec, 0)), donate_argnums=0)
  h = Holder(t.init())
  for _ in range(CAPACITY // FILL_CHUNK):
    h.state = ins(h.state, fill)

  def f(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s = t.insert(s, x, **_rng(spec, v))
      s, smp = t.sample(s, jax.random.PRNGKey(v), batch_size=SMP)
      s = t.update_priorities(s, smp.info.slot, smp.info.key,
                              jnp.abs(smp.data["reward"]) + 0.01)
      return (s, acc + consume((smp.data, smp.info.probability)), v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc

  return h.runner(jax.jit(f, donate_argnums=0), xs, target_s=target_s)


def _flashbax_runner(fbx, fill, xs, target_s, platform):
  buf = fbx.make_prioritised_item_buffer(max_length=CAPACITY, min_length=1,
                                         sample_batch_size=SMP, add_batches=True,
                                         priority_exponent=0.6, device=platform)
  add = jax.jit(buf.add, donate_argnums=0)
  h = Holder(buf.init(example()))
  for _ in range(CAPACITY // FILL_CHUNK):
    h.state = add(h.state, fill)

  def f(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s = buf.add(s, x)
      smp = buf.sample(s, jax.random.PRNGKey(v))
      s = buf.set_priorities(s, smp.indices, jnp.abs(smp.experience["reward"]) + 0.01)
      return (s, acc + consume((smp.experience, smp.probabilities)), v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc

  return h.runner(jax.jit(f, donate_argnums=0), xs, target_s=target_s)


def runners(fbx, target_s, platform="cpu"):
  """``{"<remover> removers": Runner, ..., "flashbax removers": Runner}``."""
  fill = jax.device_put(transitions(FILL_CHUNK, seed=1))
  xs = jax.device_put({k: v.reshape((STEPS, INS) + v.shape[1:])
                       for k, v in transitions(STEPS * INS, seed=3).items()})
  out = {}
  for name, remover in REMOVERS.items():
    spec = fr.TableSpec(CAPACITY, example(), sampler=fr.Prioritized(0.6), remover=remover)
    out[f"{name} removers"] = _table_runner(spec, fill, xs, target_s)
  out["flashbax removers"] = _flashbax_runner(fbx, fill, xs, target_s, platform)
  return out
