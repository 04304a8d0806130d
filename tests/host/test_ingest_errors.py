"""``Ingestor`` errors: a failing insert reaches the producer, flush and close; a closed
table fails the ingestor; bad input raises clearly and leaves the table intact."""

from __future__ import annotations

import time

import numpy as np
import pytest

from funcreplay import Table, TableClosedError
from funcreplay.host.ingest import Ingestor, IngestorError
from tests.host.ingest_common import PLAIN, RICH, assert_ids, contents, item


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
