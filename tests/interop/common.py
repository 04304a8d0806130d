"""What the torch bridge's tests share (tests/interop/test_torch*.py): dtype pairs,
numpy views for comparisons, small host tables."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import funcreplay as fr  # noqa: E402

TORCH_OF = {jnp.float32: torch.float32, jnp.float16: torch.float16,
            jnp.bfloat16: torch.bfloat16, jnp.int8: torch.int8, jnp.uint8: torch.uint8,
            jnp.int16: torch.int16, jnp.uint16: torch.uint16, jnp.int32: torch.int32,
            jnp.uint32: torch.uint32, jnp.bool_: torch.bool, jnp.complex64: torch.complex64}


def tensor_numpy(t):
  """numpy copy of a tensor (bf16 via float32) for comparisons."""
  t = t.detach().cpu()
  return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def array_numpy(x):
  """numpy view of an array (bf16 as float32) for comparisons."""
  x = np.asarray(x)
  return x.astype(np.float32) if x.dtype == jnp.bfloat16 else x

PRIO = fr.Prioritized(0.6)


def small_table(capacity=16, sampler=None, **kw):
  """A host ``Table`` of items ``{obs f32[3], done bool, a i32}``, seeded."""
  item = {"obs": np.zeros((3,), np.float32), "done": np.zeros((), np.bool_),
          "a": np.zeros((), np.int32)}
  return fr.Table(fr.TableSpec(capacity, item, sampler=sampler, **kw), seed=0)


def rows(start, n):
  """``n`` items numbered from ``start`` (every field derived from the number)."""
  i = np.arange(start, start + n)
  return {"obs": np.stack([i, i + 0.5, -i], 1).astype(np.float32), "done": i % 3 == 0,
          "a": i.astype(np.int32)}
