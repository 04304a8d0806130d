"""What the checkpoint tests share: a tiny item, one spec per (sampler, remover) pairing,
item batches, and state / sample equality down to the bytes."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

import funcreplay as fr

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ITEM = {"obs": jnp.zeros((2,), jnp.float32), "act": jnp.zeros((), jnp.int32)}
CAP = 6

# One (sampler, remover) per sampler, cycling so every remover appears too.
PAIRS = [
    (fr.Uniform(), fr.Fifo()), (fr.Prioritized(0.7), fr.Lifo()), (fr.Fifo(), fr.MinHeap()),
    (fr.Lifo(), fr.MaxHeap()), (fr.MinHeap(), fr.Uniform()), (fr.MaxHeap(), fr.Fifo()),
]




@functools.lru_cache(maxsize=None)
def pairing_spec(i: int) -> fr.TableSpec:
  sampler, remover = PAIRS[i]
  return fr.TableSpec(CAP, ITEM, sampler=sampler, remover=remover, max_times_sampled=3,
                      max_staleness=4, metadata=("task",), rate_limiter=fr.MinSize(1))


def items(n, start):
  return {"obs": np.arange(start, start + 2 * n, dtype=np.float32).reshape(n, 2),
          "act": np.arange(start, start + n, dtype=np.int32)}


def leaves(state):
  """Leaves of a host copy of ``state``, item data of free slots zeroed: checkpoints do not
  store those bytes (checkpoint.rows) and nothing reads them."""
  s = jax.device_get(state)
  if not isinstance(s, fr.TableState):  # e.g. a counters dict
    return jax.tree_util.tree_leaves_with_path(s)
  occ = np.asarray(s.occupied, bool)
  s = s.replace(data=jax.tree_util.tree_map(
      lambda x: np.where(occ.reshape(occ.shape + (1,) * (np.ndim(x) - occ.ndim)), x,
                         np.zeros((), np.asarray(x).dtype)), s.data))
  return jax.tree_util.tree_leaves_with_path(s)


def assert_states_equal(a, b):
  """Every leaf: same path, shape, dtype and bytes (item data: of occupied slots)."""
  la, lb = leaves(a), leaves(b)
  assert [jax.tree_util.keystr(p) for p, _ in la] == [jax.tree_util.keystr(p) for p, _ in lb]
  for (path, x), (_, y) in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert x.tobytes() == y.tobytes(), f"leaf {jax.tree_util.keystr(path)} differs"


def assert_samples_equal(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def child_env():
  """This environment with the repository on PYTHONPATH (for worker processes)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env
