"""Typed columns (``fr.Column``: vocabularies, float32) through the ``Ingestor``: what
``put`` / ``put_batch`` store is what ``Table.insert`` stores for the same values, and a bad
value is refused at ``put`` time with ``Table.insert``'s error (nothing queued, the table
intact). The Ray ``RemoteWriter`` encodes through the same functions
(``funcreplay.host.rollout.columns``); its stacking is checked here without Ray."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import funcreplay as fr
from funcreplay.host.rollout import columns as col_lib

TASKS = ("math", "code", "chat", "tool")
ITEM = {"x": jax.ShapeDtypeStruct((), jnp.int32)}
SPEC = fr.TableSpec(64, ITEM, metadata=(fr.Column("task", vocab=TASKS),
                                        fr.Column("difficulty", dtype="float32"), "seed"))

# float32-representable values, -0.0 (stored as 0.0), extremes and denormals included.
FLOATS = st.floats(width=32, allow_nan=False)


def stored(table):
  """``{column: stored int32 words}`` and ``x`` of the table's items in insertion order."""
  s = table.snapshot()
  occ = np.asarray(s.occupied)
  order = np.argsort(np.asarray(s.key)[occ], kind="stable")
  out = {k: np.asarray(v)[occ][order] for k, v in s.metadata.items()}
  out["x"] = np.asarray(fr.stored_items(table.spec, s)["x"])[occ][order]
  return out


def via_insert(xs, metas):
  """The reference: one ``Table.insert`` per item with the same metadata values."""
  t = fr.Table(SPEC)
  for x, m in zip(xs, metas):
    t.insert({"x": np.int32([x])}, metadata={k: [v] for k, v in m.items()})
  return stored(t)


def assert_same(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.timeout(120)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(st.tuples(st.sampled_from(TASKS), FLOATS, st.integers(-2**31, 2**31 - 1),
                               st.sets(st.sampled_from(("task", "difficulty", "seed")))),
                     min_size=1, max_size=12))
def test_put_stores_what_insert_stores(rows):
  metas = [{k: v for k, v in zip(("task", "difficulty", "seed"), r[:3]) if k in r[3]}
           for r in rows]
  t = fr.Table(SPEC)
  with t.ingestor(batch_size=4, max_wait_s=0.0) as ing:
    for i, m in enumerate(metas):
      ing.put({"x": np.int32(i)}, metadata=m or None)
    ing.flush()
  assert_same(stored(t), via_insert(range(len(metas)), metas))


@pytest.mark.timeout(60)
def test_put_batch_stores_what_insert_stores():
  tasks = ["code", "math", "tool", "code", "chat"]
  diff = np.float32([0.5, -0.0, 1e-40, 3.25, -7.0])  # -0.0 stored as 0.0; a denormal
  t = fr.Table(SPEC)
  with t.ingestor(batch_size=3, max_wait_s=0.0) as ing:
    ing.put_batch({"x": np.arange(5, dtype=np.int32)},
                  metadata={"task": tasks, "difficulty": diff, "seed": 9})
    ing.put_batch({"x": np.int32([5, 6])}, metadata={"task": "chat"})   # a scalar broadcasts
    ing.put({"x": np.int32(7)}, metadata={"task": np.str_("tool"), "difficulty": 0.5})
    ing.flush()
  ref = fr.Table(SPEC)
  ref.insert({"x": np.arange(5, dtype=np.int32)},
             metadata={"task": tasks, "difficulty": diff, "seed": 9})
  ref.insert({"x": np.int32([5, 6])}, metadata={"task": "chat"})
  ref.insert({"x": np.int32([7])}, metadata={"task": ["tool"], "difficulty": [0.5]})
  got = stored(t)
  assert_same(got, stored(ref))
  assert list(col_lib.decode(SPEC.columns[0], got["task"])) == tasks + ["chat"] * 2 + ["tool"]
  np.testing.assert_array_equal(col_lib.decode(SPEC.columns[1], got["difficulty"]),
                                np.float32([0.5, 0.0, 1e-40, 3.25, -7.0, 0, 0, 0.5]))
  # and the queries see them
  assert t.count_by("task", list(TASKS), where={"difficulty": 0.5}) == \
      {"math": 0, "code": 1, "chat": 0, "tool": 1}


BAD = [
    (dict(task="physics"), ValueError, r" metadata\['task'\].*'physics' is not in the vocab"),
    (dict(task=2.5), TypeError, r" metadata\['task'\].*takes strings of its vocab"),
    (dict(task=7), ValueError, r" metadata\['task'\].*codes must lie in \[0, 4\)"),
    (dict(difficulty="hard"), TypeError, r" metadata\['difficulty'\].*float32"),
    (dict(difficulty=float("nan")), ValueError, r" metadata\['difficulty'\].*NaN"),
    (dict(difficulty=1e39), ValueError, r" metadata\['difficulty'\].*overflows float32"),
    (dict(seed=0.5), TypeError, r" metadata\['seed'\].*expected integers"),
    (dict(seed="x"), TypeError, r" metadata\['seed'\]"),
    (dict(seed=2**40), ValueError, r" metadata\['seed'\]"),
    (dict(nope=1), ValueError, r": unknown metadata columns \['nope'\]"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("meta, exc, pattern", BAD)
def test_bad_values_refused_at_put_like_insert(meta, exc, pattern):
  t = fr.Table(SPEC)
  t.insert({"x": np.int32([1])}, metadata={"task": ["code"], "difficulty": [0.25]})
  before = stored(t)
  with pytest.raises(exc, match="Table.insert" + pattern):  # the reference
    t.insert({"x": np.int32([2])}, metadata={k: [v] for k, v in meta.items()})
  with t.ingestor(batch_size=2, max_wait_s=0.0) as ing:
    with pytest.raises(exc, match="Ingestor.put" + pattern):
      ing.put({"x": np.int32(2)}, metadata=meta)
    with pytest.raises(exc, match="Ingestor.put_batch" + pattern):
      ing.put_batch({"x": np.int32([2, 3])}, metadata={k: [v, v] for k, v in meta.items()})
    assert ing.pending == 0  # nothing queued
    ing.flush()
    assert ing.stats().inserted == 0
  assert_same(stored(t), before)


@pytest.mark.timeout(60)
def test_one_item_takes_one_value():
  t = fr.Table(SPEC)
  with t.ingestor() as ing:
    with pytest.raises(TypeError, match=r"Ingestor.put metadata\['task'\].*one value"):
      ing.put({"x": np.int32(0)}, metadata={"task": ["math", "code"]})
    with pytest.raises(ValueError, match=r"put_batch metadata\['task'\].*shape \[2\]"):
      ing.put_batch({"x": np.int32([0, 1])}, metadata={"task": ["math"] * 3})
  assert len(t) == 0


def test_remote_writer_batches_carry_insert_values():
  """The Ray writer's stacking (``funcreplay.ray.batching``) gives the actor's
  ``Table.insert`` values it stores as the put-time words (no Ray needed)."""
  batching = pytest.importorskip("funcreplay.ray.batching")
  metas = [col_lib.item_words(SPEC.columns, {"task": "tool", "difficulty": -0.0}, "put"),
           None,
           col_lib.item_words(SPEC.columns, {"difficulty": 2.5, "seed": -3}, "put")]
  entries = [(np.int32(i), None, None, m) for i, m in enumerate(metas)]
  leaves, version, prio, meta = batching.stack_entries(entries, SPEC.signature, SPEC.columns)
  assert version is None and prio is None
  assert meta["difficulty"].dtype == np.float32
  t = fr.Table(SPEC)
  t.insert({"x": leaves[0]}, metadata=meta)
  assert_same(stored(t), via_insert(range(3), [{"task": "tool", "difficulty": -0.0}, {},
                                               {"difficulty": 2.5, "seed": -3}]))
