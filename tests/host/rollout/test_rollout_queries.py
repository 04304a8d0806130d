"""Issue 28 (1): typed columns, count_by / is_ready / take_batch / peek, StalestFirst /
FreshestFirst, eviction receipts and the status flip, against a Python model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import funcreplay as fr

TASKS = ("math", "code", "chat", "tool")
STATUS = ("completed", "aborted", "expired")
ITEM = {"x": jax.ShapeDtypeStruct((), jnp.int32)}


def make(capacity=32, sampler=None, max_staleness=2, **kw):
  spec = fr.TableSpec(capacity, ITEM, sampler=sampler or fr.StalestFirst(),
                      max_staleness=max_staleness,
                      metadata=(fr.Column("task", vocab=TASKS), fr.Column("status", vocab=STATUS),
                                fr.Column("difficulty", "float32"), "seed"), **kw)
  return fr.Table(spec)


def put(t, xs, versions, tasks, **meta):
  xs = np.asarray(xs, np.int32)
  t.insert({"x": xs}, version=np.asarray(versions), metadata={"task": list(tasks), **meta})


class Model:
  """Items as dicts; the same eligibility and orders as the table."""

  def __init__(self, capacity, max_staleness):
    self.k, self.slots, self.pos, self.n = max_staleness, [None] * capacity, 0, 0

  @property
  def items(self):
    return [i for i in self.slots if i is not None]

  def insert(self, xs, versions, tasks):
    for x, v, task in zip(xs, versions, tasks):  # the Fifo ring: overwrite the next slot
      self.slots[self.pos] = dict(x=x, v=v, task=task, n=self.n)
      self.pos = (self.pos + 1) % len(self.slots)
      self.n += 1

  def eligible(self, version):
    return [i for i in self.items if version - i["v"] <= self.k]

  def count_by(self, version):
    el = self.eligible(version)
    return {t: sum(i["task"] == t for i in el) for t in TASKS}

  def take(self, counts, version, order):
    el = self.eligible(version)
    have = self.count_by(version)
    if any(have[t] < n for t, n in counts.items()):
      return None
    out = {}
    for t, n in counts.items():
      rows = sorted((i for i in el if i["task"] == t), key=order)[:n]
      out[t] = [i["x"] for i in rows]
      for i in rows:
        self.slots[self.slots.index(i)] = None
    return out


def test_column_declarations_and_bad_input():
  with pytest.raises(ValueError, match="vocab has duplicates"):
    fr.Column("task", vocab=("a", "a"))
  with pytest.raises(ValueError, match="needs dtype 'int32'"):
    fr.Column("x", "float32", vocab=("a",))
  with pytest.raises(ValueError, match="dtype must be one of"):
    fr.Column("x", "float64")
  with pytest.raises(TypeError, match="sequence of strings"):
    fr.Column("x", vocab="abc")
  t = make()
  put(t, [1], [0], ["math"], difficulty=0.25)
  before = t.stats().to_dict()
  with pytest.raises(ValueError, match=r"'physics' is not in the vocab of column 'task'"):
    put(t, [2], [0], ["physics"])
  with pytest.raises(TypeError, match=r"\['seed'\]: expected integers, got dtype float64"):
    t.insert({"x": np.int32([3])}, metadata={"task": "math", "seed": 1.5})
  with pytest.raises(ValueError, match="NaN in float column 'difficulty'"):
    t.insert({"x": np.int32([3])}, metadata={"difficulty": float("nan")})
  with pytest.raises(ValueError, match="not in the vocab"):
    t.count(where={"task": "physics"})
  with pytest.raises(ValueError, match="unknown column 'nope'"):
    t.count_by("nope", ["a"])
  with pytest.raises(ValueError, match="duplicate values"):
    t.count_by("task", ["math", "math"])
  assert t.stats().to_dict() == before and len(t) == 1


def test_vocab_and_float_columns_round_trip_and_where():
  t = make()
  put(t, [1, 2, 3], [0, 0, 0], ["math", "code", "math"], difficulty=[0.5, -0.0, 1e-3],
      status=["completed", "aborted", "completed"])
  assert t.count(where={"task": "math"}) == 2
  assert t.count(where={"task": ["math", "code"], "status": "completed"}) == 2
  assert t.count(where={"difficulty": 0.0}) == 1  # -0.0 is stored as 0.0
  assert t.count(where={"difficulty": [0.5, 1e-3]}) == 2
  p = t.peek(3)
  assert list(p.metadata["task"]) == ["math", "code", "math"]
  np.testing.assert_array_equal(p.metadata["difficulty"], np.float32([0.5, 0.0, 1e-3]))
  # The pure state keeps int32 words: the float column's bit patterns.
  stored = np.asarray(t.snapshot().metadata["difficulty"])[:3]
  np.testing.assert_array_equal(stored.view(np.float32), np.float32([0.5, 0.0, 1e-3]))
  t.set_metadata(p.info.slot[:1], p.info.key[:1], "task", "tool")
  assert t.count_by("task", TASKS) == {"math": 1, "code": 1, "chat": 0, "tool": 1}


def test_peek_changes_nothing():
  t = make(sampler=fr.Uniform(), max_times_sampled=1)
  put(t, range(5), [0] * 5, ["math"] * 5)
  before, key = t.stats().to_dict(), np.asarray(t.rng_key())
  p = t.peek(8)
  assert p.valid.tolist() == [True] * 5 + [False] * 3
  assert p.data["x"][:5].tolist() == [0, 1, 2, 3, 4]  # oldest first for a random sampler
  assert t.stats().to_dict() == before and np.array_equal(np.asarray(t.rng_key()), key)
  assert len(t) == 5


ORDERS = {
    "StalestFirst": (fr.StalestFirst(), lambda i: (i["v"], i["n"])),
    "FreshestFirst": (fr.FreshestFirst(), lambda i: (-i["v"], i["n"])),
}


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_ordered_samplers_match_model(name):
  selector, order = ORDERS[name]
  t = make(sampler=selector, max_staleness=None)
  vs = [3, 1, 2, 1, 0, 2, 3, 0]
  put(t, range(8), vs, ["math"] * 8)
  model = sorted((dict(x=i, v=v, n=i) for i, v in enumerate(vs)), key=order)
  smp = t.sample(5)
  assert smp.data["x"].tolist() == [i["x"] for i in model[:5]]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 3), st.integers(0, 4)),
                min_size=1, max_size=12),
       st.integers(0, 2**16))
def test_multi_task_take_and_is_ready_match_model(ops_, seed):
  rng = np.random.default_rng(seed)
  t = make(capacity=16, max_staleness=2)
  model = Model(16, 2)
  version, x = 0, 0
  for n, bump, want in ops_:
    xs = list(range(x, x + n))
    x += n
    tasks = [TASKS[i] for i in rng.integers(0, 4, n)]
    vs = [version - int(d) for d in rng.integers(0, 4, n)]
    put(t, xs, vs, tasks)
    model.insert(xs, vs, tasks)
    version += bump % 2
    t.set_version(version)
    assert t.count_by("task", TASKS) == model.count_by(version)
    counts = {TASKS[i]: int(c) for i, c in enumerate(rng.integers(0, want + 1, 4)) if c}
    if not counts:
      continue
    expect = model.take(counts, version, ORDERS["StalestFirst"][1])
    assert t.is_ready(counts) == (expect is not None)
    if expect is None:
      with pytest.raises(TimeoutError, match="too few eligible items"):
        t.take_batch(counts, timeout=0)
      continue
    got = t.take_batch(counts, timeout=0)
    assert {k: v.data["x"].tolist() for k, v in got.items()} == expect
    for k, v in got.items():
      assert v.valid.all() and list(v.metadata["task"]) == [k] * len(v.valid)
    assert len(t) == len(model.items)


def test_take_uniform_and_prioritized_are_subsets_without_repeats():
  for sampler in (fr.Uniform(), fr.Prioritized(1.0)):
    t = make(sampler=sampler, max_staleness=None)
    put(t, range(20), [0] * 20, [TASKS[i % 2] for i in range(20)])
    got = t.take_batch({"math": 4, "code": 3})
    xs = got["math"].data["x"].tolist() + got["code"].data["x"].tolist()
    assert len(set(xs)) == 7 and all(x % 2 == 0 for x in got["math"].data["x"])
    assert len(t) == 13 and t.stats().to_dict()["deletes"] == 7


def test_prioritized_take_follows_weights():
  """Exponential races: the first of two items is the heavier one with probability
  w1 / (w1 + w2) = 0.8. 400 fixed-seed trials; 4-sigma tolerance (sigma = 0.02)."""
  t = make(sampler=fr.Prioritized(1.0), max_staleness=None, capacity=4)
  wins = 0
  for _ in range(400):
    t.insert({"x": np.int32([1, 2])}, priority=np.float32([4.0, 1.0]),
             metadata={"task": ["math", "math"]})
    got = t.take_batch({"math": 1})["math"]
    wins += int(got.data["x"][0] == 1)
    t.take_batch({"math": 1})
  assert abs(wins / 400 - 0.8) < 4 * 0.02


def test_take_batch_waits_for_producers():
  import threading
  t = make()
  threading.Timer(0.2, lambda: put(t, [1, 2], [0, 0], ["code", "code"])).start()
  got = t.take_batch({"code": 2}, timeout=10.0)
  assert got["code"].data["x"].tolist() == [1, 2]


def test_evict_receipt_and_expire_flip():
  t = make(max_staleness=1)
  put(t, range(4), [0, 0, 2, 2], ["math", "code", "math", "code"], difficulty=[1.0, 2.0, 3.0, 4.0])
  t.set_version(2)
  r = t.expire_stale(receipt=True)
  assert len(r) == 2 and sorted(r.metadata["difficulty"].tolist()) == [1.0, 2.0]
  assert list(r.metadata["status"]) == ["expired", "expired"]  # the values after the flip
  assert t.count_by("status", STATUS, include_stale=True) == {"completed": 2, "aborted": 0,
                                                               "expired": 2}
  assert t.expire_stale() == 0  # already marked
  requeue = t.take_batch({"expired": 2}, column="status", include_stale=True, timeout=0)
  assert sorted(requeue["expired"].data["x"].tolist()) == [0, 1]
  t.set_version(5)
  r = t.evict_stale(receipt=True)
  assert sorted(r.metadata["task"].tolist()) == ["code", "math"] and len(t) == 0
  assert sorted(r.versions.tolist()) == [2, 2]


def test_take_without_consuming_counts_reuse_and_frees_at_the_cap():
  t = make(max_times_sampled=2, max_staleness=None)
  put(t, range(4), [0, 1, 2, 3], ["math", "code", "math", "code"])
  a = t.take_batch({"math": 1, "code": 1}, consume=False)
  assert a["math"].data["x"].tolist() == [0] and a["code"].data["x"].tolist() == [1]
  assert a["math"].info.times_sampled.tolist() == [1] and len(t) == 4
  b = t.take_batch({"math": 1, "code": 1}, consume=False)
  assert b["math"].data["x"].tolist() == [0] and b["code"].info.times_sampled.tolist() == [2]
  s = t.stats().to_dict()
  assert len(t) == 2 and s["evicted_reuse"] == 2 and s["samples"] == 4
  c = t.take_batch({"math": 1, "code": 1}, consume=False)
  assert c["math"].data["x"].tolist() == [2] and c["code"].data["x"].tolist() == [3]


def test_spec_declarations():
  plain = fr.TableSpec(4, ITEM, metadata=("task", "seed"))
  assert plain == fr.TableSpec(4, ITEM, metadata=(fr.Column("task"), "seed"))
  typed = fr.TableSpec(4, ITEM, metadata=(fr.Column("task", vocab=("a", "b")),))
  assert typed != fr.TableSpec(4, ITEM, metadata=("task",))
  assert typed.column("task").vocab == ("a", "b") and typed.replace(capacity=8).columns == (
      typed.columns)
  with pytest.raises(ValueError, match="built-in column"):
    fr.TableSpec(4, ITEM, metadata=(fr.Column("key"),))
  ragged = fr.TableSpec(4, {"t": fr.Ragged(8, jnp.int32), "x": ITEM["x"]})
  assert ragged.signature.leaves[0].shape == () and ragged.ragged == ((0, fr.Ragged(8)),)
  with pytest.raises(ValueError, match="fr.Ragged"):
    fr.make_table(ragged)
  with pytest.raises(ValueError, match="max_len"):
    fr.Ragged(0)


def test_take_bad_requests_leave_the_table_intact():
  t = make()
  put(t, range(3), [0, 0, 0], ["math"] * 3)
  before = t.stats().to_dict()
  with pytest.raises(ValueError, match="not in the vocab"):
    t.take_batch({"physics": 1})
  with pytest.raises(ValueError, match=r"counts\['math'\] must lie in"):
    t.take_batch({"math": -1})
  with pytest.raises(TypeError, match="non-empty dict"):
    t.take_batch({})
  with pytest.raises(ValueError, match="ragged must be one of"):
    t.take_batch({"math": 1}, ragged="dense")
  with pytest.raises(TimeoutError, match=r"math.: '3/4'"):
    t.take_batch({"math": 4}, timeout=0)
  assert t.stats().to_dict() == before and len(t) == 3


SELECTORS = [fr.StalestFirst(), fr.FreshestFirst(), fr.Fifo(), fr.Lifo(), fr.MinHeap(),
             fr.MaxHeap()]
_SELECT = {}  # jitted select_by per selector (one compilation each)


def _select_program(sampler):
  from funcreplay.core.ops import grouped
  if sampler not in _SELECT:
    spec = fr.TableSpec(48, ITEM, sampler=sampler, metadata=("task",))
    pure = fr.make_table(spec)
    _SELECT[sampler] = (spec, pure.init(), jax.jit(pure.insert), jax.jit(
        lambda state, counts: grouped.select_by(spec, state, "task",
                                                jnp.arange(4, dtype=jnp.int32), counts,
                                                batch_size=64)))
  return _SELECT[sampler]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(SELECTORS) - 1), st.integers(1, 40), st.booleans(),
       st.lists(st.integers(0, 12), min_size=4, max_size=4), st.integers(0, 2**16))
def test_grouped_selection_matches_a_sort(which, n, wide, counts, seed):
  """``select_by`` (top-k stages when the keys fit float32, the radix select otherwise:
  wide version ranges force it) returns each group's first items in the sampler's order."""
  from funcreplay.core import ordering
  sampler = SELECTORS[which]
  spec, empty, insert, select = _select_program(sampler)
  rng = np.random.default_rng(seed)
  span = 2**30 if wide else 4
  x = np.zeros(40, np.int32)
  x[:n] = np.arange(n)
  state = insert(empty, {"x": jnp.asarray(x)}, mask=jnp.arange(40) < n,
                  version=jnp.asarray(rng.integers(-span, span, 40), jnp.int32),
                  priority=jnp.asarray(rng.integers(0, 3, 40), jnp.float32),
                  metadata={"task": jnp.asarray(rng.integers(0, 4, 40), jnp.int32)})
  got, grp, avail = select(state, jnp.asarray(counts, jnp.int32))
  keys = [np.asarray(k).astype(np.int64) for k in ordering.order_keys(sampler, state)]
  task, occ = np.asarray(state.metadata["task"]), np.asarray(state.occupied)
  got, grp = np.asarray(got), np.asarray(grp)
  for g in range(4):
    members = sorted((s for s in range(48) if occ[s] and task[s] == g),
                     key=lambda s: tuple(k[s] for k in keys))
    assert int(avail[g]) == len(members)
    assert [int(s) for s, q in zip(got, grp) if q == g and s >= 0] == members[:counts[g]]
