"""Checkpoints a user can keep (issue 23, item 14): only occupied rows on disk, and
``Table.load(path)`` restoring into a live table."""

from __future__ import annotations

import json
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import checkpoint as ck
from funcreplay.checkpoint import format as fmt

ROW = 1024  # int32 per item: 4 KiB rows, so the item data dominates the bytes on disk
CAP = 64


def _spec(**kw):
  kw = {"sampler": fr.Prioritized(0.8), "remover": fr.Fifo(), "max_times_sampled": 2,
        "metadata": ("task",), "rate_limiter": fr.MinSize(1), **kw}
  return fr.TableSpec(CAP, {"x": jnp.zeros((ROW,), jnp.int32), "r": jnp.zeros((), jnp.float32)},
                      **kw)


def _fill(t: fr.Table, n: int, start: int = 0):
  t.insert({"x": np.repeat(np.arange(start, start + n, dtype=np.int32)[:, None], ROW, 1),
            "r": np.arange(start, start + n, dtype=np.float32) / 3},
           priority=np.linspace(0.1, 3, n).astype(np.float32), metadata={"task": start % 5})


def _disk_bytes(path) -> int:
  return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _masked(state):
  """Host copy of ``state`` with the item data of free slots zeroed (never observable)."""
  s = jax.device_get(state)
  occ = np.asarray(s.occupied)
  return s.replace(data=jax.tree_util.tree_map(
      lambda x: np.where(occ.reshape(occ.shape + (1,) * (x.ndim - 1)), x, 0), s.data))


def _assert_same(a, b):
  la, lb = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
  for (path, x), (_, y) in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), \
        jax.tree_util.keystr(path)


def test_half_full_table_stores_only_occupied_rows(tmp_path):
  t = fr.Table(_spec(), seed=1)
  _fill(t, CAP // 2)
  path = t.save(tmp_path / "c")
  full_data = CAP * (ROW * 4 + 4)
  on_disk = _disk_bytes(path)
  assert on_disk < 0.5 * full_data + 16_384, (on_disk, full_data)  # half the rows + columns
  m = fmt.read_manifest(path)
  assert m["schema_version"] == fmt.SCHEMA_VERSION == 2
  assert m["rows"]["count"] == CAP // 2
  # A full table stores its rows as they are (no gather).
  _fill(t, CAP // 2, start=100)
  full = t.save(tmp_path / "full")
  assert fmt.read_manifest(full)["rows"] is None


@pytest.mark.parametrize("remover", [fr.Fifo(), fr.MinHeap()])
def test_round_trip_with_holes_is_exact_where_observable(tmp_path, remover):
  t = fr.Table(_spec(remover=remover), seed=4, version=2)
  _fill(t, 40)
  for k in range(6):  # reuse limit 2 and deletes leave holes with stale data behind
    s = t.sample(8)
    t.update_priorities(s.info.slot, s.info.key, np.full(8, 0.5 + k, np.float32))
  s = t.sample(2)
  t.delete(s.info.slot[:1], s.info.key[:1])
  _fill(t, 5, start=200)
  before = t.snapshot()
  assert 0 < int(np.asarray(before.occupied).sum()) < CAP
  path = t.save(tmp_path / "c")
  u = fr.Table.restore(path)
  _assert_same(_masked(u.snapshot()), _masked(before))  # trees, ledger, columns: every bit
  for _ in range(3):
    a, b = t.sample(5), u.sample(5)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_row_count_disagreeing_with_occupancy_is_an_error(tmp_path):
  t = fr.Table(_spec(), seed=1)
  _fill(t, 10)
  path = t.save(tmp_path / "c")
  m = fmt.read_manifest(path)
  e = next(e for e in m["arrays"] if e["leaf"] == ".occupied")
  occ = np.load(os.path.join(path, e["file"]))
  occ[20] = True  # one more occupied slot than rows stored; checksums made consistent
  np.save(os.path.join(path, e["file"]), occ)
  e["crc32"] = fmt.crc32_segments(occ)
  m[fmt.MANIFEST_CRC] = fmt.manifest_crc32(m)
  with open(os.path.join(path, fmt.MANIFEST), "w", encoding="utf-8") as f:
    json.dump(m, f)
  with pytest.raises(ck.CheckpointError, match=r"10 rows .* 11 occupied slots"):
    ck.restore(path)


# --- Table.load: restore into a live table ------------------------------------------------

def test_load_into_live_table_keeps_samplers_and_ingestors(tmp_path):
  src = fr.Table(_spec(), seed=5, version=7)
  _fill(src, 12)
  path = src.save(tmp_path / "c")
  want = src.sample(3)
  src_after = src.snapshot()

  t = fr.Table(_spec(), seed=99)
  got = {}
  waiter = threading.Thread(target=lambda: got.update(s=t.sample(3, timeout=30)))
  waiter.start()  # blocks: the empty table is below MinSize(1)
  ing = t.ingestor()
  t.load(path)
  waiter.join(30)
  assert not waiter.is_alive() and int(np.asarray(got["s"].valid).sum()) == 3  # woken, served
  assert t.version == 7 and t.size == 12
  # The waiter took the sample the saved table would have given next: same key, same rows.
  for x, y in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got["s"]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  _assert_same(_masked(t.snapshot()), _masked(src_after))
  with ing:  # the ingestor attached before the load feeds the loaded table
    ing.put({"x": np.zeros((ROW,), np.int32), "r": np.float32(1)}, priority=1.0,
            metadata={"task": 1})
  assert t.size == 13


def test_load_with_another_spec_is_refused_and_table_intact(tmp_path):
  src = fr.Table(_spec(), seed=5)
  _fill(src, 4)
  path = src.save(tmp_path / "c")
  t = fr.Table(_spec(max_times_sampled=3), seed=1)
  _fill(t, 2, start=50)
  before = t.snapshot()
  with pytest.raises(ck.CheckpointError, match="max_times_sampled: checkpoint 2, spec 3"):
    t.load(path)
  _assert_same(t.snapshot(), before)
  with pytest.raises(ck.CheckpointError, match="does not exist"):
    t.load(tmp_path / "missing")
  t.close()
  with pytest.raises(fr.TableClosedError):
    t.load(path)
