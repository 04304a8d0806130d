"""``Ingestor`` delivery: order (per producer, across chunks), no padding rows, flush and
close semantics, versions / priorities / metadata, copying reused buffers, warm-up.
Helpers and the id-carrying items: tests/host/ingest_common.py."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest

from funcreplay import Table
from funcreplay.host.ingest import Ingestor, IngestorClosedError
from tests.host.ingest_common import PLAIN, QUEUE, RICH, assert_ids, contents, item


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("native", [False, True, None])
def test_warmup_compiles_the_tables_own_programs(native):
  """``warmup`` compiles the programs of the table's own executor: its scratch table was
  built without the table's ``native``, so a ``native=False`` table's first insert of a
  new bucket still traced and compiled (found by a review). After it, inserts of every
  bucket trace nothing."""
  from jax._src import dispatch  # the event name JAX reports each trace under
  t = Table(PLAIN, native=native)
  assert t.native in (True, False) and (native is None or t.native is native)
  with t.ingestor(batch_size=4) as ing:
    ing.warmup()
  traces = []

  def listen(event, *_, **__):
    if event == dispatch.JAXPR_TRACE_EVENT:
      traces.append(event)
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    for n in (1, 2, 3, 4):
      t.insert(jax.tree_util.tree_map(lambda a, n=n: np.stack([a] * n), item(n)))
    len(t)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert traces == []
  t.close()
