"""One algorithm, two executors (issue 25): the native CPU kernels and the portable JAX
programs give bit-identical batches and states for the same ``(state, key)``.

Equality is the oracle: hypothesis draws a spec (samplers, removers, reuse limits,
staleness) and a sequence of operations (inserts, samples with / without replacement,
``where`` and staleness masks, priority updates, deletes) and runs it on a
``make_table(spec, native=True)`` and a ``native=False`` table side by side, comparing
every output and the whole state after every step. The kernels' random bits are checked
against ``jax.random.bits`` / ``jax.random.split`` directly, and the same key gives the
same batch before and after a checkpoint on both executors.
"""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcreplay as fr
from funcreplay import checkpoint
from funcreplay.core.sampling import exact
from funcreplay.native import build
from tests.helpers import ITEM, assert_bit_identical, items_from_ids, require_native_kernels

CAP = 16


@pytest.fixture(autouse=True)
def _need_kernels():
  require_native_kernels()


def _lib():
  lib = build.library()
  lib.funcreplay_stream_words.argtypes = [ctypes.c_uint32] * 3 + [ctypes.c_int64] + [
      ctypes.c_void_p] * 2
  lib.funcreplay_split_key.argtypes = [ctypes.c_uint32] * 2 + [ctypes.c_void_p]
  lib.funcreplay_positions.argtypes = [ctypes.c_uint32] * 3 + [ctypes.c_int64] * 2 + [
      ctypes.c_int, ctypes.c_void_p]
  lib.funcreplay_positions.restype = ctypes.c_int64
  return lib


@pytest.mark.parametrize("seed", [0, 1, 2**32 - 1])
def test_threefry_words_and_split_equal_jax(seed):
  lib = _lib()
  key = jax.random.PRNGKey(seed)
  k0, k1 = (int(x) for x in np.asarray(key))
  for n in (1, 7, 384):
    hi, lo = np.zeros(n, np.uint32), np.zeros(n, np.uint32)
    lib.funcreplay_stream_words(k0, k1, 0, n, hi.ctypes.data, lo.ctypes.data)
    want = np.asarray(jax.random.bits(key, (2, n), jnp.uint32))
    np.testing.assert_array_equal(hi, want[0])
    np.testing.assert_array_equal(lo, want[1])
    for stream in (1, 4):  # the portable streams, computed by exact.stream_words
      lib.funcreplay_stream_words(k0, k1, stream, n, hi.ctypes.data, lo.ctypes.data)
      w_hi, w_lo = exact.stream_words(key, n, stream)
      np.testing.assert_array_equal(hi, np.asarray(w_hi))
      np.testing.assert_array_equal(lo, np.asarray(w_lo))
  out = np.zeros(4, np.uint32)
  lib.funcreplay_split_key(k0, k1, out.ctypes.data)
  np.testing.assert_array_equal(out.reshape(2, 2), np.asarray(jax.random.split(key)))
  nxt, sub = exact.split(key)
  np.testing.assert_array_equal(np.stack([nxt, sub]), np.asarray(jax.random.split(key)))
  typed = jax.random.key(seed)
  nxt, sub = exact.split(typed)
  np.testing.assert_array_equal(jax.random.key_data(jnp.stack([nxt, sub])),
                                jax.random.key_data(jax.random.split(typed)))


@settings(max_examples=15)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 40), b=st.integers(1, 40),
       replace=st.booleans(), stream=st.integers(0, 5))
def test_positions_equal_portable(seed, n, b, replace, stream):
  lib = _lib()
  key = jax.random.PRNGKey(seed)
  k0, k1 = (int(x) for x in np.asarray(key))
  out = np.zeros(b, np.int64)
  got = lib.funcreplay_positions(k0, k1, stream, n, b, int(replace), out.ctypes.data)
  x, valid = exact.positions(key, n, b, replace, stream, 64)
  assert got == int(np.sum(valid))
  np.testing.assert_array_equal(out[:got], np.asarray(x)[:got])


# Specs: every program the kernel runs (lean uniform / prioritized, masked and reuse-limited
# uniform rounds, masked prioritized), two removers. Rate limiter: the kernel keeps its diff.
LIMITER = fr.SampleToInsertRatio(2.5, 1, (-1e6, 1e6))
SPECS = [
    dict(sampler=fr.Uniform()),
    dict(sampler=fr.Uniform(), remover=fr.Uniform()),
    dict(sampler=fr.Uniform(), max_times_sampled=2, max_staleness=2),
    dict(sampler=fr.Uniform(), remover=fr.Uniform(), max_times_sampled=1),
    dict(sampler=fr.Prioritized(0.7)),
    dict(sampler=fr.Prioritized(1.0), max_times_sampled=2, max_staleness=1),
    dict(sampler=fr.Prioritized(0.5), remover=fr.Uniform(), max_staleness=3),
    dict(sampler=fr.Uniform(), holes=False),  # the ring map (uniform_lean.ring_slot)
    # The position index (core/position_index.py, csrc/position_index.h): order[x], the
    # inserts' appends, the used-up items' swap-removal; deletes through the portable op.
    dict(sampler=fr.Uniform(), position_index=True, max_times_sampled=2, max_staleness=2),
    dict(sampler=fr.Uniform(), remover=fr.Uniform(), position_index=True),
]
_PROGRAMS = {}


def _programs(i, native):
  """Jitted pure functions of spec ``i`` (cached: one compile per shape)."""
  got = _PROGRAMS.get((i, native))
  if got is None:
    spec = fr.TableSpec(CAP, ITEM, rate_limiter=LIMITER, **SPECS[i])
    t = fr.make_table(spec, native=native)
    got = dict(
        spec=spec, init=t.init, insert=jax.jit(t.insert),
        sample=jax.jit(t.sample, static_argnames=("batch_size", "replace")),
        update=jax.jit(t.update_priorities), delete=jax.jit(t.delete))
    _PROGRAMS[(i, native)] = got
  return got


OPS = st.lists(st.tuples(
    st.sampled_from(["insert", "sample", "sample", "replace", "where", "prio", "delete",
                     "version"]),
    st.integers(0, 2**31 - 1)), min_size=1, max_size=14)


@settings(max_examples=14)
@given(spec_i=st.integers(0, len(SPECS) - 1), ops=OPS)
def test_native_and_portable_are_bit_identical(spec_i, ops):
  nat, por = _programs(spec_i, True), _programs(spec_i, False)
  spec = nat["spec"]
  states = [nat["init"](), por["init"]()]
  version, inserted = 0, 0
  for step, (op, r) in enumerate(ops):
    rs = np.random.default_rng(r)
    uniform_remover = isinstance(spec.remover, fr.Uniform)
    if op == "insert":
      n = int(rs.choice([1, 3, 8]))
      prio = jnp.asarray(rs.choice([0.0, 0.25, 1.0, 3.0], n), jnp.float32)
      args = dict(version=version - int(rs.integers(0, 3)), priority=prio,
                  rng=jax.random.PRNGKey(r) if uniform_remover else None)
      states = [p["insert"](s, items_from_ids(np.arange(inserted, inserted + n)), **args)
                for p, s in zip((nat, por), states)]
      inserted += n
    elif op in ("sample", "replace", "where"):
      b = int(rs.choice([1, 3, 8]))
      where = jnp.asarray(rs.random(CAP) < 0.5) if op == "where" else None
      ver = version if (spec.max_staleness is not None or rs.random() < 0.5) else None
      outs = [p["sample"](s, jax.random.PRNGKey(r), batch_size=b, version=ver, where=where,
                          replace=op == "replace") for p, s in zip((nat, por), states)]
      assert_bit_identical(outs[0][1], outs[1][1], f"step {step} {op} batch")
      states = [o[0] for o in outs]
      if spec.prioritized and rs.random() < 0.5:  # write back new priorities for the batch
        info = outs[0][1].info
        prio = jnp.asarray(rs.choice([0.0, 0.5, 2.0], b), jnp.float32)
        states = [p["update"](s, info.slot, info.key, prio) for p, s in zip((nat, por), states)]
    elif op == "prio":
      slots = jnp.asarray(rs.integers(0, CAP, 4), jnp.int32)
      prio = jnp.asarray(rs.random(4) * 4, jnp.float32)
      states = [p["update"](s, slots, s.key[slots], prio) for p, s in zip((nat, por), states)]
    elif op == "delete":
      slots = jnp.asarray(rs.integers(0, CAP, 2), jnp.int32)
      if not spec.holes:  # refused while tracing, on both executors
        for p, s in zip((nat, por), states):
          with pytest.raises(ValueError, match="holes=False"):
            p["delete"](s, slots, s.key[slots])
        continue
      states = [p["delete"](s, slots, s.key[slots]) for p, s in zip((nat, por), states)]
    else:
      version += int(rs.integers(1, 3))
    assert_bit_identical(states[0], states[1], f"step {step} {op} state")


@pytest.mark.parametrize("spec_i", [2, 5])
def test_same_key_same_batch_after_checkpoint_on_both_executors(tmp_path, spec_i):
  spec = _programs(spec_i, True)["spec"]
  batches = {}
  for native in (True, False):
    p = _programs(spec_i, native)
    s = p["insert"](p["init"](), items_from_ids(np.arange(12)), version=3,
                    priority=jnp.linspace(0.0, 2.0, 12, dtype=jnp.float32),
                    rng=jax.random.PRNGKey(0) if isinstance(spec.remover, fr.Uniform) else None)
    path = str(tmp_path / f"ckpt-{native}")
    checkpoint.save(path, s, spec)
    restored, _ = checkpoint.restore(path, spec)
    for label, state in (("before", s), ("after", restored)):
      batches[(native, label)] = p["sample"](state, jax.random.PRNGKey(7), batch_size=5,
                                             version=4)
  want = batches[(True, "before")]
  for k, got in batches.items():
    assert_bit_identical(got, want, f"{k}")


def test_non_threefry_keys_run_the_portable_program():
  """The kernel reproduces threefry only: another key implementation samples with the
  portable program under native=True too (so both executors agree there as well)."""
  spec = fr.TableSpec(CAP, ITEM)
  outs = []
  for native in (True, False):
    t = fr.make_table(spec, native=native)
    s = t.insert(t.init(), items_from_ids(np.arange(10)))
    outs.append(jax.jit(lambda s, k, t=t: t.sample(s, k, batch_size=4))(
        s, jax.random.key(3, impl="rbg")))
  assert_bit_identical(outs[0], outs[1], "rbg key")


@pytest.mark.parametrize("capacity", [300, 5000, 70_000])
def test_two_stage_prioritized_draws_are_bit_identical_in_large_tables(capacity):
  """From 256 leaves the weight descent redraws its target halfway down
  (``weight_descent.redraw_depth``: depths 4, 8 and 8 here): the kernel's ``DescendWeight``
  redraws at the same node with the same word, with and without replacement, under a mask
  (its own tree, and the exact completion when few items are eligible)."""
  spec = fr.TableSpec(capacity, ITEM, sampler=fr.Prioritized(0.8))
  rs = np.random.default_rng(capacity)
  n = capacity - 7  # a partial last node
  prio = jnp.asarray(rs.choice([0.0, 0.1, 1.0, 30.0], n) * rs.random(n), jnp.float32)
  sample = {}
  states = {}
  for native in (True, False):
    t = fr.make_table(spec, native=native)
    states[native] = jax.jit(t.insert)(t.init(), items_from_ids(np.arange(n)), priority=prio)
    sample[native] = jax.jit(t.sample, static_argnames=("batch_size", "replace"))
  assert_bit_identical(states[True], states[False], "insert")
  few = jnp.asarray(rs.random(capacity) < 40 / capacity)  # ~40 eligible: the completion runs
  half = jnp.asarray(rs.random(capacity) < 0.5)
  for i, (b, replace, where) in enumerate([(256, False, None), (64, True, None),
                                           (32, False, half), (64, False, few)]):
    outs = [sample[native](states[native], jax.random.PRNGKey(i), batch_size=b,
                           replace=replace, where=where) for native in (True, False)]
    assert_bit_identical(outs[0][1], outs[1][1], f"sample {i}")
    assert_bit_identical(outs[0][0], outs[1][0], f"state after sample {i}")


def test_draws_from_a_tiny_total_are_spread_and_identical():
  """Weights near float32's smallest normals (priorities 3e-19 at exponent 2: 9e-38 each).
  XLA rewrote ``(x * 2**-24) * total`` as ``x * (total * 2**-24)``, a subnormal flushed to
  0 on XLA:CPU: every portable target was 0 and every draw slot 0, while the kernel drew
  all four (found by a review). ``bits.uniform24`` scales by the exponent's bits."""
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized(2.0))
  prio = jnp.asarray([3e-19] * 4 + [0.0] * 4, jnp.float32)
  slots = {}
  for native in (True, False):
    t = fr.make_table(spec, native=native)
    st = jax.jit(t.insert)(t.init(), items_from_ids(np.arange(8)), priority=prio)
    draw = jax.jit(jax.vmap(lambda k, t=t, st=st: t.sample(
        st, k, batch_size=4, replace=True)[1].info.slot))
    slots[native] = np.asarray(draw(jax.random.split(jax.random.PRNGKey(0), 200)))
  np.testing.assert_array_equal(slots[True], slots[False])
  counts = np.bincount(slots[False].ravel(), minlength=8)
  assert np.all(counts[:4] > 120) and np.all(counts[4:] == 0), counts


def test_probabilities_of_a_total_below_tiny_are_exact():
  """Four priorities of 1e-16 at exponent 2: a total of 4e-32, below numerics.TINY, which
  floored it: each probability read 0.01 for 0.25 (found by a review). Now the floor is
  the smallest normal float, which no positive total is below; both executors."""
  spec = fr.TableSpec(8, ITEM, sampler=fr.Prioritized(2.0))
  for native in (True, False):
    t = fr.make_table(spec, native=native)
    st = t.insert(t.init(), items_from_ids(np.arange(4)),
                  priority=jnp.full((4,), 1e-16, jnp.float32))
    for replace in (True, False):
      _, b = t.sample(st, jax.random.PRNGKey(0), batch_size=3, replace=replace)
      np.testing.assert_allclose(np.asarray(b.info.probability), 0.25, rtol=1e-6,
                                 err_msg=f"{native=} {replace=}")


@pytest.mark.parametrize("sampler", [fr.Uniform(), fr.Prioritized(0.7)])
def test_rows_copied_in_chunks_are_bit_identical(sampler):
  """The kernel copies a batch's rows in chunks of ~16 KB, on XLA's thread pool as well
  as the calling thread (csrc/parallel.h); without replacement each row increments its
  own slot's times sampled there. Items of 4 KB and batches of 64: 16 chunks, with and
  without replacement, a reuse limit freeing used-up items, the staleness sum of a
  version, and holes (deleted slots: the descent, not the prefix shortcut)."""
  big = {"x": jax.ShapeDtypeStruct((), jnp.int32), "y": jax.ShapeDtypeStruct((1024,), jnp.float32)}
  spec = fr.TableSpec(500, big, sampler=sampler, max_times_sampled=3)
  ids = np.arange(400, dtype=np.int32)
  items = {"x": jnp.asarray(ids), "y": jnp.asarray(ids[:, None] + np.zeros((1, 1024), np.float32))}
  prio = jnp.asarray(np.random.default_rng(1).random(400) + 0.1, jnp.float32)
  results = {}
  for native in (True, False):
    t = fr.make_table(spec, native=native)
    s = jax.jit(t.insert)(t.init(), items, priority=prio, version=jnp.asarray(ids % 7))
    gone = jnp.arange(0, 400, 9, dtype=jnp.int32)
    s = jax.jit(t.delete)(s, gone, s.key[gone])
    sample = jax.jit(t.sample, static_argnames=("batch_size", "replace"))
    outs = []
    for i, replace in enumerate([False, True, False, True, False]):
      s, b = sample(s, jax.random.PRNGKey(i), batch_size=64, replace=replace, version=9)
      outs.append(b)
    results[native] = (s, outs)
  assert_bit_identical(results[True], results[False], "chunked rows")
  # the batches are real: 64 valid rows each, whose items carry their slot's id
  for b in results[True][1]:
    assert int(np.sum(b.valid)) == 64
    np.testing.assert_array_equal(np.asarray(b.data["y"])[:, 5], np.asarray(b.data["x"]))


def test_count_descents_in_chunks_are_bit_identical():
  """With holes the kernel descends the count tree for each row (a full table or a ring
  without holes takes the prefix shortcut), in chunks of 64 rows on XLA's thread pool as
  well as the calling thread (csrc/draw.h ``KthOccupied``). Batches of 300 (5 chunks,
  the last partial), with and without replacement, against the portable descent."""
  spec = fr.TableSpec(4096, {"x": jax.ShapeDtypeStruct((), jnp.int32)})
  ids = np.arange(4000, dtype=np.int32)
  results = {}
  for native in (True, False):
    t = fr.make_table(spec, native=native)
    s = jax.jit(t.insert)(t.init(), {"x": jnp.asarray(ids)})
    gone = jnp.arange(3, 4000, 7, dtype=jnp.int32)
    s = jax.jit(t.delete)(s, gone, s.key[gone])
    sample = jax.jit(t.sample, static_argnames=("batch_size", "replace"))
    outs = []
    for i, replace in enumerate([False, True, False]):
      s, b = sample(s, jax.random.PRNGKey(i), batch_size=300, replace=replace)
      outs.append(b)
    results[native] = (s, outs)
  assert_bit_identical(results[True], results[False], "chunked count descents")
  for b in results[True][1]:  # real batches: 300 valid rows, none of them deleted
    assert int(np.sum(b.valid)) == 300
    assert not np.any(np.asarray(b.data["x"]) % 7 == 3)
    np.testing.assert_array_equal(np.asarray(b.data["x"]), np.asarray(b.info.slot))
