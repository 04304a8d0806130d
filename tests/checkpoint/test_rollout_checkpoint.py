"""Issue 28 (4): checkpoints round-trip vocabularies, float columns, the new samplers,
ragged values and (opt-in, pickled) payloads."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr

SPEC = fr.TableSpec(
    16, {"tokens": fr.Ragged(40, jnp.int32), "logp": fr.Ragged(40, jnp.float32),
         "reward": jax.ShapeDtypeStruct((), jnp.float32)},
    sampler=fr.StalestFirst(), max_staleness=4,
    metadata=(fr.Column("task", vocab=("math", "code", "chat")),
              fr.Column("difficulty", "float32"), "seed"))


def fill(t, n, rng, payload=True):
  lengths = rng.integers(0, 41, n)
  t.insert({"tokens": [rng.integers(0, 1000, k).astype(np.int32) for k in lengths],
            "logp": [rng.standard_normal(k).astype(np.float32) for k in lengths],
            "reward": rng.standard_normal(n).astype(np.float32)},
           version=rng.integers(0, 3, n).astype(np.int32),
           metadata={"task": [("math", "code", "chat")[i] for i in rng.integers(0, 3, n)],
                     "difficulty": rng.random(n).astype(np.float32), "seed": 7},
           payload=[{"prompt": f"p{i}", "n": int(k)} for i, k in enumerate(lengths)]
           if payload else None)


def same(a, b):
  pa, pb = a.peek(16, ragged="packed"), b.peek(16, ragged="packed")
  for leaf in ("tokens", "logp"):
    np.testing.assert_array_equal(pa.data[leaf].values, pb.data[leaf].values)
    np.testing.assert_array_equal(pa.data[leaf].lengths, pb.data[leaf].lengths)
  for c in ("task", "difficulty", "seed"):
    np.testing.assert_array_equal(pa.metadata[c], pb.metadata[c])
  np.testing.assert_array_equal(pa.info.key, pb.info.key)
  return pa, pb


def test_round_trip_with_pickled_payloads(tmp_path):
  rng = np.random.default_rng(0)
  t = fr.Table(SPEC, payloads=True)
  for _ in range(4):  # 24 items into 16 slots: the ring evicted some, the arena compacted
    fill(t, 6, rng)
  t.take_batch({"code": 1}, timeout=0)
  path = str(tmp_path / "c")
  t.save(path, payloads="pickle")
  r = fr.Table.restore(path, allow_pickle=True)
  assert r.spec == SPEC and r.keeps_payloads
  pa, pb = same(t, r)
  assert pa.payload == pb.payload
  assert all((p is not None) == v for p, v in zip(pb.payload, pb.valid))
  # the same next take (same PRNG key, same order)
  a, b = t.take_batch({"math": 1, "chat": 1}), r.take_batch({"math": 1, "chat": 1})
  for k in a:
    np.testing.assert_array_equal(a[k].data["tokens"].values, b[k].data["tokens"].values)
    assert a[k].payload == b[k].payload


def test_payloads_need_opt_in_both_ways(tmp_path):
  rng = np.random.default_rng(1)
  t = fr.Table(SPEC, payloads=True)
  fill(t, 5, rng)
  with pytest.raises(ValueError, match="only pickle can store"):
    t.save(str(tmp_path / "a"))
  assert not os.path.exists(tmp_path / "a")
  t.save(str(tmp_path / "b"), payloads="pickle")
  with pytest.raises(fr.CheckpointError, match="allow_pickle=True"):
    fr.Table.restore(str(tmp_path / "b"))
  r = fr.Table.restore(str(tmp_path / "b"), payloads=False)  # no unpickling at all
  assert not r.keeps_payloads
  same(t, r)
  t.save(str(tmp_path / "c"), payloads="drop")
  r = fr.Table.restore(str(tmp_path / "c"))
  assert not r.keeps_payloads and r.peek(5).payload is None
  # load into a live table
  live = fr.Table(SPEC, payloads=True)
  fill(live, 3, rng)
  live.load(str(tmp_path / "b"), allow_pickle=True)
  assert live.peek(5).payload == t.peek(5).payload and len(live) == 5


def test_ragged_without_payloads_and_spec_mismatch(tmp_path):
  rng = np.random.default_rng(2)
  t = fr.Table(SPEC)
  fill(t, 7, rng, payload=False)
  path = str(tmp_path / "c")
  t.save(path)
  same(t, fr.Table.restore(path))
  other = SPEC.replace(metadata=(fr.Column("task", vocab=("math", "code")), "difficulty",
                                 "seed"))
  with pytest.raises(fr.CheckpointError, match="columns"):
    fr.Table.restore(path, spec=other)
  with pytest.raises(fr.CheckpointError, match="ragged"):
    fr.Table.restore(path, spec=SPEC.replace(signature={
        "tokens": fr.Ragged(41, jnp.int32), "logp": fr.Ragged(40, jnp.float32),
        "reward": jax.ShapeDtypeStruct((), jnp.float32)}))
  # a damaged ragged file is caught by its CRC
  f = [n for n in os.listdir(path) if "ragged" in n and n.endswith(".npy")][0]
  with open(os.path.join(path, f), "r+b") as fh:
    fh.seek(-4, 2)
    fh.write(b"\xff\xff\xff\x7f")
  with pytest.raises(fr.CheckpointError, match="checksum"):
    fr.Table.restore(path)


def test_capacity_growth_moves_ragged_values_and_payloads_with_their_items(tmp_path):
  """A grown Fifo ring is unrolled (items move to new slots, ``checkpoint.migrate``): each
  item keeps its own ragged values and payload (they were attached in the saved slot
  order, so to other items, before the fix)."""
  spec = fr.TableSpec(8, {"tokens": fr.Ragged(6, jnp.int32), "id": np.zeros((), np.int32)})
  t = fr.Table(spec, seed=1, payloads=True)
  for i in range(13):  # 13 items into 8 slots: the ring wrapped (write_pos 5)
    t.insert({"tokens": [np.full(i % 4 + 1, 100 + i, np.int32)], "id": np.array([i], np.int32)},
             payload=[f"p{i}"])
  got = t.peek(8, ragged="packed")
  nine = np.asarray(got.data["id"]) == 9
  t.delete(np.asarray(got.info.slot)[nine], np.asarray(got.info.key)[nine])  # and a hole
  path = str(tmp_path / "c")
  t.save(path, payloads="pickle")
  grown = fr.Table.restore(path, spec=spec.replace(capacity=12), allow_capacity_growth=True,
                           allow_pickle=True)
  s = grown.peek(12, ragged="padded")
  ids = np.asarray(s.data["id"])[np.asarray(s.valid)]
  assert sorted(ids.tolist()) == [5, 6, 7, 8, 10, 11, 12]
  tokens = s.data["tokens"]
  for row, i in enumerate(ids.tolist()):
    assert int(tokens.lengths[row]) == i % 4 + 1, i
    assert np.asarray(tokens.values[row])[:i % 4 + 1].tolist() == [100 + i] * (i % 4 + 1), i
    assert s.payload[row] == f"p{i}", i
