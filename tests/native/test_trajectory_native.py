"""Trajectory tables' native executor (funcreplay/native/trajectory.py): the C++ window
gather gives bit-identical batches and states to the portable program.

Equality is the oracle: hypothesis draws a spec (envs, time capacity, length, period,
sampler, episode tracking, reuse limit, staleness, packed or per-leaf storage with
1/2/4-byte and bool leaves) and a sequence of operations (adds of 1..T steps with per-env
masks and episode starts across many wraps, samples with and without replacement,
``where`` and staleness masks, priority updates) and runs it on
``make_trajectory_table(spec, native=True)`` and ``native=False`` side by side, comparing
every output and the whole state after every step. The payload of each env is its step
counter, so every valid window must also be consecutive, aligned, written and kept (the
increasing-payload invariant).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hst

import funcreplay as fr
from funcreplay.core.trajectory import make_trajectory_table as core_make_trajectory_table
from funcreplay.core.trajectory import rows
from funcreplay.native import trajectory as native_traj
from tests.helpers import require_native_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Step signatures: packed rows (every leaf 4 bytes: one uint32[E, T, R] array) and
# per-leaf storage with 1- and 2-byte leaves (the kernel copies rows of any byte width).
PACKED = {"x": jax.ShapeDtypeStruct((), jnp.int32), "y": jax.ShapeDtypeStruct((2,), jnp.float32)}
LEAVES = {"x": jax.ShapeDtypeStruct((), jnp.int32), "flag": jax.ShapeDtypeStruct((), jnp.bool_),
          "small": jax.ShapeDtypeStruct((3,), jnp.int8), "h": jax.ShapeDtypeStruct((), jnp.float16)}


@pytest.fixture(autouse=True)
def _need_kernels():
  require_native_kernels()


@functools.lru_cache(maxsize=None)
def jitted(spec, native):
  t = fr.make_trajectory_table(spec, native=native)
  return t._replace(add=jax.jit(t.add), update_priorities=jax.jit(t.update_priorities),
                    sample=jax.jit(t.sample, static_argnames=("batch_size", "replace")))


def steps_of(sig, payload):
  """Steps whose every leaf encodes ``payload`` (int32[E, t]; small enough for int8 / f16)."""
  p = jnp.asarray(payload, jnp.int32)
  if sig is PACKED:
    return {"x": p, "y": jnp.stack([p, -p], -1).astype(jnp.float32)}
  return {"x": p, "flag": p % 2 == 1,
          "small": jnp.stack([p, p + 1, -p], -1).astype(jnp.int8),
          "h": (p % 1024).astype(jnp.float16)}


def assert_trees_equal(a, b, what):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, what
  for i, (x, y) in enumerate(zip(la, lb)):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, f"{what}: leaf {i}"
    assert x.tobytes() == y.tobytes(), f"{what}: leaf {i} differs"


def check_windows(spec, smp, count):
  """The increasing-payload invariant on every valid row."""
  x = np.asarray(smp.data["x"])
  for i in np.flatnonzero(np.asarray(smp.valid)):
    env = int(smp.info.slot[i]) // spec.windows_per_env
    assert (np.diff(x[i]) == 1).all(), f"row {i}: not consecutive: {x[i]}"
    assert x[i, 0] % spec.period == 0 and x[i, -1] < count[env] and x[i, 0] >= count[env] - \
        spec.time_capacity, f"row {i}: window {x[i]} of env {env} (written {count[env]})"
  assert not x[~np.asarray(smp.valid)].any()


OPS = hst.lists(hst.tuples(hst.sampled_from(["add", "add", "sample", "update"]),
                           hst.integers(0, 2**16), hst.booleans()), min_size=2, max_size=9)


@settings(max_examples=8, deadline=None)
@given(num_envs=hst.integers(1, 3), period=hst.sampled_from([1, 2, 3]),
       length=hst.integers(1, 5), reps=hst.integers(1, 3), cross=hst.booleans(),
       prio=hst.booleans(), reuse=hst.sampled_from([0, 2]),
       stale=hst.sampled_from([None, 1]), packed=hst.booleans(), ops=OPS,
       seed=hst.integers(0, 2**31 - 1))
def test_native_equals_portable(num_envs, period, length, reps, cross, prio, reuse, stale,
                                packed, ops, seed):
  cap = period * max(reps, -(-length // period))
  sig = PACKED if packed else LEAVES
  spec = fr.TrajectorySpec(num_envs, cap, length, period, sig,
                           sampler=fr.Prioritized(0.6) if prio else fr.Uniform(),
                           max_times_sampled=reuse, max_staleness=stale, cross_episodes=cross)
  assert rows.packed(spec) == packed
  nat, por = jitted(spec, True), jitted(spec, False)
  s_n, s_p = nat.init(), por.init()
  rs = np.random.RandomState(seed)
  count = np.zeros(num_envs, np.int64)
  version, last = 0, None
  for i, (op, bits_, flag) in enumerate(ops + [("sample", 1, False)]):  # end on a sample
    if op == "add":
      # 1 step, T - 1 (moves the head: windows wrap) or T (a whole wrap in one block).
      t = (1, max(1, cap - 1), cap)[bits_ % 3]
      mask = np.array([(bits_ >> e) & 1 == 0 or e == i % num_envs for e in range(num_envs)])
      payload = count[:, None] + np.arange(t)[None, :]
      first = None if cross else jnp.asarray(rs.rand(num_envs, t) < 0.25)
      version += bits_ % 2
      args = dict(version=version, mask=jnp.asarray(mask), first=first)
      s_n = nat.add(s_n, steps_of(sig, payload), **args)
      s_p = por.add(s_p, steps_of(sig, payload), **args)
      count += np.where(mask, t, 0)
    elif op == "sample":
      key = jax.random.PRNGKey(seed + i)
      where = None
      if bits_ % 3 == 0:
        where = jnp.asarray(rs.rand(spec.num_windows) < 0.7)
      kw = dict(batch_size=2 if flag else 5, replace=bool(bits_ % 4 == 1), where=where,
                version=version if stale is not None else None)
      s_n, o_n = nat.sample(s_n, key, **kw)
      s_p, o_p = por.sample(s_p, key, **kw)
      assert_trees_equal(o_n, o_p, f"op {i}: sample")
      check_windows(spec, o_n, count)
      last = o_n
    elif last is not None and prio:
      pr = jnp.asarray(rs.uniform(0, 2, last.valid.shape), jnp.float32)
      s_n = nat.update_priorities(s_n, last.info.slot, last.info.key, pr)
      s_p = por.update_priorities(s_p, last.info.slot, last.info.key, pr)
    assert_trees_equal(s_n, s_p, f"op {i} ({op}): state")


@settings(max_examples=6, deadline=None)
@given(num_envs=hst.integers(1, 4), period=hst.sampled_from([1, 2, 3]),
       length=hst.integers(1, 5), reps=hst.integers(1, 3),
       adds=hst.lists(hst.tuples(hst.integers(1, 7), hst.integers(0, 15)), min_size=1,
                      max_size=4),
       cross=hst.booleans(), seed=hst.integers(0, 2**31 - 1))
def test_native_lean_draws_equal_portable(num_envs, period, length, reps, adds, cross, seed):
  """The native uniform draws without masks (closed form with ``cross_episodes=True``, the
  episode index otherwise) pick the portable program's windows: uneven envs, wraps, batch sizes up
  to past the stored windows, with and without replacement, raw and typed keys."""
  cap = period * max(reps, -(-length // period))
  spec = fr.TrajectorySpec(num_envs, cap, length, period, PACKED, cross_episodes=cross)
  nat, por = jitted(spec, True), jitted(spec, False)
  s_n, s_p = nat.init(), por.init()
  count = np.zeros(num_envs, np.int64)
  rs = np.random.RandomState(seed)
  for i, (t, bits_) in enumerate(adds):
    t = min(t, cap)
    mask = np.array([(bits_ >> e) & 1 == 0 for e in range(num_envs)])
    payload = count[:, None] + np.arange(t)[None, :]
    kw = dict(mask=jnp.asarray(mask))
    if not cross:
      kw["first"] = jnp.asarray(rs.rand(num_envs, t) < 0.1)
    s_n = nat.add(s_n, steps_of(PACKED, payload), **kw)
    s_p = por.add(s_p, steps_of(PACKED, payload), **kw)
    count += np.where(mask, t, 0)
    for b, replace in ((3, False), (spec.num_windows + 1, False), (3, True)):
      key = jax.random.key(seed + i) if replace else jax.random.PRNGKey(seed + i)
      o_n = nat.sample(s_n, key, batch_size=b, replace=replace)
      o_p = por.sample(s_p, key, batch_size=b, replace=replace)
      assert_trees_equal(o_n, o_p, f"add {i}: sample b={b} replace={replace}")
      check_windows(spec, o_n[1], count)
    s_n, s_p = o_n[0], o_p[0]


@pytest.mark.parametrize("cross", [False, True])
def test_lean_draws_every_rank(cross):
  """Every position of the native draws at once (a batch of all stored windows, 8 words of
  episode index under a 4-level tree): the same windows, in the same order, as portable."""
  spec = fr.TrajectorySpec(4, 80, 5, 1, PACKED, cross_episodes=cross)
  nat, por = jitted(spec, True), jitted(spec, False)
  rs = np.random.RandomState(0)
  s = nat.init()
  for i in range(3):
    first = None if cross else jnp.asarray(rs.rand(4, 50) < 0.05)
    s = nat.add(s, steps_of(PACKED, np.arange(50)[None, :] + 50 * i + np.zeros((4, 1))),
                mask=jnp.asarray(rs.rand(4) < 0.8), first=first)
    n = int(nat.count(s))
    for replace in (False, True):
      a = nat.sample(s, jax.random.PRNGKey(i), batch_size=n + 2, replace=replace)
      b = por.sample(s, jax.random.PRNGKey(i), batch_size=n + 2, replace=replace)
      assert_trees_equal(a, b, f"round {i} replace={replace}")
      if not replace:
        assert int(a[1].valid.sum()) == n > 32
        assert len(set(np.asarray(a[1].info.slot)[:n])) == n


@pytest.mark.parametrize("num_envs,period,length", [(3, 1, 5), (2, 4, 8), (5, 3, 4)])
def test_increasing_payload_many_wraps_in_a_scan(num_envs, period, length):
  """flashbax PR #51's invariant with the native gather inside one ``lax.scan`` (12 wraps,
  masked envs), and the same batches as the portable scan."""
  cap, t, b, n_rounds = 24, 5, 16, 60
  spec = fr.TrajectorySpec(num_envs, cap, length, period, PACKED, cross_episodes=True)

  def run(table):
    def body(carry, key):
      state, count = carry
      k_mask, k_sample = jax.random.split(key)
      mask = jax.random.bernoulli(k_mask, 0.7, (num_envs,))
      payload = count[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
      state = table.add(state, steps_of(PACKED, payload), mask=mask)
      count = count + jnp.where(mask, t, 0)
      state, s = table.sample(state, k_sample, batch_size=b)
      return (state, count), (s, count)
    keys = jax.random.split(jax.random.key(length * 7 + period), n_rounds)
    return jax.jit(lambda s: jax.lax.scan(body, (s, jnp.zeros((num_envs,), jnp.int32)),
                                          keys))(table.init())
  (s_n, _), (o_n, counts) = run(fr.make_trajectory_table(spec, native=True))
  (s_p, _), (o_p, _) = run(fr.make_trajectory_table(spec, native=False))
  assert_trees_equal((s_n, o_n), (s_p, o_p), "scan")
  for r in range(n_rounds):
    check_windows(spec, jax.tree_util.tree_map(lambda x, r=r: x[r], o_n), np.asarray(counts[r]))
  assert int(o_n.valid[-1].sum()) == min(b, int(o_n.num_eligible[-1])) > 0


def _compiled(table, spec):
  f = jax.jit(lambda s, k: table.sample(s, k, batch_size=4))
  return f.lower(table.init(), jax.random.PRNGKey(0)).compile().as_text()


def test_kernel_runs_only_when_chosen(monkeypatch):
  spec = fr.TrajectorySpec(2, 16, 4, 2, PACKED)
  assert native_traj.TARGET in _compiled(fr.make_trajectory_table(spec, native=True), spec)
  assert native_traj.TARGET not in _compiled(fr.make_trajectory_table(spec, native=False), spec)
  assert native_traj.TARGET not in _compiled(core_make_trajectory_table(spec), spec)
  monkeypatch.setenv("FUNCREPLAY_NATIVE", "0")  # read when the table is built
  assert native_traj.TARGET not in _compiled(fr.make_trajectory_table(spec), spec)
  monkeypatch.setenv("FUNCREPLAY_NATIVE", "1")
  assert native_traj.TARGET in _compiled(fr.make_trajectory_table(spec), spec)
  # The lean uniform draws (no mask) run natively too: the episode index, the closed form.
  text = _compiled(fr.make_trajectory_table(spec, native=True), spec)
  assert native_traj.INDEX_DRAW_TARGET in text and native_traj.DRAW_TARGET not in text
  cross = spec.replace(cross_episodes=True)
  assert native_traj.DRAW_TARGET in _compiled(fr.make_trajectory_table(cross, native=True),
                                              cross)
  assert native_traj.DRAW_TARGET not in _compiled(fr.make_trajectory_table(cross, native=False),
                                                  cross)
  # Sub-byte leaves are packed two per byte by XLA: the portable gather, same results.
  int4 = fr.TrajectorySpec(2, 16, 4, 2, {"x": jax.ShapeDtypeStruct((), jnp.int4)})
  assert not native_traj.supports(int4)
  assert native_traj.TARGET not in _compiled(fr.make_trajectory_table(int4, native=True), int4)


def test_vmap_over_tables_matches_portable():
  spec = fr.TrajectorySpec(2, 16, 4, 1, LEAVES, sampler=fr.Prioritized(0.5))

  def run(table, key):
    def body(state, k):
      state = table.add(state, steps_of(LEAVES, jnp.full((2, 3), 7, jnp.int32)))
      return table.sample(state, k, batch_size=5)
    return jax.lax.scan(body, table.init(), jax.random.split(key, 8))
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  a = jax.jit(jax.vmap(functools.partial(run, fr.make_trajectory_table(spec, native=True))))(keys)
  b = jax.jit(jax.vmap(functools.partial(run, fr.make_trajectory_table(spec, native=False))))(
      keys)
  assert_trees_equal(a, b, "vmap")
  assert int(a[1].valid.sum()) > 0


def test_bad_input_is_named():
  spec = fr.TrajectorySpec(2, 16, 4, 2, PACKED)
  with pytest.raises(TypeError, match="expects a TrajectorySpec"):
    fr.make_trajectory_table(fr.TableSpec(8, PACKED), native=True)
  with pytest.raises(TypeError, match="executor must be None or a trajectory executor"):
    core_make_trajectory_table(spec, executor=True)
  table = fr.make_trajectory_table(spec, native=True)
  with pytest.raises(ValueError, match="batch_size must be a static int"):
    table.sample(table.init(), jax.random.PRNGKey(0), batch_size=0)
  with pytest.raises(ValueError, match="axis 0 must be the env axis"):
    table.add(table.init(), steps_of(PACKED, jnp.zeros((3, 1), jnp.int32)))
  # The kernel refuses a window id out of range instead of reading outside the buffer.
  data = table.init().data
  with pytest.raises(Exception, match="window id 16 out of range"):
    jax.block_until_ready(jax.jit(lambda d: native_traj.gather_windows(
        spec, d, jnp.array([0, 16], jnp.int32), jnp.array([True, True])))(data))


def test_missing_compiler_warns_once_and_runs_portable(tmp_path):
  """No C++ compiler (and no cached build): one RuntimeWarning, the portable gather, the
  same batch."""
  code = """
import warnings
import jax, jax.numpy as jnp, numpy as np
import funcreplay as fr
spec = fr.TrajectorySpec(2, 16, 4, 2, {"x": jnp.zeros((), jnp.int32)})
with warnings.catch_warnings(record=True) as w:
  warnings.simplefilter("always")
  t = fr.make_trajectory_table(spec, native=True)
  t2 = fr.make_trajectory_table(spec, native=True)
assert [str(x.message) for x in w if "native CPU kernels unavailable" in str(x.message)], w
assert sum("unavailable" in str(x.message) for x in w) == 1, [str(x.message) for x in w]
s = t.add(t.init(), {"x": jnp.arange(20, dtype=jnp.int32).reshape(2, 10)})
a = t.sample(s, jax.random.PRNGKey(3), batch_size=4)[1].data["x"]
p = fr.make_trajectory_table(spec, native=False)
b = p.sample(s, jax.random.PRNGKey(3), batch_size=4)[1].data["x"]
assert np.array_equal(a, b)
text = jax.jit(lambda s: t.sample(s, jax.random.PRNGKey(0), batch_size=4)).lower(s).as_text()
assert "funcreplay_window_gather" not in text
print("ok")
"""
  env = dict(os.environ, PATH=str(tmp_path), CXX="", FUNCREPLAY_CACHE_DIR=str(tmp_path),
             PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


def test_windows_copied_in_chunks_equal_portable():
  """The gather copies windows in chunks of >= 16 KB, on XLA's thread pool as well as the
  calling thread (csrc/xla_row_pool.h): windows of 8 steps of 4 KB (a chunk each), after
  the time ring wrapped, with and without replacement; every window consecutive."""
  big = {"x": jax.ShapeDtypeStruct((), jnp.int32),
         "obs": jax.ShapeDtypeStruct((1024,), jnp.float32)}
  spec = fr.TrajectorySpec(3, 64, 8, 1, big, cross_episodes=True)
  outs = {}
  for native in (True, False):
    t = jitted(spec, native)
    assert (native_traj.TARGET in _compiled(fr.make_trajectory_table(spec, native=native),
                                            spec)) == native
    s = t.init()
    for r in range(3):  # 120 steps an env into a ring of 64
      p = (jnp.arange(3)[:, None] * 1000 + r * 40 + jnp.arange(40)[None, :]).astype(jnp.int32)
      s = t.add(s, {"x": p, "obs": jnp.broadcast_to(p[..., None], (3, 40, 1024)).astype(
          jnp.float32)})
    batches = []
    for i, replace in enumerate((False, True)):
      s, smp = t.sample(s, jax.random.PRNGKey(i), batch_size=32, replace=replace)
      batches.append(smp)
    outs[native] = (s, batches)
  assert_trees_equal(outs[True], outs[False], "chunked windows")
  for smp in outs[True][1]:
    x, obs = np.asarray(smp.data["x"]), np.asarray(smp.data["obs"])
    assert int(np.sum(smp.valid)) == 32
    np.testing.assert_array_equal(obs[..., 7], x)
    assert np.all(np.diff(x, axis=1) == 1) and np.all(x % 1000 >= 120 - 64)
