"""Tests of the PyTorch bridge (funcreplay/torch.py) and the dqn_torch experiment smoke run.

Zero copy is proven by pointer equality (``unsafe_buffer_pointer()`` vs
``data_ptr()``); the cases where a copy is unavoidable are named tests that
check the copy is reported (and the values right). CUDA variants run only
when torch and JAX both see a GPU.
"""

import dataclasses
import gc
import json
import os
import subprocess
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import funcreplay as fr  # noqa: E402
import funcreplay.torch as frt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JAX_DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int8, jnp.uint8, jnp.int16,
              jnp.uint16, jnp.int32, jnp.uint32, jnp.bool_, jnp.complex64]
TORCH_OF = {jnp.float32: torch.float32, jnp.float16: torch.float16,
            jnp.bfloat16: torch.bfloat16, jnp.int8: torch.int8, jnp.uint8: torch.uint8,
            jnp.int16: torch.int16, jnp.uint16: torch.uint16, jnp.int32: torch.int32,
            jnp.uint32: torch.uint32, jnp.bool_: torch.bool, jnp.complex64: torch.complex64}


def _values(dtype, shape, seed=0):
  rng = np.random.default_rng(seed)
  dt = np.dtype(dtype)
  if dt == np.bool_:
    return rng.random(shape) < 0.5
  if dt.kind in "iu":
    info = np.iinfo(dt)
    return rng.integers(max(info.min, -1000), min(info.max, 1000), shape).astype(dt)
  if dt.kind == "c":
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
  return rng.standard_normal(shape).astype(dt)


def _np(t):
  """numpy copy of a tensor (bf16 via float32) for comparisons."""
  t = t.detach().cpu()
  return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def _jnp(x):
  x = np.asarray(x)
  return x.astype(np.float32) if x.dtype == jnp.bfloat16 else x


# --- JAX -> torch -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", JAX_DTYPES, ids=lambda d: np.dtype(d).name)
def test_to_torch_zero_copy_every_dtype(dtype):
  x = jnp.asarray(_values(dtype, (5, 3)))
  t, rep = frt.to_torch_with_report(x)
  assert t.dtype == TORCH_OF[dtype] and tuple(t.shape) == (5, 3)
  assert t.data_ptr() == x.unsafe_buffer_pointer()
  assert rep.all_zero_copy and rep.zero_copy == 1
  np.testing.assert_array_equal(_np(t), _jnp(x))


@pytest.mark.parametrize("dtype", JAX_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype_is_zero_copy_both_ways(dtype):
  x = jnp.asarray(_values(dtype, (4, 1, 2), seed=1))
  t = frt.to_torch(x, on_copy="raise")
  y, rep = frt.from_torch_with_report(t)
  assert rep.all_zero_copy, rep.describe()
  assert y.dtype == x.dtype and y.shape == x.shape
  assert y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
  np.testing.assert_array_equal(_jnp(y), _jnp(x))


def test_nested_pytree_scalars_size1_and_empty_round_trip():
  tree = {"obs": jnp.arange(6.0).reshape(3, 1, 2),
          "pair": (jnp.ones((1,), jnp.int32), [jnp.zeros((), jnp.bool_), jnp.float32(2.5)]),
          "empty": jnp.zeros((0, 4), jnp.float32),
          "host": np.arange(4, dtype=np.int16)}
  t, rep = frt.to_torch_with_report(tree)
  assert isinstance(t["pair"][1][0], torch.Tensor) and t["pair"][1][0].dtype == torch.bool
  assert t["pair"][1][1].shape == () and float(t["pair"][1][1]) == 2.5
  assert tuple(t["empty"].shape) == (0, 4)
  assert t["host"].data_ptr() == tree["host"].ctypes.data  # numpy: torch.from_numpy, shared
  assert rep.all_zero_copy and rep.leaves == 6
  back, rep = frt.from_torch_with_report(t)
  # The torch view of a small numpy array is usually not 64-byte aligned: JAX must copy it.
  assert all(p == "['host']" and "unaligned" in why for p, why in rep.copies), rep.describe()
  assert rep.zero_copy >= 5
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree), strict=True):
    assert a.shape == np.shape(b) and a.dtype == np.asarray(b).dtype
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=15)
@given(shape=st.lists(st.integers(0, 3), min_size=0, max_size=4),
       dtype=st.sampled_from([jnp.float32, jnp.bool_, jnp.int8, jnp.uint32, jnp.bfloat16]))
def test_round_trip_property(shape, dtype):
  x = jnp.asarray(_values(dtype, tuple(shape), seed=len(shape)))
  t = frt.to_torch({"x": x}, on_copy="raise")["x"]
  assert tuple(t.shape) == tuple(shape)
  y = frt.from_torch(t, on_copy="raise")
  np.testing.assert_array_equal(_jnp(y), _jnp(x))
  if x.size:
    assert t.data_ptr() == x.unsafe_buffer_pointer() == y.unsafe_buffer_pointer()


def test_to_torch_blocks_on_async_dispatch():
  a = jnp.ones((300, 300), jnp.float32)
  y = jax.jit(lambda a: (a @ a) @ a)(a)  # dispatched asynchronously
  t = frt.to_torch(y, on_copy="raise")
  assert float(t[0, 0]) == 300.0 * 300.0


def test_to_torch_keeps_buffer_alive_after_jax_array_is_dropped():
  x = jnp.arange(1024, dtype=jnp.float32) * 2
  t = frt.to_torch(x)
  del x
  gc.collect()
  np.testing.assert_array_equal(t.numpy(), np.arange(1024, dtype=np.float32) * 2)


def test_to_torch_refuses_table_state_and_deleted_arrays():
  t = fr.Table(fr.TableSpec(8, {"x": np.zeros(2, np.float32)}))
  with pytest.raises(TypeError, match="TableState"):
    frt.to_torch(t.snapshot())
  with pytest.raises(TypeError, match="TableState"):
    frt.to_torch({"state": t.snapshot()})
  x = jnp.ones(3)
  x.delete()
  with pytest.raises(ValueError, match="deleted"):
    frt.to_torch(x)
  with pytest.raises(TypeError, match="leaf"):
    frt.to_torch({"a": "not an array"})
  with pytest.raises(ValueError, match="on_copy"):
    frt.to_torch(jnp.ones(2), on_copy="sometimes")


def test_to_torch_numpy_negative_strides_is_a_named_copy():
  a = np.arange(6, dtype=np.float32)[::-1]
  t, rep = frt.to_torch_with_report({"ok": jnp.ones(2), "neg": a})
  assert rep.copies == (("['neg']", "numpy array with negative strides or non-native byte "
                         "order"),) and rep.zero_copy == 1
  np.testing.assert_array_equal(t["neg"].numpy(), a)
  with pytest.warns(frt.BridgeCopyWarning):
    frt.to_torch(a)


# --- torch -> JAX -------------------------------------------------------------------

def test_from_torch_requires_grad_is_detached_zero_copy():
  w = torch.arange(8, dtype=torch.float32, requires_grad=True)
  x, rep = frt.from_torch_with_report(w * 1)  # a non-leaf that requires grad
  assert rep.all_zero_copy
  np.testing.assert_array_equal(np.asarray(x), np.arange(8, dtype=np.float32))
  y, _ = frt.from_torch_with_report(w)
  assert y.unsafe_buffer_pointer() == w.data_ptr()


def test_from_torch_size1_dims_with_odd_strides_are_zero_copy():
  base = torch.arange(8, dtype=torch.float32)
  odd = torch.as_strided(base, (4, 1), (1, 7))   # size-1 dim with a meaningless stride
  x, rep = frt.from_torch_with_report({"a": odd, "b": base.reshape(8, 1, 1).unsqueeze(0)})
  assert rep.all_zero_copy, rep.describe()
  assert x["a"].unsafe_buffer_pointer() == odd.data_ptr()
  np.testing.assert_array_equal(np.asarray(x["a"]), odd.numpy())
  assert x["b"].shape == (1, 8, 1, 1)


def test_from_torch_transposed_dense_layout_is_zero_copy():
  t = torch.arange(12.0).reshape(3, 4).T  # dense, column-major
  x, rep = frt.from_torch_with_report(t)
  assert rep.all_zero_copy and x.unsafe_buffer_pointer() == t.data_ptr()
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a + 1)(x)), t.numpy() + 1)


def test_from_torch_unaligned_buffer_copy_is_detected():
  base = torch.arange(100, dtype=torch.float32)
  view = base[1:65]                       # 4 bytes past a 64-byte boundary
  assert view.data_ptr() % 64 != 0
  x, rep = frt.from_torch_with_report({"u": view})
  assert rep.zero_copy == 0 and "unaligned" in rep.describe()
  assert x["u"].unsafe_buffer_pointer() != view.data_ptr()
  np.testing.assert_array_equal(np.asarray(x["u"]), np.arange(1, 65, dtype=np.float32))
  with pytest.raises(ValueError, match="unaligned"):
    frt.from_torch(view, on_copy="raise")
  with pytest.warns(frt.BridgeCopyWarning, match="unaligned"):
    frt.from_torch(view)


def test_from_torch_non_dense_strides_are_made_contiguous_and_reported():
  t = torch.arange(24.0).reshape(4, 6)[:, ::2]
  x, rep = frt.from_torch_with_report(t)
  assert "non-dense" in rep.describe()
  np.testing.assert_array_equal(np.asarray(x), t.numpy())
  b = torch.arange(3.0).expand(4, 3)  # broadcast (stride 0)
  y, rep = frt.from_torch_with_report(b)
  assert "non-dense" in rep.describe()
  np.testing.assert_array_equal(np.asarray(y), b.numpy())


def test_from_torch_64bit_is_narrowed_explicitly_or_rejected():
  if jax.config.jax_enable_x64:
    pytest.skip("jax_enable_x64 is on: 64-bit dtypes cross unchanged")
  x, rep = frt.from_torch_with_report({"i": torch.arange(5),
                                       "f": torch.ones(2, dtype=torch.float64)})
  assert x["i"].dtype == jnp.int32 and x["f"].dtype == jnp.float32
  assert "narrowed" in rep.describe() and rep.zero_copy == 0
  np.testing.assert_array_equal(np.asarray(x["i"]), np.arange(5))
  with pytest.raises(ValueError, match="outside"):
    frt.from_torch(torch.tensor([2**40]), on_copy="ignore")


def test_from_torch_conjugate_bit_is_resolved():
  t = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()
  x, rep = frt.from_torch_with_report(t)
  np.testing.assert_array_equal(np.asarray(x), np.array([1 - 2j, 3 + 1j], np.complex64))
  assert "conjugate" in rep.describe()


def test_from_torch_aliasing_and_copy_true():
  t = torch.zeros(16)
  shared = frt.from_torch(t)
  snap = frt.from_torch(t, copy=True)
  t += 5  # an in-place torch update (e.g. an optimizer step)
  assert float(shared[0]) == 5.0   # zero copy: the JAX array sees it (documented)
  assert float(snap[0]) == 0.0     # copy=True: a snapshot
  assert snap.unsafe_buffer_pointer() != t.data_ptr()


# --- the table boundary --------------------------------------------------------------

PRIO = fr.Prioritized(0.6)


def _table(capacity=16, sampler=None, **kw):
  item = {"obs": np.zeros((3,), np.float32), "done": np.zeros((), np.bool_),
          "a": np.zeros((), np.int32)}
  return fr.Table(fr.TableSpec(capacity, item, sampler=sampler, **kw), seed=0)


def _rows(start, n):
  i = np.arange(start, start + n)
  return {"obs": np.stack([i, i + 0.5, -i], 1).astype(np.float32), "done": i % 3 == 0,
          "a": i.astype(np.int32)}


@pytest.mark.parametrize("batch", [4, 16])  # 16 == capacity: same shapes as the state
def test_sampled_batch_is_fresh_and_survives_further_inserts(batch):
  table = _table(16)
  table.insert(_rows(0, 16))
  b = frt.sample_to_torch(table.sample(batch), on_copy="raise")
  state_ptrs = {x.unsafe_buffer_pointer() for x in jax.tree_util.tree_leaves(
      table._state) if x.size}  # noqa: SLF001 (white-box: no tensor may view the state)
  tensors = jax.tree_util.tree_leaves(b)  # TorchBatch is a pytree
  assert len(tensors) == 3 + 1 + 6
  assert not {t.data_ptr() for t in tensors} & state_ptrs
  before = {k: v.clone() for k, v in b.data.items()}
  a = b.data["a"].numpy()
  np.testing.assert_array_equal(b.data["obs"][:, 0].numpy(), a.astype(np.float32))
  np.testing.assert_array_equal(b.data["done"].numpy(), a % 3 == 0)
  for k in range(3):  # overwrite every slot several times (donating the state each time)
    table.insert(_rows(100 + 16 * k, 16))
  for k, v in before.items():
    assert torch.equal(b.data[k], v), k
  table.close()


# --- packed batches: one export per call ------------------------------------------------

def _assert_batch_equals_sample(batch, smp):
  """A TorchBatch holds exactly the arrays of a JAX Sample (same dtypes, bool stays bool)."""
  pairs = list(zip(jax.tree_util.tree_leaves((batch.data, batch.valid, batch.info)),
                   jax.tree_util.tree_leaves((smp.data, smp.valid, smp.info)), strict=True))
  for t, x in pairs:
    assert t.dtype == TORCH_OF[jnp.dtype(x.dtype).type] and tuple(t.shape) == x.shape
    np.testing.assert_array_equal(_np(t), _jnp(x))
  assert batch.num_eligible == int(smp.num_eligible)


def test_packed_to_torch_is_one_zero_copy_export_of_the_whole_batch():
  twin_a, twin_b = _table(16, sampler=PRIO), _table(16, sampler=PRIO)
  for t in (twin_a, twin_b):
    t.insert(_rows(0, 16), priority=np.linspace(0.5, 2, 16))
  packed = twin_a.sample_packed(8)
  batch = frt.packed_to_torch(packed, beta=0.4, on_copy="raise")
  _assert_batch_equals_sample(batch, twin_b.sample(8))
  base = packed.buffer.unsafe_buffer_pointer()
  end = base + packed.layout.nbytes
  tensors = jax.tree_util.tree_leaves((batch.data, batch.valid, batch.info))
  for t, f in zip(tensors, packed.layout.fields, strict=False):
    assert t.data_ptr() == base + f.offset  # a view of the buffer, at the field's offset
    assert base <= t.data_ptr() and t.data_ptr() + t.nbytes <= end and t.is_contiguous()
  ref = (batch.info.probability.double() * batch.num_eligible) ** -0.4
  np.testing.assert_allclose(batch.weights.numpy(), (ref / ref.max()).numpy(), rtol=1e-5)
  before = [t.clone() for t in tensors]
  del packed  # torch keeps the buffer alive through the DLPack capsule
  gc.collect()
  for k in range(3):  # overwrite every slot (donating the state): the batch is untouched
    twin_a.insert(_rows(50 + 16 * k, 16))
    twin_a.sample_packed(8)
  for t, b in zip(tensors, before, strict=True):
    assert torch.equal(t, b)
  twin_a.close()
  twin_b.close()


def test_packed_batches_cut_one_call_into_row_ranges():
  twin_a, twin_b = _table(32), _table(32)
  for t in (twin_a, twin_b):
    t.insert(_rows(0, 32))
  parts = frt.packed_batches(twin_a.sample_packed(12), 3, on_copy="raise")
  whole = twin_b.sample(12)
  assert len(parts) == 3
  for i, part in enumerate(parts):
    _assert_batch_equals_sample(part, jax.tree_util.tree_map(lambda x, i=i: x[4 * i:4 * i + 4]
                                                            if x.ndim else x, whole))
  with pytest.raises(ValueError, match="parts must be an int >= 1 dividing the 12 rows"):
    frt.packed_batches(twin_a.sample_packed(12), 5)
  with pytest.raises(TypeError, match="expects a funcreplay PackedSample"):
    frt.packed_batches(whole)
  one = twin_a.sample_packed(4)
  stacked = fr.PackedSample(jnp.stack([one.buffer, one.buffer]), one.layout)  # as from vmap
  with pytest.raises(ValueError, match=r"packed_batches: expected a uint8\[\d+\] buffer"):
    frt.packed_batches(stacked)
  with pytest.raises(ValueError, match="on_copy must be one of"):
    frt.packed_batches(one, on_copy="bogus")
  twin_a.close()
  twin_b.close()


@pytest.mark.parametrize("parts", [1, 3])
def test_packed_info_columns_are_views_made_on_first_read(parts):
  import copy  # noqa: PLC0415
  twin_a, twin_b = _table(32, sampler=PRIO), _table(32, sampler=PRIO)
  for t in (twin_a, twin_b):
    t.insert(_rows(0, 32), priority=np.linspace(0.5, 2, 32))
  packed = twin_a.sample_packed(6 * parts)
  batches = frt.packed_batches(packed, parts, on_copy="raise")
  whole = twin_b.sample(6 * parts)
  base = packed.buffer.unsafe_buffer_pointer()
  offsets = {f.name: f.offset for f in packed.layout.fields}
  for i, b in enumerate(batches):
    info = b.info
    assert isinstance(info, frt.TorchInfo)
    assert not {"slot", "key", "probability"} & set(vars(info))  # nothing built yet
    np.testing.assert_array_equal(info.key.numpy(), np.asarray(whole.info.key)[6 * i:6 * i + 6])
    assert "key" in vars(info) and info.key is info.key  # built once, then an attribute
    assert info.key.data_ptr() == base + offsets["info.key"] + 4 * 6 * i
    assert "slot" not in vars(info)
    flat = jax.tree_util.tree_leaves(info)  # flattening builds the rest
    ref = jax.tree_util.tree_leaves(jax.tree_util.tree_map(lambda x, i=i: x[6 * i:6 * i + 6],
                                                           whole.info))
    assert len(flat) == 6
    for t, x in zip(flat, ref, strict=True):
      np.testing.assert_array_equal(_np(t), np.asarray(x))
    for other in (copy.copy(info), copy.deepcopy(info),
                  dataclasses.replace(info, priority=info.priority * 2)):
      assert type(other) is frt.TorchInfo and "_make" not in vars(other)
      assert torch.equal(other.slot, info.slot)
    with pytest.raises(AttributeError, match="no attribute 'slots'"):
      _ = info.slots
  # A lazy info built after later samples still views its own batch.
  fresh = frt.packed_batches(twin_a.sample_packed(6 * parts), parts, on_copy="raise")[0].info
  for _ in range(3):
    twin_a.insert(_rows(64, 32))
    twin_a.sample_packed(6 * parts)
  np.testing.assert_array_equal(fresh.slot.numpy(),
                                np.asarray(twin_b.sample(6 * parts).info.slot)[:6])
  twin_a.close()
  twin_b.close()


def test_a_packed_batch_saves_and_copies_as_tensors_of_its_own(tmp_path):
  import copy  # noqa: PLC0415
  table = _table(32, sampler=PRIO)
  table.insert(_rows(0, 32), priority=np.linspace(0.5, 2, 32))
  b = next(iter(frt.TorchSampler(table, 6, prefetch=0, beta=0.4, on_copy="raise")))
  buffer = b.data["obs"].untyped_storage().data_ptr()  # every field views this buffer
  fields = lambda x: jax.tree_util.tree_leaves((x.data, x.valid, x.info))  # noqa: E731
  ref = [t.clone() for t in fields(b)]

  def check(other, shared):
    assert type(other) is frt.TorchBatch and torch.equal(other.weights, b.weights)
    for t, r in zip(fields(other), ref, strict=True):
      assert t.dtype == r.dtype and torch.equal(t, r)
      assert (t.untyped_storage().data_ptr() == buffer) == shared
    assert other.num_eligible == b.num_eligible

  check(b.clone(), shared=False)
  check(copy.deepcopy(b), shared=False)
  check(copy.copy(b), shared=True)
  torch.save(b, tmp_path / "batch.pt")
  check(torch.load(tmp_path / "batch.pt", weights_only=False), shared=False)
  torch.save(b.clone().data, tmp_path / "data.pt")  # the fields alone, as plain tensors
  data = torch.load(tmp_path / "data.pt")
  for k, v in b.data.items():
    assert torch.equal(data[k], v)
  info = copy.copy(b.info)
  assert type(info) is frt.TorchInfo and info.slot.data_ptr() == b.info.slot.data_ptr()
  table.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("per_call", [1, 2])
def test_torch_sampler_hands_out_the_packed_sample_of_each_call(per_call, monkeypatch):
  twin_a, twin_b = _table(32, sampler=PRIO), _table(32, sampler=PRIO)
  for t in (twin_a, twin_b):
    t.insert(_rows(0, 32), priority=np.linspace(0.5, 2, 32))
  calls = []
  original = twin_a.sample_packed
  monkeypatch.setattr(twin_a, "sample_packed", lambda *a, **k: calls.append(a) or original(*a, **k))
  with frt.TorchSampler(twin_a, 4, prefetch=0, batches_per_call=per_call, num_batches=4,
                        on_copy="raise") as sampler:
    batches = list(sampler)
  assert len(calls) == 4 // per_call
  for i in range(0, 4, per_call):
    whole = twin_b.sample(4 * per_call)
    for j in range(per_call):
      _assert_batch_equals_sample(batches[i + j], jax.tree_util.tree_map(
          lambda x, j=j: x[4 * j:4 * j + 4] if x.ndim else x, whole))
  twin_a.close()
  twin_b.close()


@pytest.mark.timeout(60)
def test_torch_sampler_falls_back_to_per_array_export_without_sample_packed():
  class Plain:  # a table-like object with only the sample / update_priorities API
    def __init__(self, table):
      self.sample, self.update_priorities = table.sample, table.update_priorities

  table = _table(16)
  table.insert(_rows(0, 16))
  with frt.TorchSampler(Plain(table), 4, prefetch=0, num_batches=2, on_copy="raise") as s:
    batches = list(s)
  assert len(batches) == 2 and all(b.valid.all() for b in batches)
  for b in batches:
    np.testing.assert_array_equal(b.data["obs"][:, 0].numpy(),
                                  b.data["a"].numpy().astype(np.float32))
  table.close()


def test_priority_write_back_from_torch_and_stale_keys_ignored():
  table = _table(16, sampler=PRIO)
  table.insert(_rows(0, 16))
  b = frt.sample_to_torch(table.sample(4))
  td = torch.tensor([0.5, 1.5, 2.5, 3.5], requires_grad=True) * 1.0
  frt.update_priorities(table, b.info, td.abs())  # straight from a graph
  prio = np.asarray(table.snapshot().priority)
  slots = b.info.slot.numpy()
  np.testing.assert_allclose(prio[slots], [0.5, 1.5, 2.5, 3.5])
  # Overwrite slots: the old keys are stale and must be ignored.
  b2 = frt.sample_to_torch(table.sample(4))
  table.insert(_rows(50, 16), priority=7.0)
  frt.update_priorities(table, b2, priorities=torch.full((4,), 0.25))
  frt.update_priorities(table, b2.info.slot, b2.info.key, torch.full((4,), 0.25))
  np.testing.assert_allclose(np.asarray(table.snapshot().priority), 7.0)
  # Explicit columns with a fresh key do apply.
  b3 = frt.sample_to_torch(table.sample(4))
  frt.update_priorities(table, b3.info.slot, b3.info.key.to(torch.int64),
                        torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.bfloat16))
  np.testing.assert_allclose(np.asarray(table.snapshot().priority)[b3.info.slot.numpy()],
                             [0.1, 0.2, 0.3, 0.4], rtol=1e-2)
  with pytest.raises(ValueError, match="finite"):
    frt.update_priorities(table, b3.info, torch.tensor([float("nan"), 1.0, 1.0, 1.0]))
  with pytest.raises(TypeError, match="priorities"):
    frt.update_priorities(table, b3.info)
  with pytest.raises(TypeError, match="keys"):
    frt.update_priorities(table, b3.info.slot, priorities=torch.ones(2))
  table.close()


def test_importance_weights_match_the_jax_reference():
  table = _table(16, sampler=PRIO)
  table.insert(_rows(0, 16), priority=np.linspace(0.1, 3.0, 16))
  smp = table.sample(4)
  b = frt.sample_to_torch(smp, beta=0.6)
  ref = np.asarray(fr.importance_weights(smp, 0.6))
  np.testing.assert_allclose(b.weights.numpy(), ref, rtol=1e-5)
  assert len(set(ref.round(6).tolist())) > 1  # the priorities differ, so do the weights
  assert b.num_eligible == 16 and len(b) == 4
  table.close()


def test_invalid_rows_get_zero_weight():
  table = _table(16)
  table.insert(_rows(0, 3))
  b = frt.sample_to_torch(table.sample(4, min_valid=1), beta=0.5)
  assert b.valid.tolist().count(True) == 3
  assert torch.all(b.weights[~b.valid] == 0) and torch.all(b.info.slot[~b.valid] == -1)
  table.close()


# --- TorchSampler ------------------------------------------------------------------------

def _threads():
  return {t for t in threading.enumerate() if t.name == "funcreplay-torch-prefetch"}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_torch_sampler_yields_batches_and_stops(prefetch):
  table = _table(16, sampler=PRIO)
  table.insert(_rows(0, 16))
  seen = []
  with frt.TorchSampler(table, 4, prefetch=prefetch, num_batches=5, beta=lambda i: 0.4 + i / 10,
                        version_fn=lambda: 3) as sampler:
    for b in sampler:
      assert isinstance(b, frt.TorchBatch) and b.valid.all()
      a = b.data["a"].numpy()
      np.testing.assert_array_equal(b.data["obs"][:, 1].numpy(), a + 0.5)
      assert len(set(a.tolist())) == 4  # without replacement
      frt.update_priorities(table, b.info, torch.rand(4) + 0.1)
      seen.append(b)
  assert len(seen) == 5
  assert not _threads()
  assert table.stats().to_dict()["samples"] == 5 * 4  # the limit stops prefetching too
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_batches_per_call_splits_one_sample():
  table = _table(16, sampler=PRIO)
  table.insert(_rows(0, 16), priority=np.linspace(0.5, 2.0, 16))
  with frt.TorchSampler(table, 4, prefetch=1, batches_per_call=2, num_batches=4,
                        beta=0.5) as sampler:
    batches = list(sampler)
  assert len(batches) == 4
  assert table.stats().to_dict()["samples"] == 16  # two calls of 8 rows
  for first, second in (batches[:2], batches[2:]):
    slots = torch.cat([first.info.slot, second.info.slot]).tolist()
    assert len(set(slots)) == 8  # one call: jointly without replacement
  for b in batches:
    assert len(b) == 4 and float(b.weights.max()) == pytest.approx(1.0)
    p = b.info.probability.double()
    ref = (p * b.num_eligible) ** -0.5
    np.testing.assert_allclose(b.weights.numpy(), (ref / ref.max()).numpy(), rtol=1e-5)
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_with_a_concurrent_inserter_never_sees_torn_or_aliased_rows():
  table = _table(16)
  table.insert(_rows(0, 16))
  stop = threading.Event()
  errors = []

  def produce():
    k = 1
    try:
      while not stop.is_set():
        table.insert(_rows(16 * k, 16))  # overwrites every slot (state donated each time)
        k += 1
    except fr.TableClosedError:
      pass
    except BaseException as e:  # noqa: BLE001
      errors.append(e)

  th = threading.Thread(target=produce)
  th.start()
  kept = []
  try:
    with frt.TorchSampler(table, 4, prefetch=2, num_batches=40) as sampler:
      for b in sampler:
        a = b.data["a"]
        assert torch.equal(b.data["obs"][:, 0], a.float()), "torn row"
        assert torch.equal(b.data["done"], a % 3 == 0)
        kept.append((b, {k: v.clone() for k, v in b.data.items()}))
  finally:
    stop.set()
    th.join()
  assert not errors
  for b, snap in kept:  # later inserts never wrote into an exported batch
    for k, v in snap.items():
      assert torch.equal(b.data[k], v)
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_with_dataloader():
  table = _table(16)
  table.insert(_rows(0, 16))
  sampler = frt.TorchSampler(table, 4, num_batches=3)
  loader = torch.utils.data.DataLoader(sampler, batch_size=None, num_workers=0)
  batches = list(loader)
  assert len(batches) == 3 and all(isinstance(b, frt.TorchBatch) for b in batches)
  assert all(tuple(b.data["obs"].shape) == (4, 3) for b in batches)
  sampler.close()
  assert not _threads()
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_reraises_errors_and_closes_cleanly():
  table = _table(16)
  sampler = frt.TorchSampler(table, 4, prefetch=1, timeout=0.3)
  t0 = time.monotonic()
  with pytest.raises(TimeoutError):
    next(iter(sampler))  # empty table
  assert time.monotonic() - t0 < 10
  # A closed table surfaces in the consumer, raised from the prefetch thread.
  table.insert(_rows(0, 16))
  it = iter(frt.TorchSampler(table, 4, prefetch=2))
  next(it)
  table.close()
  with pytest.raises(fr.TableClosedError):
    for _ in range(10):
      next(it)
  deadline = time.monotonic() + 5
  while _threads() and time.monotonic() < deadline:
    time.sleep(0.01)
  assert not _threads()


@pytest.mark.timeout(60)
def test_torch_sampler_close_stops_a_blocked_prefetch_thread():
  table = _table(16)
  sampler = frt.TorchSampler(table, 4, prefetch=1)  # waits forever on the empty table
  it = iter(sampler)
  time.sleep(0.2)
  assert _threads()
  sampler.close()
  assert not _threads()
  with pytest.raises(StopIteration):
    next(it)
  table.close()


@pytest.mark.timeout(60)
def test_torch_sampler_staleness_by_version_fn():
  table = _table(16, max_staleness=2)
  table.insert(_rows(0, 8), version=5)
  version = {"v": 7}
  sampler = frt.TorchSampler(table, 4, prefetch=0, timeout=0.2, version_fn=lambda: version["v"])
  b = next(sampler)
  assert torch.all(b.info.version == 5)
  version["v"] = 8   # 8 - 5 > 2: every item is stale now
  with pytest.raises(TimeoutError, match="eligible"):
    next(frt.TorchSampler(table, 4, prefetch=0, timeout=0.2, version_fn=lambda: version["v"]))
  sampler.close()
  table.close()


def test_torch_sampler_bad_arguments():
  table = _table(16)
  with pytest.raises(ValueError, match="batch_size"):
    frt.TorchSampler(table, 0)
  with pytest.raises(ValueError, match="prefetch"):
    frt.TorchSampler(table, 2, prefetch=-1)
  with pytest.raises(ValueError, match="beta"):
    frt.TorchSampler(table, 2, beta=-1.0)
  with pytest.raises(ValueError, match="batches_per_call"):
    frt.TorchSampler(table, 2, batches_per_call=0)
  with pytest.raises(TypeError, match="Table"):
    frt.TorchSampler(object(), 2)
  table.close()


# --- CUDA (torch and JAX on one GPU) ---------------------------------------------------

def _jax_gpu():
  try:
    return jax.devices("gpu")[0]
  except RuntimeError:
    return None


cuda = pytest.mark.skipif(not torch.cuda.is_available() or _jax_gpu() is None,
                          reason="needs a CUDA GPU visible to both torch and JAX")


@cuda
def test_cuda_round_trip_zero_copy():
  dev = _jax_gpu()
  x = jax.device_put(jnp.arange(1024, dtype=jnp.float32), dev)
  t = frt.to_torch(x, on_copy="raise")
  assert t.is_cuda and t.data_ptr() == x.unsafe_buffer_pointer()
  y = frt.from_torch(t * 2, on_copy="raise")
  assert y.devices() == {dev}
  np.testing.assert_array_equal(np.asarray(y), np.arange(1024, dtype=np.float32) * 2)
  b = frt.from_torch(torch.ones(4, dtype=torch.bool, device="cuda"), on_copy="raise")
  assert b.dtype == jnp.bool_ and bool(b.all())


@cuda
@pytest.mark.timeout(120)
def test_cuda_sampler_with_concurrent_inserts():
  with jax.default_device(_jax_gpu()):
    table = _table(256)
    table.insert(_rows(0, 256))
    stop = threading.Event()

    def produce():
      k = 0
      while not stop.is_set():
        table.insert(_rows(1000 + 16 * k, 16))
        k += 1

    th = threading.Thread(target=produce)
    th.start()
    try:
      with frt.TorchSampler(table, 32, device=None, prefetch=2, num_batches=50) as s:
        for b in s:
          assert b.data["obs"].is_cuda
          a = b.data["a"].float()
          assert torch.equal(b.data["obs"][:, 1], a + 0.5)
    finally:
      stop.set()
      th.join()
    table.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(120)
def test_cuda_sampler_from_host_table_through_pinned_memory():
  table = _table(64)
  table.insert(_rows(0, 64))
  with frt.TorchSampler(table, 16, device="cuda", prefetch=2, num_batches=5) as s:
    for b in s:
      assert b.data["obs"].is_cuda and b.info.slot.is_cuda
      assert torch.equal(b.data["obs"][:, 1], b.data["a"].float() + 0.5)
  table.close()


# --- the experiment -----------------------------------------------------------------------

@pytest.mark.timeout(240)
def test_dqn_torch_smoke(tmp_path):
  for mod in ("gymnasium", "matplotlib", "ml_collections"):  # the experiments extra
    pytest.importorskip(mod)
  env = dict(os.environ, PYTHONPATH=ROOT)
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "dqn_torch.py"),
         f"--config={os.path.join(ROOT, 'configs', 'dqn_torch.py')}", f"--workdir={tmp_path}",
         "--config.seed=3", "--config.total_env_steps=600", "--config.log_every=50",
         "--config.replay.learning_starts=100"]
  with warnings.catch_warnings():
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=220)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "final mean return" in proc.stdout
  with open(tmp_path / "replay_stats.json") as f:
    stats = json.load(f)
  assert stats["summary"]["env_steps"] >= 600 and stats["summary"]["updates"] > 0
  assert stats["table"]["inserts"] > 100 and stats["table"]["samples"] > 0
  assert stats["config"]["seed"] == 3
  assert (tmp_path / "learning_curve.png").stat().st_size > 1000
  assert (tmp_path / "metrics.jsonl").exists()
