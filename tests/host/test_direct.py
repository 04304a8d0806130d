"""Direct host sampling (``Table.sample_packed(out=...)``, ``funcreplay.host.direct``).

A CPU table on the native kernels samples in place into the caller's buffer
without a jitted call. It must be indistinguishable from the jitted path:
the same bytes in the batch, the same blocking decisions (rate limiter,
``min_valid``, staleness), the same state afterwards and the same key. The
reference here is a second table with the same seed and history whose
direct path is switched off, so it runs the jitted sample and copies into
``out``.
"""

import threading
import time

import jax
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import funcreplay as fr
import funcreplay.torch as frt
from funcreplay.core import packing
from tests.helpers import require_native_kernels

OBS = 3


def _item():
  return {"obs": np.zeros(OBS, np.float32), "a": np.zeros((), np.int32),
          "flag": np.zeros((), np.bool_), "b": np.zeros((2,), np.uint8)}


def _batch(n, start):
  ids = np.arange(start, start + n)
  return {"obs": np.stack([ids, -ids, ids * 0.5], -1).astype(np.float32),
          "a": ids.astype(np.int32), "flag": ids % 3 == 0,
          "b": np.stack([ids % 256, (ids * 7) % 256], -1).astype(np.uint8)}


SPECS = {
    "uniform ring": dict(sampler=fr.Uniform()),
    "uniform, Uniform remover": dict(sampler=fr.Uniform(), remover=fr.Uniform()),
    "prioritized": dict(sampler=fr.Prioritized(0.6)),
    "staleness + reuse": dict(sampler=fr.Uniform(), max_staleness=2, max_times_sampled=2),
    "prioritized + reuse": dict(sampler=fr.Prioritized(1.0), max_times_sampled=3),
    # The masked prioritized program: the C++ prologue builds the masked sum tree.
    "prioritized + staleness": dict(sampler=fr.Prioritized(0.6), max_staleness=1,
                                    max_times_sampled=2),
    "rate limited": dict(sampler=fr.Uniform(),
                         rate_limiter=fr.SampleToInsertRatio(2.0, 4, 6.0)),
    "uniform, no holes": dict(sampler=fr.Uniform(), holes=False),  # the ring map
    # The position index: order[x], used-up items swap-removed (position_index.h).
    "position index + reuse": dict(sampler=fr.Uniform(), position_index=True,
                                   max_times_sampled=2),
}


def _tables(name, capacity=16, seed=3, portable=False):
  """A direct table and a reference of the same seed: the jitted path with the native
  kernel, or (``portable``) a ``Table(native=False)``: the portable JAX programs."""
  require_native_kernels()
  spec = fr.TableSpec(capacity, _item(), **SPECS[name])
  direct, ref = fr.Table(spec, seed=seed), fr.Table(spec, seed=seed, native=not portable)
  assert direct.samples_in_place, name
  ref._direct = False  # the jitted path (then a copy into out)  # noqa: SLF001
  return direct, ref


def _out(table, rows):
  return np.full(packing.layout(table.spec.signature, rows).nbytes, 0xAB, np.uint8)


def _assert_same_state(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a.snapshot()),
                  jax.tree_util.tree_leaves(b.snapshot())):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
  np.testing.assert_array_equal(a.host_state()["rng"], b.host_state()["rng"])


def _sample_both(direct, ref, rows, **kw):
  """Sample both tables; both raise TimeoutError or neither, with the same bytes."""
  outs, errors = [], []
  for t in (direct, ref):
    out = _out(t, rows)
    try:
      got = t.sample_packed(rows, timeout=0, out=out, **kw)
      assert got.buffer is out
      errors.append(None)
    except TimeoutError as e:
      errors.append(str(e))
    outs.append(out)
  assert errors[0] == errors[1]
  if errors[0] is None:
    np.testing.assert_array_equal(outs[0], outs[1])
  return errors[0] is None


# Row counts of inserts and samples. Each distinct sample size is a program the jitted
# reference compiles (inserts are bucketed to powers of two), so a few sizes, not every
# one from 1 to 12: one row, a few, and more than a 16-slot table's eligible items once
# it holds holes or stale items (the suite spent ~3 minutes compiling the others).
SIZES = st.sampled_from([1, 2, 5, 12])
OPS = st.lists(st.tuples(st.sampled_from(["insert", "sample", "replace", "version", "prio",
                                          "snapshot"]),
                         SIZES, st.integers(0, 5)), min_size=1, max_size=30)


@pytest.mark.parametrize("name", list(SPECS))
@settings(max_examples=15)
@given(ops=OPS)
def test_direct_matches_jitted_path(name, ops):
  _run_both(name, ops, portable=False)


@pytest.mark.parametrize("name", ["uniform, Uniform remover", "staleness + reuse",
                                  "prioritized + staleness", "rate limited",
                                  "uniform, no holes", "position index + reuse"])
@settings(max_examples=6)
@given(ops=OPS)
def test_direct_matches_portable_program(name, ops):
  """One algorithm, two executors (issue 25): the in-place C++ path and the portable JAX
  programs (``native=False``) give the same bytes, timeouts, states and keys."""
  _run_both(name, ops, portable=True)


def _run_both(name, ops, portable):
  direct, ref = _tables(name, portable=portable)
  inserted, sampled = 0, 0
  version = 0
  for op, n, m in ops:
    if op == "insert":
      for t in (direct, ref):
        try:
          t.insert(_batch(n, inserted), version=version - m % 3, priority=0.5 + m, timeout=0)
        except TimeoutError as e:
          assert e.inserted >= 0
      inserted += n
    elif op in ("sample", "replace"):
      sampled += _sample_both(direct, ref, n, replace=op == "replace",
                              min_valid=min(m, n) if op == "sample" else 1)
    elif op == "version":
      version += m
      direct.set_version(version)
      ref.set_version(version)
    elif op == "prio" and direct.spec.prioritized and direct.size:
      out = _out(direct, 4)
      try:
        smp = direct.sample_packed(4, out=out, min_valid=1, timeout=0).numpy()
      except TimeoutError:  # every priority set to 0: nothing eligible, in both
        with pytest.raises(TimeoutError):
          ref.sample_packed(4, out=_out(ref, 4), min_valid=1, timeout=0)
        continue
      ref_smp = ref.sample_packed(4, out=_out(ref, 4), min_valid=1, timeout=0).numpy()
      np.testing.assert_array_equal(smp.info.slot, ref_smp.info.slot)
      new = np.arange(4, dtype=np.float32) * m
      direct.update_priorities(smp.info.slot, smp.info.key, new)
      ref.update_priorities(ref_smp.info.slot, ref_smp.info.key, new)
    elif op == "snapshot":  # a pending read of the state, then direct writes
      before = ref.snapshot()
      snap = direct.snapshot()
      _sample_both(direct, ref, n, min_valid=1)
      for x, y in zip(jax.tree_util.tree_leaves(snap),
                      jax.tree_util.tree_leaves(before)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  _assert_same_state(direct, ref)
  assert direct.stats().to_dict() == ref.stats().to_dict()


def test_where_and_plain_sample_interleave_with_direct():
  """``where`` takes the jitted path (copied into out); Table.sample, inserts and direct
  samples share one state and one key sequence."""
  direct, ref = _tables("uniform ring", capacity=32)
  for t in (direct, ref):
    t.insert(_batch(20, 0))
  mask = np.arange(32) % 2 == 0
  for step in range(6):
    _sample_both(direct, ref, 4, where=mask)
    _sample_both(direct, ref, 5)
    a, b = direct.sample(3), ref.sample(3)
    np.testing.assert_array_equal(np.asarray(a.info.slot), np.asarray(b.info.slot))
    for t in (direct, ref):
      t.insert(_batch(3, 100 + 3 * step))
  _assert_same_state(direct, ref)


def test_direct_packed_bytes_match_sample():
  """The direct buffer unpacks to what ``Table.sample`` returns for the same history."""
  direct, ref = _tables("prioritized", capacity=64)
  for t in (direct, ref):
    t.insert(_batch(50, 0), priority=np.linspace(0.1, 3, 50))
  got = direct.sample_packed(16, out=_out(direct, 16)).numpy()
  want = ref.sample(16)
  for x, y in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.5, 0.6, 1.0, 1.7, 2.0, 3.0])
def test_direct_priority_update_matches_jitted_bit_for_bit(alpha, monkeypatch):
  """The direct update computes priority**alpha in C++ (powers.h), the jitted one in XLA
  (core.powers): the weight trees (and the rest of the state) must agree to the bit, for
  every exponent (0.5 and whole numbers included: no exponent takes the jitted path)."""
  require_native_kernels()
  spec = fr.TableSpec(64, _item(), sampler=fr.Prioritized(alpha), remover=fr.Uniform())
  direct, ref = fr.Table(spec, seed=5), fr.Table(spec, seed=5)
  ref._direct = False  # noqa: SLF001
  rng = np.random.default_rng(int(alpha * 10))
  for t in (direct, ref):
    t.insert(_batch(64, 0))
  jitted, mutate = [], direct._mutate  # noqa: SLF001
  monkeypatch.setattr(direct, "_mutate", lambda what, *a: jitted.append(what) or mutate(what, *a))
  keys = np.asarray(direct.snapshot().key)
  denormal_rounds = []
  for r in range(8):
    k = int(rng.integers(1, 200))
    slots = rng.integers(-1, 64, k).astype(np.int32)  # duplicates: the last one wins
    row_keys = keys[np.maximum(slots, 0)].copy()
    row_keys[rng.random(k) < 0.1] += 1  # stale keys: ignored
    # Normal floats from 1e-38 up (weights that underflow to denormals: flushed to 0)
    # to where 64 weights still sum to a finite float, zeros; every other round a
    # denormal, which goes through XLA.
    top = 80 / max(alpha, 1)
    edge = [0.0, 1.2e-38, 1e-30, 1e-29, 1e-20, float(np.exp(top)), 1.0, 2.0, 3.239208]
    p = np.concatenate([rng.random(k), np.exp(rng.uniform(-87, top, k)), edge])
    p = rng.permutation(p)[:k].astype(np.float32)
    p[slots < 0] = np.nan  # ignored rows may hold anything
    if r % 2 and (slots >= 0).any():
      p[np.argmax(slots >= 0)] = 1e-45
      denormal_rounds.append("update_priorities")
    for t in (direct, ref):
      t.update_priorities(slots, row_keys, p)
    _assert_same_state(direct, ref)
  assert jitted == denormal_rounds  # the direct table ran the jitted update only for those
  # Then many floats (every slot, 40 rounds), spread over the normal range.
  slots = np.arange(64, dtype=np.int32)
  for r in range(40):
    p = [rng.random(64), np.exp(rng.uniform(-87, top, 64)), rng.uniform(0, 10, 64)][r % 3]
    for t in (direct, ref):
      t.update_priorities(slots, keys, p.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(direct.snapshot().weight_tree).view(np.uint32),
                                  np.asarray(ref.snapshot().weight_tree).view(np.uint32))
  _sample_both(direct, ref, 32)
  _assert_same_state(direct, ref)
  assert direct.stats().to_dict() == ref.stats().to_dict()


def test_samples_in_place_only_where_it_applies():
  require_native_kernels()
  item = _item()
  assert not fr.Table(fr.TableSpec(8, item, sampler=fr.Fifo())).samples_in_place
  # Prioritized with max_staleness: in place since the prologue moved into C++ (issue 24).
  assert fr.Table(fr.TableSpec(8, item, sampler=fr.Prioritized(0.6),
                               max_staleness=1)).samples_in_place
  portable = fr.Table(fr.TableSpec(8, item), native=False)
  assert not portable.samples_in_place
  # Not in place: out still receives the batch (a copy of the jitted one).
  portable.insert(_batch(8, 0))
  out = _out(portable, 4)
  smp = portable.sample_packed(4, out=out)
  assert smp.buffer is out
  assert smp.numpy().valid.all()


@pytest.mark.parametrize("bad, err, match", [
    (lambda n: np.zeros(n, np.int8), ValueError, "out must be uint8"),
    (lambda n: np.zeros(n + 1, np.uint8), ValueError, "out must be uint8"),
    (lambda n: np.zeros((n, 2), np.uint8)[:, 0], ValueError, "C-contiguous"),
    (lambda n: np.zeros(n, np.uint8).setflags(write=False), None, None),
    (lambda n: list(range(n)), TypeError, "numpy array or a CPU torch tensor"),
    (lambda n: torch.zeros(n, dtype=torch.uint8, requires_grad=False).float(), ValueError,
     "out must be uint8"),
])
def test_bad_out_is_refused_and_table_intact(bad, err, match):
  direct, ref = _tables("uniform ring")
  for t in (direct, ref):
    t.insert(_batch(10, 0))
  n = packing.layout(direct.spec.signature, 4).nbytes
  buf = bad(n)
  if buf is None:  # setflags returns None: build a read-only array instead
    buf = np.zeros(n, np.uint8)
    buf.setflags(write=False)
    err, match = ValueError, "writable"
  with pytest.raises(err, match=match):
    direct.sample_packed(4, out=buf)
  _sample_both(direct, ref, 4)  # the failed call drew nothing, changed nothing
  _assert_same_state(direct, ref)


@pytest.mark.timeout(60)
def test_a_refused_sample_leaves_the_callers_buffer_as_it_was():
  """A sample that ``min_valid`` (or the limiter) refuses writes nothing into ``out``:
  the direct kernel wrote an all-invalid batch there, over the batch of the caller's
  previous call, before the call timed out (the jitted path copies only on success;
  found by a review). Both paths; the state and key stay untouched."""
  direct, ref = _tables("uniform ring")
  for t in (direct, ref):
    t.insert(_batch(2, 0))
    buf = _out(t, 3)
    assert int(np.sum(t.sample_packed(3, out=buf, min_valid=2).numpy().valid)) == 2
    kept = buf.copy()
    with pytest.raises(TimeoutError, match="min_valid=3"):
      t.sample_packed(3, out=buf, timeout=0.0)  # 2 eligible items, 3 rows wanted
    np.testing.assert_array_equal(buf, kept)
  _sample_both(direct, ref, 2)
  _assert_same_state(direct, ref)


def test_torch_out_is_written_in_place():
  direct, _ = _tables("uniform ring")
  direct.insert(_batch(10, 0))
  out = torch.empty(packing.layout(direct.spec.signature, 4).nbytes, dtype=torch.uint8)
  got = direct.sample_packed(4, out=out)
  assert got.buffer is out
  (batch,) = frt.packed_batches(got)
  ptr, end = out.data_ptr(), out.data_ptr() + out.numel()
  for t in [*batch.data.values(), batch.valid, batch.info.slot]:
    assert ptr <= t.data_ptr() < end
  assert bool(batch.valid.all())
  ids = batch.data["a"].numpy()
  np.testing.assert_array_equal(batch.data["obs"].numpy()[:, 1], -ids.astype(np.float32))


def test_torch_sampler_batches_stay_intact():
  """Each TorchSampler batch owns its buffer: later samples and inserts do not alter it."""
  direct, _ = _tables("uniform ring", capacity=64)
  direct.insert(_batch(64, 0))
  sampler = frt.TorchSampler(direct, 8, prefetch=0, on_copy="raise")
  assert sampler._sample(8).buffer.__class__ is torch.Tensor  # noqa: SLF001
  it = iter(sampler)
  first = next(it)
  kept = {k: v.clone() for k, v in first.data.items()}
  for _ in range(20):
    next(it)
    direct.insert(_batch(16, 1000))
  for k, v in kept.items():
    torch.testing.assert_close(first.data[k], v, rtol=0, atol=0)
  it.close()


def test_direct_sampling_with_concurrent_inserts():
  """An insert thread and a direct-sampling thread: bounded in time, nothing lost, the
  counters add up."""
  direct, _ = _tables("staleness + reuse", capacity=256)
  direct.insert(_batch(64, 0))
  stop, errors, rows = threading.Event(), [], [0]

  def produce():
    i = 64
    try:
      while not stop.is_set():
        direct.insert(_batch(8, i), version=direct.version)
        i += 8
    except Exception as e:  # noqa: BLE001
      errors.append(e)

  def consume():
    try:
      out = _out(direct, 16)
      for k in range(300):
        direct.set_version(k // 50)
        smp = direct.sample_packed(16, out=out, min_valid=1, timeout=5).numpy()
        valid = smp.valid
        rows[0] += int(valid.sum())
        assert (smp.info.version[valid] >= direct.version - 2).all()
        assert len(set(smp.info.slot[valid].tolist())) == int(valid.sum())
    except Exception as e:  # noqa: BLE001
      errors.append(e)

  threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
  t0 = time.monotonic()
  for t in threads:
    t.start()
  threads[1].join(timeout=60)
  stop.set()
  threads[0].join(timeout=60)
  assert not any(t.is_alive() for t in threads) and time.monotonic() - t0 < 60
  assert not errors, errors
  stats = direct.stats().to_dict()
  assert stats["samples"] == rows[0] > 0
  assert stats["inserts"] == stats["size"] + stats["evicted_capacity"] + stats["evicted_reuse"]


def test_read_only_programs_finish_before_the_lock_is_released(monkeypatch):
  """A table that may sample in place waits for its read-only programs (snapshot, stats)
  before releasing the lock, even before its first direct sample: a later direct sample
  writes the buffers they read. (XLA:CPU usually runs such a copy inline, so the race is
  rare here; the test checks that the wait is made, then that the copy is intact.)"""
  require_native_kernels()
  table = fr.Table(fr.TableSpec(64, _item()), seed=1)
  table.insert(_batch(64, 0))
  waited = []
  real = jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or real(x))
  snap = table.snapshot()  # before the table ever sampled in place
  stats = table.stats()
  assert any(w is snap for w in waited) and any(w is stats for w in waited)
  times = np.asarray(snap.times_sampled).copy()
  table.sample_packed(32, out=_out(table, 32))
  np.testing.assert_array_equal(np.asarray(snap.times_sampled), times)
  assert int(np.asarray(table.snapshot().times_sampled).sum()) == 32
