"""The torch bridge at the table boundary: sampled batches as torch tensors (fresh, packed
into one export, cut into row ranges, saved), priority write-back and importance weights.
"""

import dataclasses
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import funcreplay as fr  # noqa: E402
import funcreplay.torch as frt  # noqa: E402
from tests.interop.common import PRIO, TORCH_OF, array_numpy, rows, small_table, tensor_numpy  # noqa: E402


@pytest.mark.parametrize("batch", [4, 16])  # 16 == capacity: same shapes as the state
def test_sampled_batch_is_fresh_and_survives_further_inserts(batch):
  table = small_table(16)
  table.insert(rows(0, 16))
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
    table.insert(rows(100 + 16 * k, 16))
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
    np.testing.assert_array_equal(tensor_numpy(t), array_numpy(x))
  assert batch.num_eligible == int(smp.num_eligible)


def test_packed_to_torch_is_one_zero_copy_export_of_the_whole_batch():
  twin_a, twin_b = small_table(16, sampler=PRIO), small_table(16, sampler=PRIO)
  for t in (twin_a, twin_b):
    t.insert(rows(0, 16), priority=np.linspace(0.5, 2, 16))
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
    twin_a.insert(rows(50 + 16 * k, 16))
    twin_a.sample_packed(8)
  for t, b in zip(tensors, before, strict=True):
    assert torch.equal(t, b)
  twin_a.close()
  twin_b.close()


@pytest.mark.parametrize("parts", [1, 2])
def test_packed_views_of_an_out_sliced_from_a_larger_buffer(parts):
  """``sample_packed(out=big[n:])``: the views start where the slice does, not at the
  storage's first byte (they read the other half of ``big`` before the fix)."""
  from funcreplay.core import packing
  twin_a, twin_b = small_table(16, sampler=PRIO), small_table(16, sampler=PRIO)
  for t in (twin_a, twin_b):
    t.insert(rows(0, 16), priority=np.linspace(0.5, 2, 16))
  n = packing.layout(twin_a.spec.signature, 8).nbytes
  big = torch.zeros(2 * n + 4, dtype=torch.uint8)
  out = big[n:2 * n]
  packed = twin_a.sample_packed(8, out=out)
  want = twin_b.sample(8)
  if parts == 1:
    _assert_batch_equals_sample(frt.packed_to_torch(packed, on_copy="raise"), want)
  else:
    halves = frt.packed_batches(packed, 2, on_copy="raise")
    for i, half in enumerate(halves):
      np.testing.assert_array_equal(half.info.slot.numpy(),
                                    np.asarray(want.info.slot)[4 * i:4 * i + 4])
      np.testing.assert_array_equal(half.data["a"].numpy(),
                                    np.asarray(want.data["a"])[4 * i:4 * i + 4])
  # A start that no wider type can view from: a clear error, not a wrong view.
  odd = twin_a.sample_packed(8, out=big[2:n + 2])
  with pytest.raises(ValueError, match="starts 2 bytes into"):
    frt.packed_to_torch(odd, on_copy="raise")
  twin_a.close()
  twin_b.close()


def test_packed_batches_cut_one_call_into_row_ranges():
  twin_a, twin_b = small_table(32), small_table(32)
  for t in (twin_a, twin_b):
    t.insert(rows(0, 32))
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
  twin_a, twin_b = small_table(32, sampler=PRIO), small_table(32, sampler=PRIO)
  for t in (twin_a, twin_b):
    t.insert(rows(0, 32), priority=np.linspace(0.5, 2, 32))
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
      np.testing.assert_array_equal(tensor_numpy(t), np.asarray(x))
    for other in (copy.copy(info), copy.deepcopy(info),
                  dataclasses.replace(info, priority=info.priority * 2)):
      assert type(other) is frt.TorchInfo and "_make" not in vars(other)
      assert torch.equal(other.slot, info.slot)
    with pytest.raises(AttributeError, match="no attribute 'slots'"):
      _ = info.slots
  # A lazy info built after later samples still views its own batch.
  fresh = frt.packed_batches(twin_a.sample_packed(6 * parts), parts, on_copy="raise")[0].info
  for _ in range(3):
    twin_a.insert(rows(64, 32))
    twin_a.sample_packed(6 * parts)
  np.testing.assert_array_equal(fresh.slot.numpy(),
                                np.asarray(twin_b.sample(6 * parts).info.slot)[:6])
  twin_a.close()
  twin_b.close()


def test_a_packed_batch_saves_and_copies_as_tensors_of_its_own(tmp_path):
  import copy  # noqa: PLC0415
  table = small_table(32, sampler=PRIO)
  table.insert(rows(0, 32), priority=np.linspace(0.5, 2, 32))
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
  twin_a, twin_b = small_table(32, sampler=PRIO), small_table(32, sampler=PRIO)
  for t in (twin_a, twin_b):
    t.insert(rows(0, 32), priority=np.linspace(0.5, 2, 32))
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

  table = small_table(16)
  table.insert(rows(0, 16))
  with frt.TorchSampler(Plain(table), 4, prefetch=0, num_batches=2, on_copy="raise") as s:
    batches = list(s)
  assert len(batches) == 2 and all(b.valid.all() for b in batches)
  for b in batches:
    np.testing.assert_array_equal(b.data["obs"][:, 0].numpy(),
                                  b.data["a"].numpy().astype(np.float32))
  table.close()


def test_priority_write_back_from_torch_and_stale_keys_ignored():
  table = small_table(16, sampler=PRIO)
  table.insert(rows(0, 16))
  b = frt.sample_to_torch(table.sample(4))
  td = torch.tensor([0.5, 1.5, 2.5, 3.5], requires_grad=True) * 1.0
  frt.update_priorities(table, b.info, td.abs())  # straight from a graph
  prio = np.asarray(table.snapshot().priority)
  slots = b.info.slot.numpy()
  np.testing.assert_allclose(prio[slots], [0.5, 1.5, 2.5, 3.5])
  # Overwrite slots: the old keys are stale and must be ignored.
  b2 = frt.sample_to_torch(table.sample(4))
  table.insert(rows(50, 16), priority=7.0)
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
  table = small_table(16, sampler=PRIO)
  table.insert(rows(0, 16), priority=np.linspace(0.1, 3.0, 16))
  smp = table.sample(4)
  b = frt.sample_to_torch(smp, beta=0.6)
  ref = np.asarray(fr.importance_weights(smp, 0.6))
  np.testing.assert_allclose(b.weights.numpy(), ref, rtol=1e-5)
  assert len(set(ref.round(6).tolist())) > 1  # the priorities differ, so do the weights
  assert b.num_eligible == 16 and len(b) == 4
  table.close()


def test_invalid_rows_get_zero_weight():
  table = small_table(16)
  table.insert(rows(0, 3))
  b = frt.sample_to_torch(table.sample(4, min_valid=1), beta=0.5)
  assert b.valid.tolist().count(True) == 3
  assert torch.all(b.weights[~b.valid] == 0) and torch.all(b.info.slot[~b.valid] == -1)
  table.close()

