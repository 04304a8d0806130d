"""Tests of the PyTorch bridge (funcreplay/torch.py): DLPack both ways, the CUDA tests
(experiments/gpu_check.sh runs them with ``-k cuda``) and the dqn_torch experiment's smoke
run. Sampled batches at the table boundary: test_torch_batches.py; ``TorchSampler``:
test_torch_sampler.py.

Zero copy is proven by pointer equality (``unsafe_buffer_pointer()`` vs
``data_ptr()``); the cases where a copy is unavoidable are named tests that
check the copy is reported (and the values right). CUDA variants run only
when torch and JAX both see a GPU.
"""

import gc
import json
import os
import subprocess
import sys
import threading
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
from tests.interop.common import TORCH_OF, array_numpy, rows, small_table, tensor_numpy  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JAX_DTYPES = [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int8, jnp.uint8, jnp.int16,
              jnp.uint16, jnp.int32, jnp.uint32, jnp.bool_, jnp.complex64]


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




# --- JAX -> torch -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", JAX_DTYPES, ids=lambda d: np.dtype(d).name)
def test_to_torch_zero_copy_every_dtype(dtype):
  x = jnp.asarray(_values(dtype, (5, 3)))
  t, rep = frt.to_torch_with_report(x)
  assert t.dtype == TORCH_OF[dtype] and tuple(t.shape) == (5, 3)
  assert t.data_ptr() == x.unsafe_buffer_pointer()
  assert rep.all_zero_copy and rep.zero_copy == 1
  np.testing.assert_array_equal(tensor_numpy(t), array_numpy(x))


@pytest.mark.parametrize("dtype", JAX_DTYPES, ids=lambda d: np.dtype(d).name)
def test_round_trip_every_dtype_is_zero_copy_both_ways(dtype):
  x = jnp.asarray(_values(dtype, (4, 1, 2), seed=1))
  t = frt.to_torch(x, on_copy="raise")
  y, rep = frt.from_torch_with_report(t)
  assert rep.all_zero_copy, rep.describe()
  assert y.dtype == x.dtype and y.shape == x.shape
  assert y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
  np.testing.assert_array_equal(array_numpy(y), array_numpy(x))


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
  np.testing.assert_array_equal(array_numpy(y), array_numpy(x))
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
  # uint64 (torch has no min / max kernel for it: from_torch crashed in torch) and
  # float64 beyond float32's range (it became inf without a word; found by a review).
  u = frt.from_torch(torch.tensor([1, 2, 2**32 - 1], dtype=torch.uint64), on_copy="ignore")
  assert u.dtype == jnp.uint32 and np.asarray(u).tolist() == [1, 2, 2**32 - 1]
  for big, held in ((2**32, r"\[1, 4294967296\]"), (2**63, "2\\*\\*63 or more")):
    with pytest.raises(ValueError, match=held):
      frt.from_torch(torch.tensor([1, big], dtype=torch.uint64), on_copy="ignore")
  f = frt.from_torch(torch.tensor([1e30, -np.inf, np.nan], dtype=torch.float64),
                     on_copy="ignore")
  assert np.asarray(f)[0] == np.float32(1e30) and np.isneginf(np.asarray(f)[1])
  for dtype in (torch.float64, torch.complex128):
    with pytest.raises(ValueError, match="beyond float32's range.*1e\\+300"):
      frt.from_torch(torch.tensor([1.0, -1e300], dtype=dtype), on_copy="ignore")


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
    table = small_table(256)
    table.insert(rows(0, 256))
    stop = threading.Event()

    def produce():
      k = 0
      while not stop.is_set():
        table.insert(rows(1000 + 16 * k, 16))
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
  table = small_table(64)
  table.insert(rows(0, 64))
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
