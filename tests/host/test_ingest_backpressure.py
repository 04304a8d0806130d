"""``Ingestor`` back-pressure: a blocking table bounds the ingestor's queue (FIFO kept),
and a full queue raises (``on_full="raise"``) or times out (``put_timeout``)."""

from __future__ import annotations

import threading
import time

import jax
import pytest

from funcreplay import Table
from funcreplay.host.ingest import Ingestor, IngestorFullError
from tests.host.ingest_common import QUEUE, item


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
