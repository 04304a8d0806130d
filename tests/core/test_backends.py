"""Same ``(state, key)`` -> same batch and state on every backend (issue 25).

The portable programs run the same op sequence on the CPU and on each accelerator JAX
sees (GPU / TPU), and every batch and the whole state after every step must be
bit-identical. The sequences cover the paths where backends can part: duplicate
indices in scatters (sampling with replacement, priority updates of one slot twice,
which XLA:GPU may apply in any order), float32 priority sums (the sum tree's path
updates; a compiler that contracts ``a * b + c`` into an FMA on one backend only would
move a sample), sorts of ties, and the ``where`` / staleness masks.

Runs only where an accelerator is present (``JAX_PLATFORMS=cuda,cpu`` on a GPU machine;
the suite's default is ``cpu`` alone): ``experiments/gpu_check.sh`` runs it there. The
native CPU kernels have their own oracle (tests/native/test_native_identity.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from tests.helpers import ITEM, assert_bit_identical, items_from_ids

CAP = 64
STEPS = 40


def _accelerators():
  try:
    return [d for d in jax.devices() if d.platform != "cpu"]
  except RuntimeError:  # pragma: no cover - a backend that failed to initialise
    return []


ACCELERATORS = _accelerators()
pytestmark = pytest.mark.skipif(
    not ACCELERATORS, reason="no accelerator: set JAX_PLATFORMS=cuda,cpu on a GPU machine")

SPECS = {
    "uniform": dict(sampler=fr.Uniform()),
    "uniform-remover": dict(sampler=fr.Uniform(), remover=fr.Uniform()),
    "uniform-reuse-staleness": dict(sampler=fr.Uniform(), max_times_sampled=2, max_staleness=3),
    "prioritized": dict(sampler=fr.Prioritized(0.6)),
    "prioritized-reuse-staleness": dict(sampler=fr.Prioritized(1.0), max_times_sampled=3,
                                        max_staleness=2),
    "prioritized-lifo": dict(sampler=fr.Prioritized(0.8), remover=fr.Lifo()),
    # The ordered samplers: on a GPU ``ordering.first_eligible`` sorts the table
    # (``sort_first``), on the CPU it selects by top-k passes (``select_first``).
    "min-heap-queue": dict(sampler=fr.MinHeap(), remover=fr.Fifo(), max_times_sampled=1),
    "max-heap-staleness": dict(sampler=fr.MaxHeap(), max_staleness=3),
    "stack": dict(sampler=fr.Lifo(), remover=fr.Lifo()),
    "stalest-first": dict(sampler=fr.StalestFirst(), max_times_sampled=2),
}


@functools.lru_cache(maxsize=None)
def programs(name):
  spec = fr.TableSpec(CAP, ITEM, **SPECS[name])
  t = fr.make_table(spec, native=False)
  return spec, t, dict(
      insert=jax.jit(t.insert),
      sample=jax.jit(t.sample, static_argnames=("batch_size", "replace")),
      update=jax.jit(t.update_priorities), delete=jax.jit(t.delete))


def run_sequence(name, device, seed):
  """The op sequence of ``seed`` on ``device``; returns every output, in order, on the host."""
  spec, table, p = programs(name)
  put = functools.partial(jax.device_put, device=device)
  rs = np.random.default_rng(seed)
  state = put(table.init())
  outs, version, inserted = [], 0, 0
  random_sampler = isinstance(spec.sampler, (fr.Uniform, fr.Prioritized))  # others: no replace
  for _ in range(STEPS):
    op = rs.choice(["insert", "insert", "sample", "replace", "where", "prio", "delete",
                    "version"])
    if op == "insert":
      n = int(rs.choice([1, 5, 16]))
      prio = put(jnp.asarray(rs.choice([0.0, 0.3, 1.0, 7.5], n), jnp.float32))
      rng = put(jax.random.PRNGKey(int(rs.integers(2**31))))
      state = p["insert"](state, put(items_from_ids(np.arange(inserted, inserted + n))),
                          version=version - int(rs.integers(0, 3)), priority=prio,
                          rng=rng if isinstance(spec.remover, fr.Uniform) else None)
      inserted += n
    elif op in ("sample", "replace", "where"):
      b = int(rs.choice([1, 8, 32]))
      where = put(jnp.asarray(rs.random(CAP) < 0.6)) if op == "where" else None
      state, batch = p["sample"](state, put(jax.random.PRNGKey(int(rs.integers(2**31)))),
                                 batch_size=b, version=version, where=where,
                                 replace=op == "replace" and random_sampler)
      outs.append((op, jax.device_get(batch)))
      if spec.prioritized:  # write back new priorities, a slot twice when replace repeats it
        prio = put(jnp.asarray(rs.random(b) * 3, jnp.float32))
        state = p["update"](state, batch.info.slot, batch.info.key, prio)
    elif op == "prio":
      slots = put(jnp.asarray(rs.integers(0, CAP, 6), jnp.int32))  # duplicates likely
      state = p["update"](state, slots, state.key[slots],
                          put(jnp.asarray(rs.random(6) * 5, jnp.float32)))
    elif op == "delete":
      slots = put(jnp.asarray(rs.integers(0, CAP, 3), jnp.int32))
      state = p["delete"](state, slots, state.key[slots])
    else:
      version += 1
    outs.append((op, jax.device_get(state)))
  return outs


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("seed", [0, 1])
def test_same_key_same_batch_and_state_on_every_backend(name, seed):
  want = run_sequence(name, jax.devices("cpu")[0], seed)
  for device in ACCELERATORS:
    got = run_sequence(name, device, seed)
    assert len(got) == len(want)
    for i, ((op, g), (_, w)) in enumerate(zip(got, want)):
      assert_bit_identical(g, w, f"{device.platform} {name} seed {seed}, output {i} ({op})")


def grouped_takes(sampler, device, seed):
  """Grouped selections (``select_by``: a take / peek of 5 tasks) of a table of
  ``sampler`` with tasks, versions and priorities drawn by ``seed``, on ``device``."""
  from funcreplay.core.ops import grouped
  spec = fr.TableSpec(CAP, ITEM, sampler=sampler, metadata=("task",))
  t = fr.make_table(spec, native=False)
  put = functools.partial(jax.device_put, device=device)
  rs = np.random.default_rng(seed)
  n = 50
  state = jax.jit(t.insert)(
      put(t.init()), put(items_from_ids(np.arange(n))),
      version=put(jnp.asarray(rs.integers(-3, 3, n), jnp.int32)),
      priority=put(jnp.asarray(rs.choice([0.0, 0.3, 1.0, 7.5], n), jnp.float32)),
      metadata={"task": put(jnp.asarray(rs.integers(0, 5, n), jnp.int32))})
  random = isinstance(sampler, (fr.Uniform, fr.Prioritized))
  select = jax.jit(lambda s, counts, key: grouped.select_by(
      spec, s, "task", jnp.arange(5, dtype=jnp.int32), counts, batch_size=32,
      rng=key if random else None))
  return [jax.device_get(select(state, put(jnp.asarray(rs.integers(0, 9, 5), jnp.int32)),
                                put(jax.random.PRNGKey(i)))) for i in range(4)]


@pytest.mark.parametrize("sampler", [fr.Prioritized(0.6), fr.Uniform(), fr.StalestFirst()],
                         ids=["prioritized", "uniform", "stalest"])
def test_grouped_takes_are_the_same_on_every_backend(sampler):
  """A GPU selects each group's rows by one sort (``grouped.sort_by_group``), the CPU by
  top-k stages; a prioritized take's exponential races use ``powers.race_keys``."""
  want = grouped_takes(sampler, jax.devices("cpu")[0], 0)
  for device in ACCELERATORS:
    assert_bit_identical(grouped_takes(sampler, device, 0), want, f"{device.platform} take")


TRAJECTORY_SPECS = {
    "uniform-episodes": dict(sampler=fr.Uniform()),
    "uniform-cross": dict(sampler=fr.Uniform(), cross_episodes=True),
    "prioritized": dict(sampler=fr.Prioritized(0.6)),
    "prioritized-reuse-staleness": dict(sampler=fr.Prioritized(0.8), max_times_sampled=2,
                                        max_staleness=2),
}


def trajectory_sequence(name, device, seed):
  """A trajectory table's op sequence of ``seed`` on ``device`` (adds with episode starts,
  samples with and without replacement and masks, priority updates); every output."""
  spec = fr.TrajectorySpec(3, 16, 4, 2, {"x": jax.ShapeDtypeStruct((), jnp.int32)},
                           **TRAJECTORY_SPECS[name])
  t = fr.make_trajectory_table(spec, native=False)
  add = jax.jit(t.add)
  sample = jax.jit(t.sample, static_argnames=("batch_size", "replace"))
  update = jax.jit(t.update_priorities)
  put = functools.partial(jax.device_put, device=device)
  rs = np.random.default_rng(seed)
  state, outs, version, step = put(t.init()), [], 0, 0
  for _ in range(30):
    op = rs.choice(["add", "add", "add", "sample", "replace", "where", "version"])
    if op == "add":
      t_steps = int(rs.choice([1, 3]))
      x = step + np.arange(3 * t_steps).reshape(3, t_steps)
      first = None if spec.cross_episodes else put(jnp.asarray(rs.random((3, t_steps)) < 0.1))
      state = add(state, {"x": put(jnp.asarray(x, jnp.int32))}, version=version, first=first)
      step += 3 * t_steps
    elif op in ("sample", "replace", "where"):
      where = put(jnp.asarray(rs.random(spec.num_windows) < 0.6)) if op == "where" else None
      state, batch = sample(state, put(jax.random.PRNGKey(int(rs.integers(2**31)))),
                            batch_size=int(rs.choice([1, 4, 8])), version=version,
                            where=where, replace=op == "replace")
      outs.append((op, jax.device_get(batch)))
      if isinstance(spec.sampler, fr.Prioritized):
        prio = put(jnp.asarray(rs.random(batch.info.slot.shape[0]) * 3, jnp.float32))
        state = update(state, batch.info.slot, batch.info.key, prio)
    else:
      version += 1
    outs.append((op, jax.device_get(state)))
  return outs


@pytest.mark.parametrize("name", list(TRAJECTORY_SPECS))
def test_trajectory_tables_are_the_same_on_every_backend(name):
  want = trajectory_sequence(name, jax.devices("cpu")[0], 0)
  for device in ACCELERATORS:
    got = trajectory_sequence(name, device, 0)
    for i, ((op, g), (_, w)) in enumerate(zip(got, want)):
      assert_bit_identical(g, w, f"{device.platform} {name}, output {i} ({op})")
