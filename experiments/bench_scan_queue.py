"""``bench_scan.py --cases=queue``: Reverb's queue inside ``lax.scan``.

One step (``smp-ins``): take the 64 oldest items (``sample`` of a ``fr.queue`` table:
Fifo sampler, Fifo ring remover, each item sampled once, so the 64 leave the table)
and insert 64 new ones; ``ins-smp``: the same in the other order. Every sampled field
consumed; 20 steps per jitted scan call, C = 65,536, the table at C - 64 items between
steps. Ours: ``make_table(fr.queue(C, ...), native=False)``;
its order comes off the ring (``sampling.ring_order``, O(B log C)) where the other
ordered samplers sort all C slots; ``ring``: ``fr.queue(C, ..., holes=False)``, whose
items are the ring window before ``write_pos`` (its order by ring arithmetic, O(B)).

The peer: flashbax's trajectory queue (``make_trajectory_queue``, one row of C time
steps, add and sample 64 steps at a time). It keeps a read and a write index and
nothing else (no keys, reuse counts, occupancy or counters; it cannot delete an item
or mask a sample). In ``smp-ins`` its sample's reads are not ordered before its add's
in-place write, so XLA copies its buffer every step (``funcreplay.core.inplace``: ours
orders them); ``ins-smp`` has no such copy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import funcreplay as fr
from experiments.timing import Holder, consume, example, transitions

CAPACITY = 1 << 16
STEPS, BATCH = 20, 64
KINDS = ("smp-ins", "ins-smp")


def table_step(t, insert_first: bool):
  """``f(state, i0, xs) -> (state, acc)``: ``STEPS`` queue steps of table ``t`` in a
  scan, every sampled field consumed (also compiled deviceless by accel_hlo.py)."""
  def f(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s = t.insert(s, x) if insert_first else s
      s, smp = t.sample(s, jax.random.PRNGKey(v), batch_size=BATCH)
      s = s if insert_first else t.insert(s, x)
      return (s, acc + consume(smp.data), v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc
  return f


def flashbax_queue(fbx):
  return fbx.make_trajectory_queue(max_length_time_axis=CAPACITY, add_batch_size=1,
                                   add_sequence_length=BATCH, sample_sequence_length=BATCH)


def flashbax_step(queue, insert_first: bool):
  """``table_step`` for flashbax's trajectory queue."""
  def f(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      add = lambda s: queue.add(s, jax.tree_util.tree_map(lambda a: a[None], x))  # noqa: E731
      s = add(s) if insert_first else s
      s, smp = queue.sample(s)
      s = s if insert_first else add(s)
      return (s, acc + consume(smp.experience), v + 1), None
    (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs)
    return s, acc
  return f


def _ours(fill, xs, target_s, insert_first, holes=True):
  t = fr.make_table(fr.queue(CAPACITY, example(), holes=holes), native=False)
  h = Holder(jax.jit(t.insert, donate_argnums=0)(t.init(), fill))
  return h.runner(jax.jit(table_step(t, insert_first), donate_argnums=0), xs,
                  target_s=target_s)


def _flashbax(fbx, fill, xs, target_s, insert_first):
  queue = flashbax_queue(fbx)
  add = jax.jit(queue.add, donate_argnums=0)
  h = Holder(queue.init(example()))
  rows = jax.tree_util.tree_map(lambda a: a.reshape((-1, BATCH) + a.shape[1:])[:, None], fill)
  for i in range(rows["reward"].shape[0]):
    h.state = add(h.state, jax.tree_util.tree_map(lambda a, i=i: a[i], rows))
  return h.runner(jax.jit(flashbax_step(queue, insert_first), donate_argnums=0), xs,
                  target_s=target_s)


def runners(fbx, target_s):
  """``{"portable smp-ins": Runner, "ring smp-ins": Runner, "flashbax smp-ins": Runner,
  ... ins-smp}``."""
  fill = jax.device_put(transitions(CAPACITY - BATCH, seed=1))
  xs = jax.device_put({k: v.reshape((STEPS, BATCH) + v.shape[1:])
                       for k, v in transitions(STEPS * BATCH, seed=3).items()})
  out = {}
  for kind in KINDS:
    first = kind == "ins-smp"
    out[f"portable {kind}"] = _ours(fill, xs, target_s, first)
    # fr.queue(..., holes=False): the ring window (TableSpec.holes), no tree read.
    out[f"ring {kind}"] = _ours(fill, xs, target_s, first, holes=False)
    out[f"flashbax {kind}"] = _flashbax(fbx, fill, xs, target_s, first)
  return out
