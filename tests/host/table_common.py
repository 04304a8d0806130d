"""What the host ``Table`` tests share: the "everything" spec, items, tree equality and a
thread runner."""

from __future__ import annotations

import threading

import jax
import numpy as np

import funcreplay as fr
from tests.helpers import ITEM

T = 0.05  # timeout of calls that must block

# Prioritized sampler + metadata + staleness + reuse limit: the "everything" spec. Most
# tests use it with insert batches of <= 4 (bucket 4) and sample(4) to share compilations.
SPEC = fr.TableSpec(16, ITEM, sampler=fr.Prioritized(0.6), metadata=("task",), max_staleness=2,
                    max_times_sampled=3)


def np_items(ids):
  ids = np.asarray(ids, np.int32)
  return {"x": ids, "y": np.stack([ids, -ids], -1).astype(np.float32)}


def host_copy(tree):
  return jax.tree_util.tree_map(np.array, tree)


def assert_same_tree(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb, strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def run_thread(fn):
  """Start ``fn`` in a thread; returns (thread, box) where box gets 'result' or 'error'."""
  box = {}

  def target():
    try:
      box["result"] = fn()
    except BaseException as e:  # noqa: BLE001 (reported to the test)
      box["error"] = e

  th = threading.Thread(target=target, daemon=True)
  th.start()
  return th, box
