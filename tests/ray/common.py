"""What the tests of funcreplay.ray share: the item, specs, a fresh replay actor, and the
producer / learner actor classes (shipped to Ray's workers by value, see conftest.py)."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="funcreplay.ray needs Ray (pip install 'funcreplay[ray]')")

import funcreplay as fr  # noqa: E402
import funcreplay.ray as frr  # noqa: E402

ITEM = {"obs": np.zeros((4,), np.float32), "step": np.zeros((), np.int32)}
WAIT_S = 60.0  # bound on every wait for another process in these tests
# The tests move kilobytes; a small object store keeps /dev/shm free on CI machines.
OBJECT_STORE_BYTES = 128 * 1024**2


def item(i: int, pid: int = 0):
  return {"obs": np.full((4,), pid * 10_000 + i, np.float32), "step": np.int32(i)}


def batch(n: int, start: int = 0):
  return {"obs": np.arange(start, start + n, dtype=np.float32)[:, None].repeat(4, 1),
          "step": np.arange(start, start + n, dtype=np.int32)}


def spec(capacity=256, **kw):
  kw.setdefault("metadata", ("producer",))
  return fr.TableSpec(capacity, ITEM, **kw)


NAMES = itertools.count()  # actor names, unique within the test run


def fresh(s=None, **kw):
  """A new replay actor with a unique name."""
  return frr.connect(f"t{next(NAMES)}", s or spec(), **kw)


@ray.remote(num_cpus=0)
class Producer:
  """A producer process: puts single items through a RemoteWriter."""

  def __init__(self, table):
    self.table = table
    self.writer = None

  def produce(self, pid: int, n: int, batch_size: int = 32, start: int = 0):
    """Put items ``start .. start + n - 1`` of producer ``pid`` (step = the item's number)."""
    with self.table.writer(batch_size=batch_size, max_wait_s=0.005, max_in_flight=2) as w:
      for i in range(start, start + n):
        w.put(item(i, pid), metadata={"producer": pid})
    return dataclasses.asdict(w.stats())

  def put_then_hang(self, flushed: int, unsent: int):
    """Ship ``flushed`` items, then keep ``unsent`` in the local batch (not shipped)."""
    self.writer = self.table.writer(batch_size=10_000, max_wait_s=3600.0)
    for i in range(flushed):
      self.writer.put(item(i))
    self.writer.flush(timeout=WAIT_S)
    for i in range(unsent):
      self.writer.put(item(flushed + i))
    return dataclasses.asdict(self.writer.stats())


@ray.remote(num_cpus=0)
class Learner:
  """A learner process: samples and writes priorities back."""

  def __init__(self, table):
    self.table = table
    self.sampled = 0

  def learn(self, batches: int, batch_size: int):
    for _ in range(batches):
      s = self.table.sample(batch_size, timeout=WAIT_S)
      self.table.update_priorities(s.info.slot, s.info.key,
                                   np.abs(s.data["obs"][:, 0]) % 7 + 0.5)
      self.sampled += int(s.valid.sum())
    return self.sampled

  def count_sampled(self):
    return self.sampled


def removed(st):
  return st["deletes"] + st["evicted_capacity"] + st["evicted_stale"] + st["evicted_reuse"]

