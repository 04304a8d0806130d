"""What the ``Ingestor`` tests (tests/host/test_ingest_*.py) share: specs, items, and the
table's contents in insertion order.

Items carry their id in ``x`` (and ``[id, -id]`` in ``y``), so the table's
contents can be checked row by row: nothing lost, nothing duplicated, no
padding row, in the order the producers put them (keys are given in
insertion order). Specs are module constants: the jitted table operations
compile once per spec and insert bucket for each test file.
"""

from __future__ import annotations

import numpy as np

import funcreplay as fr
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
