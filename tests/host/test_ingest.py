"""``Ingestor``: order, flush/close, back-pressure, error propagation, padding, bad input.

Items carry their id in ``x`` (and ``[id, -id]`` in ``y``), so the table's
contents can be checked row by row: nothing lost, nothing duplicated, no
padding row, in the order the producers put them (keys are given in
insertion order). Specs are module constants: the jitted table operations
compile once per spec and insert bucket for the whole file.
"""

from __future__ import annotations

import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import Table, TableClosedError
from funcreplay.host.ingest import (
  Ingestor,
  IngestorClosedError,
  IngestorError,
  IngestorFullError,
)
from funcreplay.host.itemcheck import ItemChecker, stack_leaf
from tests.helpers import ITEM

PLAIN = fr.TableSpec(256, ITEM)
RICH = fr.TableSpec(64, ITEM, sampler=fr.Prioritized(0.6), metadata=("task",))
QUEUE = fr.queue(4, ITEM)


def item(i):
  return {"x": np.int32(i), "y": np.array([i, -i], np.float32)}


def contents(table):
  """The table's items in insertion (key) order: dict of numpy columns."""
  s = table.snapshot()
  occ = np.asarray(s.occupied)
  order = np.argsort(np.asarray(s.key)[occ], kind="stable")
  col = lambda a: np.asarray(a)[occ][order]  # noqa: E731
  items = fr.stored_items(table.spec, s)
  out = dict(x=col(items["x"]), y=col(items["y"]), version=col(s.version),
             priority=col(s.priority))
  out.update({k: col(v) for k, v in s.metadata.items()})
  return out


def assert_ids(table, ids):
  c = contents(table)
  np.testing.assert_array_equal(c["x"], np.asarray(ids, np.int32))
  np.testing.assert_array_equal(c["y"], np.stack([ids, np.negative(ids)], -1).astype(np.float32))
  d = table.stats().to_dict()
  assert d["inserts"] == d["size"] == len(ids)


@pytest.mark.timeout(60)
def test_put_flush_in_order_and_no_padding_rows():
  t = Table(PLAIN)
  with t.ingestor(batch_size=8, max_wait_s=0.0) as ing:
    for i in range(1, 38):  # 4 full batches + a partial one of 5 (padded to 8 by the table)
      ing.put(item(i))
    ing.flush()
    assert_ids(t, list(range(1, 38)))
    ing.put(item(100))   # a single item: bucket 1
    ing.put_batch({"x": np.arange(101, 104, dtype=np.int32),
                   "y": np.stack([np.arange(101, 104), -np.arange(101, 104)], -1)
                   .astype(np.float32)})
    ing.flush()
    s = ing.stats()
  assert_ids(t, list(range(1, 38)) + [100, 101, 102, 103])
  assert (s.accepted, s.inserted, s.pending, s.failed) == (41, 41, 0, 0)
  assert 6 <= s.batches <= 41
  assert ing.stats() == s  # closing changed nothing


@pytest.mark.timeout(60)
def test_put_batch_larger_than_the_queue_goes_in_chunks_in_order():
  t = Table(PLAIN)
  ids = np.arange(500, 530, dtype=np.int32)
  with Ingestor(t, batch_size=4, max_queue=8, max_wait_s=0.0) as ing:
    ing.put(item(499))
    ing.put_batch({"x": ids, "y": np.stack([ids, -ids], -1).astype(np.float32)})
    ing.put(item(530))
  assert_ids(t, list(range(499, 531)))
  s = ing.stats()
  assert s.queue_high_water <= 8 and s.inserted == 32


@pytest.mark.timeout(60)
def test_order_per_producer_is_preserved():
  t = Table(PLAIN)
  n_prod, n_items = 4, 50

  def producer(p, ing):
    for i in range(n_items):
      ing.put(item(1000 * (p + 1) + i))

  with t.ingestor(batch_size=16, max_wait_s=0.001) as ing:
    ths = [threading.Thread(target=producer, args=(p, ing)) for p in range(n_prod)]
    for th in ths:
      th.start()
    for th in ths:
      th.join(30)
  x = contents(t)["x"].tolist()
  assert len(x) == n_prod * n_items
  for p in range(n_prod):
    mine = [v for v in x if v // 1000 == p + 1]
    assert mine == [1000 * (p + 1) + i for i in range(n_items)]


@pytest.mark.timeout(60)
def test_back_pressure_bounds_the_queue_and_keeps_fifo_order():
  # A Queue(4) table blocks inserts until items are sampled: the producer must
  # block on the ingestor's bounded queue instead of growing it.
  t = Table(QUEUE)
  ing = Ingestor(t, batch_size=4, max_queue=8, insert_poll_s=0.02)
  n = 60
  done = threading.Event()

  def producer():
    for i in range(n):
      ing.put(item(i))
    done.set()

  th = threading.Thread(target=producer, daemon=True)
  th.start()
  deadline = time.monotonic() + 10
  while (ing.stats().blocked_puts == 0 or t.size < 4) and time.monotonic() < deadline:
    time.sleep(0.01)
  time.sleep(0.1)
  s = ing.stats()
  assert not done.is_set()
  assert s.queue_high_water <= 8 and s.pending <= 8 + 4 and s.blocked_puts >= 1
  assert t.size == 4
  got = [int(t.sample(1, timeout=10).data["x"][0]) for _ in range(n)]
  th.join(10)
  assert got == list(range(n))  # FIFO through the ingestor and the table; nothing lost
  ing.close(timeout=10)
  s = ing.stats()
  assert (s.accepted, s.inserted, s.pending) == (n, n, 0)
  assert s.queue_high_water <= 8


@pytest.mark.timeout(60)
def test_full_queue_raises_or_times_out():
  t = Table(QUEUE)
  for i in range(4):
    t.insert(jax.tree_util.tree_map(lambda a: a[None], item(i)))  # table at its Queue limit
  ing = Ingestor(t, batch_size=4, max_queue=4, on_full="raise", insert_poll_s=0.02)
  for i in range(4, 8):
    ing.put(item(i))
  deadline = time.monotonic() + 5
  while ing.stats().pending < 4 and time.monotonic() < deadline:
    time.sleep(0.01)
  with pytest.raises(IngestorFullError, match="max_queue=4"):
    for i in range(8, 20):  # the insert thread holds at most 4 in flight
      ing.put(item(i))
  blocking = Ingestor(t, batch_size=4, max_queue=4, put_timeout=0.05, insert_poll_s=0.02)
  with pytest.raises(TimeoutError, match="waiting for room"):
    for i in range(100, 120):
      blocking.put(item(i))
  accepted = ing.stats().accepted + blocking.stats().accepted
  with pytest.raises(TimeoutError, match="not yet inserted"):
    ing.close(timeout=0.05)
  ing.close(discard_pending=True)
  blocking.close(discard_pending=True)
  s1, s2 = ing.stats(), blocking.stats()
  assert s1.inserted + s1.discarded + s2.inserted + s2.discarded == accepted
  assert t.size == 4 + s1.inserted + s2.inserted


class FlakyTable(Table):
  """Fails its ``fail_on``-th insert call."""

  def __init__(self, spec, fail_on):
    super().__init__(spec)
    self.calls, self.fail_on = 0, fail_on

  def insert(self, items, **kwargs):
    self.calls += 1
    if self.calls == self.fail_on:
      raise RuntimeError("boom in insert")
    return super().insert(items, **kwargs)


@pytest.mark.timeout(60)
def test_insert_error_reaches_producer_flush_and_close():
  t = FlakyTable(PLAIN, fail_on=2)
  ing = Ingestor(t, batch_size=4, max_wait_s=0.0)
  for i in range(4):
    ing.put(item(i))
  ing.flush()
  for i in range(4, 10):
    ing.put(item(i))
  with pytest.raises(IngestorError, match="boom in insert") as e:
    ing.flush()
  assert isinstance(e.value.__cause__, RuntimeError)
  with pytest.raises(IngestorError, match="boom"):
    ing.put(item(99))
  with pytest.raises(IngestorError, match="boom"):
    ing.put_batch({"x": np.zeros(1, np.int32), "y": np.zeros((1, 2), np.float32)})
  with pytest.raises(IngestorError, match="boom"):
    ing.close()
  ing.close()  # idempotent: reported once
  s = ing.stats()
  assert s.inserted == 4 and s.failed == 6 and s.accepted == 10 and "boom" in s.error
  assert_ids(t, [0, 1, 2, 3])  # the table is intact
  # A with-block whose body fails while the insert thread fails too: the body's
  # exception propagates, the ingestor's error is attached to it as a note.
  t2 = FlakyTable(PLAIN, fail_on=1)
  with pytest.raises(KeyError, match="body") as e2:
    with t2.ingestor(batch_size=4, max_wait_s=0.0) as ing2:
      ing2.put(item(1))
      time.sleep(0.2)  # let the insert thread fail first
      raise KeyError("body")
  assert any("boom" in n for n in getattr(e2.value, "__notes__", []))
  assert ing2.stats().failed == 1


@pytest.mark.timeout(60)
def test_closed_table_fails_the_ingestor_not_silently():
  t = Table(PLAIN)
  ing = t.ingestor(batch_size=4)
  ing.put(item(1))
  ing.flush()
  t.close()
  ing.put(item(2))  # accepted; the insert fails in the thread
  with pytest.raises(IngestorError, match="closed") as e:
    ing.close()
  assert isinstance(e.value.__cause__, TableClosedError)
  s = ing.stats()
  assert (s.inserted, s.failed, s.accepted) == (1, 1, 2)
  with pytest.raises(TableClosedError):
    t.ingestor()


@pytest.mark.timeout(60)
def test_flush_and_close_semantics():
  t = Table(PLAIN)
  ing = Ingestor(t, batch_size=64, max_wait_s=30.0)  # would wait 30 s for a full batch
  for i in range(3):
    ing.put(item(i))
  t0 = time.monotonic()
  ing.flush(timeout=10)  # flush does not wait for max_wait_s
  assert time.monotonic() - t0 < 5
  assert t.size == 3
  ing.put(item(3))
  t0 = time.monotonic()
  ing.close()  # close inserts the partial batch at once, too
  assert time.monotonic() - t0 < 5 and t.size == 4
  ing.close()
  ing.flush()  # nothing pending: returns
  with pytest.raises(IngestorClosedError, match="closed"):
    ing.put(item(4))
  with pytest.raises(IngestorClosedError):
    ing.put_batch({"x": np.zeros(1, np.int32), "y": np.zeros((1, 2), np.float32)})
  assert ing.closed and ing.stats().rejected == 0

  # Leaving a with-block by an exception still inserts what was accepted.
  with pytest.raises(KeyError, match="body"):
    with t.ingestor(max_wait_s=30.0) as ing2:
      ing2.put(item(10))
      raise KeyError("body")
  assert ing2.closed and ing2.stats().inserted == 1
  assert contents(t)["x"].tolist() == [0, 1, 2, 3, 10]


@pytest.mark.timeout(60)
def test_versions_priorities_metadata_reach_the_table():
  t = Table(RICH, version=7)
  with t.ingestor(batch_size=8, max_wait_s=0.0) as ing:
    ing.put(item(0))                                     # default version (7), default priority
    ing.put(item(1), version=3, priority=2.5, metadata={"task": 4})
    ing.put(item(2), priority=0.5)
    ing.put(item(3))
    ing.put_batch({"x": np.array([4, 5], np.int32), "y": np.array([[4, -4], [5, -5]], np.float32)},
                  version=np.array([1, 2]), priority=[1.5, 0.25], metadata={"task": [9, 8]})
    ing.flush()
  c = contents(t)
  assert c["x"].tolist() == [0, 1, 2, 3, 4, 5]
  assert c["version"].tolist() == [7, 3, 7, 7, 1, 2]
  assert c["task"].tolist() == [0, 4, 0, 0, 9, 8]
  np.testing.assert_allclose(c["priority"][[1, 2, 4, 5]], [2.5, 0.5, 1.5, 0.25])
  # Items without a priority get the table default at their insert (max so far: >= 1).
  assert c["priority"][0] == 1.0 and c["priority"][3] >= 1.0


@pytest.mark.timeout(60)
def test_bad_input_raises_clearly_and_leaves_table_intact():
  t = Table(RICH)
  ing = Ingestor(t, batch_size=4, max_wait_s=0.0)
  ing.put(item(1))
  ing.put({"x": 2, "y": np.array([2, -2], np.float32)})  # Python int: converted
  bad = [
      ({"x": np.int32(3), "y": np.zeros(2, np.float64)}, {}, TypeError, r"\['y'\].*float32"),
      ({"x": np.int32(3), "y": np.zeros(3, np.float32)}, {}, ValueError, r"\['y'\].*\[2\]"),
      ({"x": np.zeros(2, np.int32), "y": np.zeros(2, np.float32)}, {}, ValueError, r"\['x'\]"),
      ({"y": np.zeros(2, np.float32)}, {}, ValueError, "structure"),
      ({"x": 3, "y": np.zeros(2, np.float32), "z": 1}, {}, ValueError, "structure"),
      ([3, np.zeros(2, np.float32)], {}, ValueError, "structure"),
      ({"x": 2**40, "y": np.zeros(2, np.float32)}, {}, ValueError, "fit"),
      ({"x": "a", "y": np.zeros(2, np.float32)}, {}, TypeError, r"\['x'\]"),
      (item(3), dict(priority=float("nan")), ValueError, "finite"),
      (item(3), dict(priority=-1.0), ValueError, "finite"),
      (item(3), dict(priority=1e39), ValueError, "finite"),
      (item(3), dict(priority="high"), TypeError, "priority"),
      (item(3), dict(version=1.5), TypeError, "version"),
      (item(3), dict(version=2**31), ValueError, "version"),
      (item(3), dict(metadata={"nope": 1}), ValueError, "nope"),
      (item(3), dict(metadata=[1]), TypeError, "metadata"),
  ]
  for it, kw, exc, pattern in bad:
    with pytest.raises(exc, match=pattern):
      ing.put(it, **kw)
  with pytest.raises(ValueError, match="empty batch"):
    ing.put_batch({"x": np.zeros(0, np.int32), "y": np.zeros((0, 2), np.float32)})
  with pytest.raises(ValueError, match="batch size"):
    ing.put_batch({"x": np.zeros(2, np.int32), "y": np.zeros((3, 2), np.float32)})
  with pytest.raises(ValueError, match="priorit"):
    ing.put_batch({"x": np.zeros(2, np.int32), "y": np.zeros((2, 2), np.float32)},
                  priority=[1.0, np.nan])
  for kwargs in (dict(batch_size=0), dict(max_queue=2, batch_size=4), dict(on_full="drop"),
                 dict(max_wait_s=-1), dict(put_timeout=-1)):
    with pytest.raises(ValueError):
      Ingestor(t, **kwargs)
  with pytest.raises(TypeError, match="Table"):
    Ingestor(object())
  ing.close()
  s = ing.stats()
  assert (s.accepted, s.inserted, s.failed) == (2, 2, 0)
  assert contents(t)["x"].tolist() == [1, 2]


@pytest.mark.timeout(60)
def test_copy_protects_against_reused_buffers():
  t = Table(PLAIN)
  with t.ingestor(batch_size=8, max_wait_s=30.0, copy=True) as ing:
    buf = {"x": np.zeros((), np.int32), "y": np.zeros(2, np.float32)}
    for i in range(5):
      buf["x"][...] = i
      buf["y"][:] = [i, -i]
      ing.put(buf)  # the producer reuses its arrays
  assert contents(t)["x"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.timeout(60)
def test_warmup_compiles_without_touching_the_table():
  t = Table(QUEUE)  # a blocking rate limiter: the scratch inserts may time out
  t.insert(jax.tree_util.tree_map(lambda a: a[None], item(7)))
  with t.ingestor(batch_size=4) as ing:
    assert ing.warmup() == 3  # buckets 1, 2, 4
  assert_ids(t, [7])


Point = collections.namedtuple("Point", "a b")


def test_fast_check_agrees_with_jax_flattening():
  sig = fr.Signature({"p": Point(jnp.zeros(2), jnp.zeros((), jnp.int32)),
                      "q": (jnp.zeros((), bool), [jnp.zeros(3, jnp.uint8)]), "r": None})
  chk = ItemChecker(sig)
  good = {"p": Point(np.ones(2, np.float32), np.int32(3)),
          "q": (np.bool_(True), [np.arange(3, dtype=np.uint8)]), "r": None}
  leaves = chk.fast(good)
  assert leaves is not None
  for a, b in zip(leaves, jax.tree_util.tree_leaves(good), strict=True):
    assert a is b
  variants = [
      {**good, "p": (np.ones(2, np.float32), np.int32(3))},        # tuple, not Point
      {**good, "q": (np.bool_(True), (np.arange(3, dtype=np.uint8),))},
      {**good, "r": np.zeros(1)},
      {**good, "p": Point(np.ones(2, np.float64), np.int32(3))},
      {**good, "p": Point(np.ones(3, np.float32), np.int32(3))},
      {k: v for k, v in good.items() if k != "r"},
  ]
  for v in variants:
    assert chk.fast(v) is None
    with pytest.raises((ValueError, TypeError)):
      chk(v)
  # Python scalars take the slow path and come back as arrays of the leaf dtype.
  conv = chk({**good, "p": Point(np.ones(2, np.float32), 5)})
  assert conv[1].dtype == np.int32 and int(conv[1]) == 5


def test_python_scalars_take_the_fast_path_and_convert_exactly():
  sig = fr.Signature({"f": jnp.zeros((), jnp.float32), "i": jnp.zeros((), jnp.int32),
                      "b": jnp.zeros((), bool), "v": jnp.zeros(2, jnp.float32)})
  chk = ItemChecker(sig)
  v = np.zeros(2, np.float32)
  leaves = chk.fast({"f": 0.5, "i": 3, "b": True, "v": v})
  assert leaves is not None
  b, f, i, _ = leaves
  assert (type(b), type(f), type(i)) == (np.bool_, np.float32, np.int32)
  assert (bool(b), float(f), int(i)) == (True, 0.5, 3)
  assert chk.fast({"f": 1, "i": 3, "b": True, "v": v})[1] == np.float32(1.0)  # int -> float
  for bad in ({"i": 2**40}, {"i": 2.5}, {"b": 1}, {"f": "x"}, {"v": [0.0, 0.0]}):
    assert chk.fast({"f": 0.5, "i": 3, "b": True, "v": v, **bad}) is None
  with pytest.raises(ValueError, match="fit"):
    chk({"f": 0.5, "i": 2**40, "b": True, "v": v})


def test_stack_leaf_handles_views_jax_arrays_and_scalars():
  spec = jax.ShapeDtypeStruct((2,), jnp.float32)
  base = np.arange(12, dtype=np.float32).reshape(2, 6)
  views = [base[:, k] for k in range(6)]  # non-contiguous [2] views
  assert not views[0].flags.c_contiguous
  np.testing.assert_array_equal(stack_leaf(tuple(views), 6, spec), base.T)
  jx = tuple(jnp.asarray([k, -k], jnp.float32) for k in range(3))
  np.testing.assert_array_equal(stack_leaf(jx, 3, spec), [[0, 0], [1, -1], [2, -2]])
  contiguous = tuple(np.array([k, k + 0.5], np.float32) for k in range(4))
  out = stack_leaf(contiguous, 4, spec)
  assert out.dtype == np.float32 and out.shape == (4, 2)
  np.testing.assert_array_equal(out[:, 1], [0.5, 1.5, 2.5, 3.5])
  sc = jax.ShapeDtypeStruct((), jnp.int32)
  mixed = (np.int32(1), np.array(2, np.int32), jnp.int32(3))
  np.testing.assert_array_equal(stack_leaf(mixed, 3, sc), [1, 2, 3])
