"""``SequenceWriter``: windows of consecutive steps, stride/overlap, gaps, episodes, padding.

The payload of every step is its step id, so an item is correct exactly when
its ids are consecutive and start where the reference model says. The grid
sweep uses a recording sink (no JAX); one test goes through a real
``Table`` and ``Ingestor``.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import Table
from funcreplay.host.writers import SequenceWriter, sequence_signature

STEP = {"id": jax.ShapeDtypeStruct((), jnp.int32), "obs": jax.ShapeDtypeStruct((2,), jnp.float32)}


def step(i):
  return {"id": np.int32(i), "obs": np.array([i, 0.5 * i], np.float32)}


class Recorder:
  """A sink recording what a writer puts."""

  def __init__(self):
    self.items = []

  def put(self, item, *, version=None, priority=None, metadata=None):
    self.items.append(dict(item=item, version=version, priority=priority, metadata=metadata))


def expected_windows(n, length, stride, pad):
  """Reference: (ids, n_real) of every item a segment of ``n`` steps gives."""
  out = [(list(range(s, s + length)), length) for s in range(0, n - length + 1, stride)]
  nxt = len(out) * stride
  covered = max(((len(out) - 1) * stride + length) if out else 0, nxt)
  if pad and covered < n:  # some trailing step is in no full window
    out.append((list(range(nxt, n)) + [0] * (length - (n - nxt)), n - nxt))
  return out


def ids_of(rec, pad):
  out = []
  for r in rec.items:
    it = r["item"]
    steps = it["steps"] if pad else it
    ids = np.asarray(steps["id"]).tolist()
    np.testing.assert_array_equal(np.asarray(steps["obs"])[:, 0], np.asarray(ids, np.float32))
    n_real = int(np.asarray(it["mask"]).sum()) if pad else len(ids)
    if pad:
      assert np.asarray(it["mask"]).tolist() == [True] * n_real + [False] * (len(ids) - n_real)
      assert np.all(np.asarray(steps["obs"])[n_real:] == 0)
    out.append((ids, n_real))
  return out


@pytest.mark.parametrize("pad", [False, True])
def test_grid_of_length_stride_segment_lengths(pad):
  for length, stride, n in itertools.product(range(1, 5), range(1, 6), range(0, 11)):
    rec = Recorder()
    w = SequenceWriter(rec, length, stride=stride, pad=pad, step_signature=STEP)
    for i in range(n):
      w.append(step(i), step_id=i)
    w.end_episode()
    want = expected_windows(n, length, stride, pad)
    assert ids_of(rec, pad) == want, (length, stride, n)
    for ids, n_real in want:  # strictly consecutive real steps
      assert ids[:n_real] == list(range(ids[0], ids[0] + n_real))
    s = w.stats()
    n_full = len(range(0, n - length + 1, stride)) if n >= length else 0
    covered = 0 if n_full == 0 else (n_full - 1) * stride + length
    partial = max(n_full * stride, covered) < n
    assert s.steps == n and s.items == len(want) and s.episodes == (1 if n else 0)
    assert s.padded_items == (1 if pad and partial else 0)
    assert s.dropped_partials == (1 if partial and not pad else 0)
    if not pad and partial:
      assert s.dropped_steps == n - max(n_full * stride, covered)


def test_gaps_and_episode_changes_end_segments():
  rec = Recorder()
  w = SequenceWriter(rec, 3, stride=1, step_signature=STEP)
  for i in [0, 1, 2, 3, 7, 8, 9, 10, 11]:          # gap 3 -> 7
    w.append(step(i), step_id=i, episode_id="a")
  for i in [0, 1, 2]:                               # a new episode restarts at step 0
    w.append(step(100 + i), step_id=i, episode_id="b")
  w.append(step(200), step_id=5, episode_id="b")    # gap inside episode b
  w.close()
  assert [ids for ids, _ in ids_of(rec, False)] == [
      [0, 1, 2], [1, 2, 3], [7, 8, 9], [8, 9, 10], [9, 10, 11], [100, 101, 102]]
  s = w.stats()
  assert (s.gaps, s.episodes, s.items, s.dropped_partials) == (2, 2, 6, 1)
  assert s.dropped_steps == 1  # step 200 (the other trailing steps were in windows)
  # A repeated or decreasing step id is a gap, too.
  rec = Recorder()
  w = SequenceWriter(rec, 2, step_signature=STEP)
  for i in [0, 1, 1, 2, 0, 1]:
    w.append(step(i), step_id=i)
  w.close()
  assert [ids for ids, _ in ids_of(rec, False)] == [[0, 1], [1, 2], [0, 1]]
  assert w.stats().gaps == 2


def test_padding_at_gap_and_episode_end():
  rec = Recorder()
  w = SequenceWriter(rec, 4, stride=2, pad=True, step_signature=STEP)
  for i in [0, 1, 2, 3, 4, 10, 11]:
    w.append(step(i), step_id=i)
  w.end_episode()
  assert ids_of(rec, True) == [([0, 1, 2, 3], 4), ([2, 3, 4, 0], 3), ([10, 11, 0, 0], 2)]
  s = w.stats()
  assert (s.padded_items, s.dropped_partials, s.gaps) == (2, 0, 1)


class FlakySink(Recorder):
  """A recorder whose next ``fail`` puts raise TimeoutError (a full table)."""

  def __init__(self, fail):
    super().__init__()
    self.fail = fail

  def put(self, item, **kw):
    if self.fail:
      self.fail -= 1
      raise TimeoutError("full")
    super().put(item, **kw)


@pytest.mark.parametrize("cause", ["episode", "gap"])
def test_a_retried_append_counts_its_episode_or_gap_once(cause):
  """The sink raises while an episode change (or a gap) ends a segment; the caller
  retries the append, as the docs say. The episode / gap counted once (each failed try
  counted one more before)."""
  sink = FlakySink(fail=0)
  w = SequenceWriter(sink, 3, pad=True, step_signature=STEP)
  w.append(step(0), step_id=0, episode_id=1)
  sink.fail = 2
  kw = dict(step_id=0, episode_id=2) if cause == "episode" else dict(step_id=5, episode_id=1)
  for _ in range(2):
    with pytest.raises(TimeoutError):
      w.append(step(1), **kw)
  w.append(step(1), **kw)
  s = w.stats()
  assert (s.episodes, s.gaps) == ((1, 0) if cause == "episode" else (0, 1))
  assert ids_of(sink, True) == [([0, 0, 0], 1)] and s.padded_items == 1


def test_items_carry_version_and_metadata_of_their_first_step():
  rec = Recorder()
  w = SequenceWriter(rec, 3, stride=2, step_signature=STEP, priority_fn=lambda it: 2.0)
  for i in range(7):
    w.append(step(i), step_id=i, version=10 + i, metadata={"task": i % 2})
  assert [r["version"] for r in rec.items] == [10, 12, 14]
  assert [r["metadata"] for r in rec.items] == [{"task": 0}, {"task": 0}, {"task": 0}]
  assert all(r["priority"] == 2.0 for r in rec.items)


@pytest.mark.timeout(60)
def test_into_table_and_ingestor_with_derived_step_signature():
  spec = fr.TableSpec(32, sequence_signature(STEP, 3, pad=True), metadata=("task",))
  t = Table(spec)
  with SequenceWriter(t, 3, pad=True) as w:  # step signature derived from the table
    for i in range(4):
      w.append(step(i), step_id=i, version=5, metadata={"task": 7})
  with t.ingestor(batch_size=4) as ing, SequenceWriter(ing, 3, pad=True) as w2:
    for i in range(20, 26):
      w2.append(step(i), step_id=i, version=6 + i)
  s = t.snapshot()
  occ = np.asarray(s.occupied)
  order = np.argsort(np.asarray(s.key)[occ])
  ids = np.asarray(s.data["steps"]["id"])[occ][order].tolist()
  assert ids == [[0, 1, 2], [3, 0, 0], [20, 21, 22], [23, 24, 25]]
  assert np.asarray(s.data["mask"])[occ][order].sum(1).tolist() == [3, 1, 3, 3]
  assert np.asarray(s.version)[occ][order].tolist() == [5, 5, 26, 29]
  assert np.asarray(s.metadata["task"])[occ][order].tolist() == [7, 7, 0, 0]


def test_bad_configuration_and_steps():
  t = Table(fr.TableSpec(8, sequence_signature(STEP, 3)))
  with pytest.raises(ValueError, match="length"):
    SequenceWriter(t, 0)
  with pytest.raises(ValueError, match="stride"):
    SequenceWriter(t, 3, stride=0)
  with pytest.raises(ValueError, match=r"leading \[4\]"):
    SequenceWriter(t, 4)
  with pytest.raises(ValueError, match="mask"):
    SequenceWriter(t, 3, pad=True)
  with pytest.raises(ValueError, match="sequence_signature"):
    SequenceWriter(t, 3, step_signature={"id": jax.ShapeDtypeStruct((), jnp.int32)})
  with pytest.raises(TypeError, match="sink"):
    SequenceWriter(object(), 3, step_signature=STEP)
  with pytest.raises(ValueError, match="step_signature"):
    SequenceWriter(Recorder(), 3)
  w = SequenceWriter(Recorder(), 2, step_signature=STEP)
  with pytest.raises(TypeError, match=r"\['obs'\].*float32"):
    w.append({"id": np.int32(0), "obs": np.zeros(2, np.float64)})
  with pytest.raises(TypeError, match="step_id"):
    w.append(step(0), step_id=1.5)
  with pytest.raises(TypeError, match="version"):
    w.append(step(0), version=1.5)
  wt = SequenceWriter(t, 3)
  with pytest.raises(ValueError, match="unknown metadata"):
    wt.append(step(0), metadata={"task": 1})
  assert w.stats().steps == wt.stats().steps == 0
