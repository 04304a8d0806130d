"""``Ingestor.close`` never hangs silently (issue 23 item 12).

A ``SampleToInsertRatio`` limiter blocks inserts once the learner stops
sampling; the pending items then never go in. The default ``close()`` waits
while inserts make progress, warns periodically while it waits, and raises a
``TimeoutError`` naming the limiter and the pending count after
``CLOSE_STALL_S`` seconds without progress; leaving a ``with`` block on an
exception inserts what the table takes and discards the rest after
``EXIT_STALL_S`` without progress, saying how many. The module constants are
patched to fractions of a second so every test is bounded.
"""

from __future__ import annotations

import logging
import threading
import time

import jax
import jax.numpy as jnp
import pytest

import funcreplay as fr
from funcreplay.host.ingest import ingestor as ingestor_lib

SIG = {"x": jax.ShapeDtypeStruct((), jnp.int32)}
LIMITER = fr.SampleToInsertRatio(1.0, 2, 2.0)  # window [0, 4]: ~4 inserts ahead of samples


@pytest.fixture
def fast_close(monkeypatch):
  monkeypatch.setattr(ingestor_lib, "CLOSE_STALL_S", 0.6)
  monkeypatch.setattr(ingestor_lib, "CLOSE_WARN_EVERY_S", 0.15)
  monkeypatch.setattr(ingestor_lib, "EXIT_STALL_S", 0.3)


def blocked_table(n_put=20):
  t = fr.Table(fr.TableSpec(64, SIG, rate_limiter=LIMITER))
  ing = t.ingestor(batch_size=2, max_wait_s=0.0, insert_poll_s=0.02)
  for i in range(n_put):
    ing.put({"x": i})
  return t, ing


def test_default_close_raises_after_a_stall_naming_the_limiter(fast_close, caplog):
  t, ing = blocked_table()
  t0 = time.monotonic()
  with caplog.at_level(logging.WARNING, logger="funcreplay"):
    with pytest.raises(TimeoutError, match=r"SampleToInsertRatio.*") as e:
      ing.close()
  elapsed = time.monotonic() - t0
  assert 0.5 < elapsed < 5.0
  msg = str(e.value)
  pending = ing.pending
  assert pending > 0 and f"{pending} items" in msg
  assert "discard_pending=True" in msg and "close(timeout=None)" in msg
  warned = [r.getMessage() for r in caplog.records if "Ingestor.close" in r.getMessage()]
  assert len(warned) >= 2 and all("SampleToInsertRatio" in w for w in warned)
  # The table is intact and usable; the ingestor still holds the items.
  size = t.size
  assert size + pending == 20
  ing.close(discard_pending=True)
  assert ing.stats().discarded == pending and t.size == size
  assert t.sample(2, timeout=1.0).valid.all()


def test_default_close_waits_while_inserts_progress(fast_close, monkeypatch):
  monkeypatch.setattr(ingestor_lib, "CLOSE_STALL_S", 1.5)
  t, ing = blocked_table()
  t.sample(1, timeout=30.0)  # compiled before the clock starts (a loaded CPU is slow)
  stop = threading.Event()

  def learner():  # samples slowly: each sample admits one more insert
    while not stop.is_set():
      try:
        t.sample(1, timeout=0.05)
      except TimeoutError:
        pass
      time.sleep(0.1)

  th = threading.Thread(target=learner, daemon=True)
  th.start()
  t0 = time.monotonic()
  try:
    ing.close()  # ~15 samples at 0.1 s: longer than CLOSE_STALL_S in all, never a stall
  finally:
    stop.set()
    th.join()
  assert time.monotonic() - t0 > 1.5
  assert ing.stats().inserted == 20


def test_explicit_close_timeout_names_the_limiter():
  t, ing = blocked_table()
  with pytest.raises(TimeoutError, match=r"after 0.2 s.*SampleToInsertRatio.*blocking inserts"):
    ing.close(timeout=0.2)
  ing.close(discard_pending=True)
  assert t.size + ing.stats().discarded == 20


def test_with_block_exit_is_bounded(fast_close):
  t = fr.Table(fr.TableSpec(64, SIG, rate_limiter=LIMITER))
  t0 = time.monotonic()
  with pytest.raises(TimeoutError, match="SampleToInsertRatio"):
    with t.ingestor(batch_size=2, max_wait_s=0.0, insert_poll_s=0.02) as ing:
      for i in range(20):
        ing.put({"x": i})
  assert time.monotonic() - t0 < 5.0
  ing.close(discard_pending=True)


def test_exit_on_exception_discards_blocked_items_and_says_how_many(fast_close):
  t = fr.Table(fr.TableSpec(64, SIG, rate_limiter=LIMITER))
  t0 = time.monotonic()
  with pytest.raises(KeyError) as e:
    with t.ingestor(batch_size=2, max_wait_s=0.0, insert_poll_s=0.02) as ing:
      for i in range(20):
        ing.put({"x": i})
      time.sleep(0.2)  # the limiter admits the first few
      raise KeyError("actor crashed")
  assert time.monotonic() - t0 < 3.0  # no long wait for the blocked limiter
  s = ing.stats()
  assert s.discarded > 0 and s.inserted + s.discarded == 20
  notes = " ".join(getattr(e.value, "__notes__", []))
  assert f"discarded {s.discarded} accepted items" in notes
  assert t.size == s.inserted


@pytest.mark.timeout(60)
def test_a_flush_whose_items_were_discarded_raises():
  """close(discard_pending=True) releases a waiting flush: it raises, naming the discarded
  items (it returned as if they were in the table), and so does a flush after it."""
  t, ing = blocked_table()
  out = {}

  def flush():
    try:
      ing.flush(timeout=30)
      out["flush"] = "returned"
    except Exception as e:  # noqa: BLE001 (inspected below)
      out["flush"] = e
  th = threading.Thread(target=flush)
  th.start()
  time.sleep(0.3)
  assert th.is_alive()  # the limiter blocks the queued items
  ing.close(timeout=10, discard_pending=True)
  th.join(10)
  s = ing.stats()
  assert s.discarded > 0 and t.size + s.discarded == 20
  assert isinstance(out["flush"], fr.IngestorClosedError), out
  assert f"{s.discarded} accepted items were discarded" in str(out["flush"])
  with pytest.raises(fr.IngestorClosedError, match="discarded"):
    ing.flush(timeout=1)
