"""Checkpoints under faults: SIGKILL during saves, incomplete and corrupted files, clear
errors for bad input, failed writes, and the host table's saves and periodic checkpointer.
"""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import checkpoint as ck
from funcreplay.checkpoint import format as fmt
from funcreplay.core import counters as ctr
from tests.checkpoint.common import (
  CAP,
  HERE,
  assert_states_equal,
  child_env,
  items,
  pairing_spec,
)

# --- crash safety ------------------------------------------------------------------

def _kill_loop(d: str, kills: int, seed: int):
  """Start the saving worker, SIGKILL it at a random moment, check, repeat."""
  rnd = random.Random(seed)
  start = 0
  mid_save = 0  # kills that left a half-written temporary directory behind
  for _ in range(kills):
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "checkpoint_worker.py"), "saves",
                             d, str(start)], stdout=subprocess.PIPE, env=child_env(), text=True)
    try:
      line = proc.stdout.readline()  # the first save of this run is complete
      assert line.startswith("saved"), line
      time.sleep(rnd.uniform(0.0, 0.3))
      proc.send_signal(signal.SIGKILL)
    finally:
      proc.kill()
      proc.wait(10)
      proc.stdout.close()
    mid_save += any(n.startswith(".tmp-") for n in os.listdir(d))
    newest = ck.latest(d)
    assert newest is not None
    r = ck.restore(d, as_numpy=True)  # the newest complete one, fully verified
    assert r.path == newest
    step = int(os.path.basename(newest).split("-")[1])
    assert step >= start
    assert np.all(r.state.data["x"] == step) and int(r.state.next_key) == step
    # Every listed checkpoint is complete and verifies.
    for s, p in ck.list_steps(d):
      assert np.all(ck.restore(p, as_numpy=True).state.data["x"] == s)
    start = step + 1
  # Leftovers of killed saves are ignored by discovery and removed by prune.
  ck.prune(d, keep_last=1)
  assert [n for n in os.listdir(d) if n.startswith((".tmp-", ".trash-"))] == []
  return mid_save


@pytest.mark.timeout(60)
def test_sigkill_during_saves_leaves_latest_good_checkpoint(tmp_path):
  _kill_loop(str(tmp_path), kills=2, seed=1234)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sigkill_soak(tmp_path):
  assert _kill_loop(str(tmp_path), kills=25, seed=99) > 0  # some kills did hit a save


def test_incomplete_checkpoints_are_skipped(tmp_path):
  spec = pairing_spec(0)
  state = fr.make_table(spec).init()
  ck.save(ck.step_path(tmp_path, 1), state, spec, extra=1)
  # A save killed before its rename, and a step directory without manifest.
  os.mkdir(tmp_path / ".tmp-ckpt-00000002-99999999-0123abcd")
  (tmp_path / ".tmp-ckpt-00000002-99999999-0123abcd" / "000-data.obs.npy").write_bytes(b"xx")
  os.mkdir(tmp_path / "ckpt-00000003")
  assert ck.latest(tmp_path) == str(tmp_path / "ckpt-00000001")
  assert ck.restore(tmp_path).extra == 1


def test_keep_last_and_steps(tmp_path):
  table = fr.Table(pairing_spec(0))
  for k in range(5):
    table.insert(items(1, k))
    ck.save_table(table, tmp_path, keep_last=2, fsync=k % 2 == 0)
  steps = ck.list_steps(tmp_path)
  assert [s for s, _ in steps] == [3, 4]
  assert fr.Table.restore(tmp_path).size == 5
  with pytest.raises(FileExistsError):
    ck.save_table(table, tmp_path, step=4)
  ck.save_table(table, tmp_path, step=4, overwrite=True)
  # A step older than the newest keep_last would be pruned as soon as written: refused,
  # nothing written or deleted (it used to return the path it had just deleted).
  with pytest.raises(ValueError, match="would delete this one at once"):
    ck.save_table(table, tmp_path, step=1, keep_last=2)
  assert [s for s, _ in ck.list_steps(tmp_path)] == [3, 4]
  ck.save_table(table, tmp_path, step=2, keep_last=3)  # kept: 2, 3, 4
  assert [s for s, _ in ck.list_steps(tmp_path)] == [2, 3, 4]


# --- errors ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  spec = pairing_spec(1)  # Prioritized sampler, Lifo remover: every tree present
  table = fr.Table(spec)
  table.insert(items(3, 0), priority=np.float32([1, 2, 3]))
  return spec, table.save(tmp_path_factory.mktemp("saved") / "good")


def _copy(path, tmp_path):
  import shutil  # noqa: PLC0415
  return shutil.copytree(path, tmp_path / "c")


def _file(path, leaf):
  m = fmt.read_manifest(path)
  return os.path.join(path, next(e["file"] for e in m["arrays"] if e["leaf"] == leaf))


def test_truncated_file_is_named(saved, tmp_path):
  p = _copy(saved[1], tmp_path)
  f = _file(p, ".data['obs']")
  with open(f, "r+b") as fh:
    fh.truncate(os.path.getsize(f) - 5)
  with pytest.raises(ck.CheckpointError, match="data.obs.npy.*truncated"):
    fr.Table.restore(p)
  with pytest.raises(ck.CheckpointError, match="data.obs.npy.*truncated"):
    fr.Table.restore(p, verify=False)  # lengths are checked even without checksums


def test_corrupted_byte_fails_checksum(saved, tmp_path):
  p = _copy(saved[1], tmp_path)
  f = _file(p, ".priority")
  raw = bytearray(open(f, "rb").read())
  raw[-2] ^= 0x10
  open(f, "wb").write(bytes(raw))
  with pytest.raises(ck.CheckpointError, match="priority.npy: checksum mismatch"):
    ck.restore(p)
  r = ck.restore(p, verify=False, as_numpy=True)  # explicitly unchecked: loads the bad bits
  assert r.state.priority.tobytes() != ck.restore(saved[1], as_numpy=True).state.priority.tobytes()


def test_missing_file_and_bad_manifest(saved, tmp_path):
  p = _copy(saved[1], tmp_path)
  os.remove(_file(p, ".weight_tree"))
  with pytest.raises(ck.CheckpointError, match="weight_tree.npy: file missing"):
    ck.restore(p)
  m = os.path.join(p, "manifest.json")
  text = open(m).read()
  open(m, "w").write(text[: len(text) // 2])
  with pytest.raises(ck.CheckpointError, match="manifest.json: cannot read the manifest"):
    ck.restore(p)
  os.remove(m)
  with pytest.raises(ck.CheckpointError, match="no manifest.json"):
    ck.restore(p)
  with pytest.raises(ck.CheckpointError, match="does not exist"):
    ck.restore(tmp_path / "nothing-here")
  assert issubclass(ck.CheckpointError, ValueError)


def test_header_rewritten_with_other_shape(saved, tmp_path):
  p = _copy(saved[1], tmp_path)
  np.save(_file(p, ".version"), np.zeros((CAP + 1,), np.int32))
  with pytest.raises(ck.CheckpointError, match=r"version.npy: holds int32\[7\]"):
    ck.restore(p)


def test_damaged_array_headers_are_named(saved, tmp_path):
  """Any flipped bit in a file's ``.npy`` header, and a header claiming a huge shape, give
  a ``CheckpointError`` naming the file (numpy's parser raised ``tokenize.TokenError`` or
  ``SyntaxError``, and the huge shape was allocated first: terabytes; found by a review)."""
  p = _copy(saved[1], tmp_path)
  f = _file(p, ".version")
  good = open(f, "rb").read()
  header = good.index(b"\n") + 1
  for at in range(8, header - 1):
    for bit in (0x01, 0x04, 0x40):
      bad = bytearray(good)
      bad[at] ^= bit
      open(f, "wb").write(bytes(bad))
      try:
        got = ck.restore(p, as_numpy=True)
      except ck.CheckpointError as e:
        assert "version.npy" in str(e), str(e)
        continue
      # A flip that leaves an equivalent header (spaces, quotes) loads the same data.
      np.testing.assert_array_equal(got.state.version,
                                    ck.restore(saved[1], as_numpy=True).state.version)
  huge = io.BytesIO()
  np.lib.format.write_array_header_1_0(huge, {"descr": "<i4", "fortran_order": False,
                                              "shape": (2**40,)})
  open(f, "wb").write(huge.getvalue() + good[header:])
  with pytest.raises(ck.CheckpointError, match=r"version.npy: holds int32\[1099511627776\]"):
    ck.restore(p)


@pytest.mark.parametrize("change,message", [
    (dict(capacity=CAP - 1), "capacity: checkpoint 6, spec 5 .*shrinking"),
    (dict(capacity=CAP + 2), "capacity: checkpoint 6, spec 8 .*allow_capacity_growth"),
    (dict(signature={"obs": jnp.zeros((3,), jnp.float32), "act": jnp.zeros((), jnp.int32)}),
     r"signature leaf \['obs'\]: checkpoint float32\[2\], spec float32\[3\]"),
    (dict(signature={"obs": jnp.zeros((2,), jnp.float32), "act": jnp.zeros((), jnp.uint8)}),
     r"signature leaf \['act'\]: checkpoint int32\[\], spec uint8\[\]"),
    (dict(sampler=fr.Uniform()), "sampler: checkpoint .*Prioritized.*spec .*Uniform"),
    (dict(sampler=fr.Prioritized(0.6)), "priority_exponent': 0.7.*0.6"),
    (dict(remover=fr.Fifo()), "remover: checkpoint .*Lifo"),
    (dict(metadata=("task", "other")), "metadata: checkpoint"),
    (dict(max_times_sampled=0), "max_times_sampled: checkpoint 3, spec 0"),
    (dict(rate_limiter=fr.MinSize(2)), "rate_limiter"),
])
def test_mismatched_spec_names_the_difference(saved, change, message):
  spec, path = saved
  with pytest.raises(ck.CheckpointError, match=message):
    ck.restore(path, spec.replace(**change))


def test_bad_save_arguments(tmp_path):
  spec = pairing_spec(0)
  state = fr.make_table(spec).init()
  with pytest.raises(ValueError, match=r"state.key is uint32\[7\]"):
    ck.save(tmp_path / "a", state.replace(item_info=jnp.zeros((7, 4), jnp.uint32)), spec)
  with pytest.raises(TypeError, match="extra must be JSON"):
    ck.save(tmp_path / "b", state, spec, extra=object())
  with pytest.raises(TypeError, match="TableState"):
    ck.save(tmp_path / "c", {"x": 1}, spec)
  assert not os.listdir(tmp_path)  # nothing half-written


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
  spec = pairing_spec(0)
  state = fr.make_table(spec).init()
  ck.save(tmp_path / "c", state, spec, extra="old")
  real = fmt._write_one

  def disk_full(dirpath, file, *rest):
    if "priority" in file:
      raise OSError("disk full (test)")
    return real(dirpath, file, *rest)

  monkeypatch.setattr(fmt, "_write_one", disk_full)
  with pytest.raises(OSError, match="disk full"):
    ck.save(tmp_path / "c", state, spec, extra="new", overwrite=True)
  assert os.listdir(tmp_path) == ["c"]  # no temporary directory left behind
  assert ck.restore(tmp_path / "c").extra == "old"


def test_unsharded_checkpoint_refuses_a_mesh(saved):
  mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
  with pytest.raises(ck.CheckpointError, match="an unsharded checkpoint; restore it without mesh"):
    ck.restore(saved[1], mesh=mesh)


def test_opaque_signature_needs_spec(tmp_path):
  import collections  # noqa: PLC0415
  item_t = collections.namedtuple("Item", "obs")
  spec = fr.TableSpec(4, item_t(jnp.zeros((2,), jnp.float32)))
  state = fr.make_table(spec).init()
  path = ck.save(tmp_path / "c", state, spec)
  with pytest.raises(ck.CheckpointError, match="pass spec="):
    ck.restore(path)
  assert_states_equal(state, ck.restore(path, spec).state)


# --- host table: concurrency, periodic checkpoints ------------------------------------------

@pytest.mark.timeout(30)
def test_save_does_not_hold_the_lock_while_writing(tmp_path, monkeypatch):
  table = fr.Table(pairing_spec(0))
  table.insert(items(4, 0))
  writing, release = threading.Event(), threading.Event()
  real = fmt._write_one

  def slow(*args):
    writing.set()
    release.wait(10)
    return real(*args)

  monkeypatch.setattr(fmt, "_write_one", slow)
  saver = threading.Thread(target=lambda: table.save(tmp_path / "c"))
  saver.start()
  assert writing.wait(10)
  table.insert(items(2, 50), timeout=1)  # the save is writing: the table keeps serving
  assert table.sample(2, timeout=1).valid.all()
  release.set()
  saver.join(10)
  assert fr.Table.restore(tmp_path / "c").size == 4  # the snapshot, not the later insert


@pytest.mark.timeout(30)
def test_periodic_checkpointer(tmp_path):
  table = fr.Table(pairing_spec(0))
  with ck.PeriodicCheckpointer(table, tmp_path, every_inserts=4, keep_last=2) as pc:
    for k in range(6):
      table.insert(items(2, k))
      deadline = time.monotonic() + 5
      while len(pc.saved) < (k + 1) // 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pc.saved) >= 3
  assert not pc.running
  assert len(ck.list_steps(tmp_path)) == 2
  r = ck.restore(tmp_path, as_numpy=True)
  assert ctr.to_int(r.state.counters["inserts"]) % 4 == 0
  with ck.PeriodicCheckpointer(table, tmp_path, every_s=0.05, keep_last=5, fsync=False) as pc2:
    deadline = time.monotonic() + 5
    while len(pc2.saved) < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
  assert len(pc2.saved) >= 2
  # Steps continue after the existing ones.
  assert int(os.path.basename(pc2.saved[0]).split("-")[1]) > int(
      os.path.basename(pc.saved[-1]).split("-")[1])


@pytest.mark.timeout(60)
def test_periodic_checkpointer_counts_inserts_from_a_loaded_older_checkpoint(tmp_path):
  """table.load of an older checkpoint moves the inserts counter back; the checkpointer
  counts from there (it saved nothing until the counter passed its old mark)."""
  table = fr.Table(pairing_spec(0))
  table.insert(items(2, 0))
  early = table.save(tmp_path / "early")
  with ck.PeriodicCheckpointer(table, tmp_path / "periodic", every_inserts=8) as pc:
    for k in range(8):  # 16 inserts: ~2 saves
      table.insert(items(2, 10 + 2 * k))
    deadline = time.monotonic() + 10
    while len(pc.saved) < 2 and time.monotonic() < deadline:
      time.sleep(0.01)
    before = len(pc.saved)
    table.load(early)  # inserts 16 -> 2
    time.sleep(0.1)
    for k in range(4):  # 8 inserts from the loaded count: one more save
      table.insert(items(2, 50 + 2 * k))
    deadline = time.monotonic() + 10
    while len(pc.saved) == before and time.monotonic() < deadline:
      time.sleep(0.01)
    assert len(pc.saved) == before + 1


@pytest.mark.timeout(30)
def test_periodic_checkpointer_reraises_errors(tmp_path, monkeypatch):
  table = fr.Table(pairing_spec(0))
  from funcreplay.checkpoint import periodic  # noqa: PLC0415

  def broken(*a, **k):
    raise OSError("disk full (test)")

  monkeypatch.setattr(periodic.host_lib, "save_table", broken)
  pc = ck.PeriodicCheckpointer(table, tmp_path, every_s=0.01)
  deadline = time.monotonic() + 5
  while pc.running and time.monotonic() < deadline:
    time.sleep(0.01)
  with pytest.raises(OSError, match="disk full"):
    pc.close()
  with pytest.raises(ValueError, match="every_s"):
    ck.PeriodicCheckpointer(table, tmp_path)




def test_overwrite_replaces_only_a_checkpoint(tmp_path):
  """``overwrite=True`` replaced any directory at ``path``: a user's own files, or a
  directory of checkpoints given where one checkpoint was meant (found by a review)."""
  t = fr.Table(pairing_spec(0))
  t.insert(items(3, 0))
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep me")
  with pytest.raises(FileExistsError, match="is not a checkpoint .*replaces only a checkpoint"):
    t.save(str(mine), overwrite=True)
  assert (mine / "notes.txt").read_text() == "keep me" and len(os.listdir(mine)) == 1
  many = tmp_path / "many"
  for _ in range(2):
    t.save(str(many), keep_last=3)
  with pytest.raises(FileExistsError, match="is not a checkpoint"):
    t.save(str(many), overwrite=True)
  assert [s for s, _ in ck.list_steps(str(many))] == [0, 1]
  t.save(str(many / "ckpt-00000001"), overwrite=True)   # a checkpoint: replaced
  assert [s for s, _ in ck.list_steps(str(many))] == [0, 1]
  assert not [n for n in os.listdir(tmp_path) if n.startswith((".tmp-", ".trash-"))]


@pytest.mark.timeout(120)
def test_concurrent_saves_never_replace_each_other(tmp_path):
  """Two saves of one path with ``overwrite=False``: one wins, the other raises
  ``FileExistsError`` (both succeeded, the second replacing the first); into a directory
  of checkpoints, both find a step of their own. A ``PeriodicCheckpointer`` goes on after
  a manual save into its directory (it collided with its own step count and stopped)."""
  tables = []
  for k in range(2):
    t = fr.Table(pairing_spec(0))
    t.insert(items(2 + k, 10 * k))
    tables.append(t)
  for r in range(8):
    path = str(tmp_path / f"race{r}")
    got = {}
    barrier = threading.Barrier(2)

    def save(k, path=path, got=got, barrier=barrier):
      barrier.wait()
      try:
        tables[k].save(path)
        got[k] = "saved"
      except FileExistsError:
        got[k] = "refused"

    ths = [threading.Thread(target=save, args=(k,)) for k in range(2)]
    for th in ths:
      th.start()
    for th in ths:
      th.join(60)
    assert sorted(got.values()) == ["refused", "saved"], got
    winner = next(k for k, v in got.items() if v == "saved")
    assert fr.Table.restore(path).size == tables[winner].size
  many = str(tmp_path / "many")
  ths = [threading.Thread(target=lambda k=k: tables[k].save(many, keep_last=10))
         for k in range(2) for _ in range(3)]
  for th in ths:
    th.start()
  for th in ths:
    th.join(60)
  assert [s for s, _ in ck.list_steps(many)] == list(range(6))
  periodic = str(tmp_path / "periodic")
  with ck.PeriodicCheckpointer(tables[0], periodic, every_s=0.05, keep_last=5) as pc:
    deadline = time.monotonic() + 30
    while not ck.list_steps(periodic):
      assert time.monotonic() < deadline
      time.sleep(0.01)
    tables[0].save(periodic, keep_last=5)              # a manual save takes the next step
    n = len(pc.saved)
    while len(pc.saved) < n + 2:
      assert pc.running and time.monotonic() < deadline, pc.check()
      time.sleep(0.01)
  for t in tables:
    t.close()
