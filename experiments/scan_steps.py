"""The in-scan step programs of issue 25's cases, ours and flashbax's, built once.

``bench_scan.py`` times them; ``accel_hlo.py`` compiles them for a GPU and a TPU without
either and counts their operations. Every program is ``f(state, i0, xs) -> (state, acc)`` (the
prioritized ones ``f(state, i0)``): a ``lax.scan`` whose step ``v`` samples with
``PRNGKey(i0 + v)``, and ``acc`` reads every sampled leaf (``timing.consume``), so XLA
keeps every gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from experiments.timing import consume

STEPS = 50
INS, SMP = 16, 256


def _scan(body, s, i0, xs, length=None):
  (s, acc, _), _ = jax.lax.scan(body, (s, jnp.float32(0), jnp.int32(i0)), xs, length=length)
  return s, acc


def uniform_steps(insert, sample):
  """``{"scan", "smp-ins", "insert1"}`` programs from ``insert(s, x) -> s`` and
  ``sample(s, key) -> (s, batch)``: insert then sample a step, the other order (the
  sample's reads, then the insert's in-place writes), and insert alone (``acc`` None)."""
  def scan(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s = insert(s, x)
      s, batch = sample(s, jax.random.PRNGKey(v))
      return (s, acc + consume(batch), v + 1), None
    return _scan(body, s, i0, xs)

  def sample_insert(s, i0, xs):
    def body(c, x):
      s, acc, v = c
      s, batch = sample(s, jax.random.PRNGKey(v))
      # Nothing orders flashbax's gather before its in-place add, so XLA copies its whole
      # buffer every step in this order (~17 ms a step at 262,144 slots; README); ours
      # orders its own reads (uniform_lean.finish; tests/experiments/test_scan_steps.py).
      acc = acc + consume(batch)
      return (insert(s, x), acc, v + 1), None
    return _scan(body, s, i0, xs)

  def insert1(s, i0, xs):
    del i0
    return jax.lax.scan(lambda s, x: (insert(s, x), None), s, xs)[0], None

  return {"scan": scan, "smp-ins": sample_insert, "insert1": insert1}


def table_uniform_steps(t, batch=SMP, replace=False):
  """``uniform_steps`` of a funcreplay table (uniform sample without replacement, or with
  ``replace``)."""
  def sample(s, key):
    s, smp = t.sample(s, key, batch_size=batch, replace=replace)
    return s, smp.data
  return uniform_steps(t.insert, sample)


def flashbax_uniform_steps(buf):
  """``uniform_steps`` of a flashbax item buffer (its sample leaves the state as it is)."""
  return uniform_steps(buf.add, lambda s, key: (s, buf.sample(s, key).experience))


def table_prioritized_step(t, batch=SMP):
  """Prioritized sample of ``batch`` + ``update_priorities`` to ``|reward| + 0.01``."""
  def f(s, i0):
    def body(c, _):
      s, acc, v = c
      s, smp = t.sample(s, jax.random.PRNGKey(v), batch_size=batch)
      s = t.update_priorities(s, smp.info.slot, smp.info.key,
                              jnp.abs(smp.data["reward"]) + 0.01)
      return (s, acc + consume((smp.data, smp.info.probability)), v + 1), None
    return _scan(body, s, i0, None, length=STEPS)
  return f


def flashbax_prioritized_step(buf):
  """flashbax's: sample (its batch size) + ``set_priorities``."""
  def f(s, i0):
    def body(c, _):
      s, acc, v = c
      smp = buf.sample(s, jax.random.PRNGKey(v))
      s = buf.set_priorities(s, smp.indices, jnp.abs(smp.experience["reward"]) + 0.01)
      return (s, acc + consume((smp.experience, smp.probabilities)), v + 1), None
    return _scan(body, s, i0, None, length=STEPS)
  return f
