"""Checkpoints: bit-exact round trips, determinism, crash safety, clear errors.

Cheap by construction: tiny capacities, one compiled spec per sampler reused by
every hypothesis example (the host ``Table`` caches its jitted ops per spec),
a handful of examples each.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import funcreplay as fr
from funcreplay import checkpoint as ck
from funcreplay.checkpoint import format as fmt
from funcreplay.checkpoint import spec_codec
from funcreplay.core import counters as ctr

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ITEM = {"obs": jnp.zeros((2,), jnp.float32), "act": jnp.zeros((), jnp.int32)}
CAP = 6

# One (sampler, remover) per sampler, cycling so every remover appears too.
PAIRS = [
    (fr.Uniform(), fr.Fifo()), (fr.Prioritized(0.7), fr.Lifo()), (fr.Fifo(), fr.MinHeap()),
    (fr.Lifo(), fr.MaxHeap()), (fr.MinHeap(), fr.Uniform()), (fr.MaxHeap(), fr.Fifo()),
]


@functools.lru_cache(maxsize=None)
def _spec(i: int) -> fr.TableSpec:
  sampler, remover = PAIRS[i]
  return fr.TableSpec(CAP, ITEM, sampler=sampler, remover=remover, max_times_sampled=3,
                      max_staleness=4, metadata=("task",), rate_limiter=fr.MinSize(1))


def _items(n, start):
  return {"obs": np.arange(start, start + 2 * n, dtype=np.float32).reshape(n, 2),
          "act": np.arange(start, start + n, dtype=np.int32)}


def _leaves(state):
  """Leaves of a host copy of ``state``, item data of free slots zeroed: checkpoints do not
  store those bytes (checkpoint.rows) and nothing reads them."""
  s = jax.device_get(state)
  if not isinstance(s, fr.TableState):  # e.g. a counters dict
    return jax.tree_util.tree_leaves_with_path(s)
  occ = np.asarray(s.occupied, bool)
  s = s.replace(data=jax.tree_util.tree_map(
      lambda x: np.where(occ.reshape(occ.shape + (1,) * (np.ndim(x) - occ.ndim)), x,
                         np.zeros((), np.asarray(x).dtype)), s.data))
  return jax.tree_util.tree_leaves_with_path(s)


def assert_states_equal(a, b):
  """Every leaf: same path, shape, dtype and bytes (item data: of occupied slots)."""
  la, lb = _leaves(a), _leaves(b)
  assert [jax.tree_util.keystr(p) for p, _ in la] == [jax.tree_util.keystr(p) for p, _ in lb]
  for (path, x), (_, y) in zip(la, lb, strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, jax.tree_util.keystr(path)
    assert x.tobytes() == y.tobytes(), f"leaf {jax.tree_util.keystr(path)} differs"


def assert_samples_equal(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- op sequences on host tables ---------------------------------------------------

# (delete is left out: one more compilation per spec; reuse limits make holes anyway.)
OPS = st.lists(st.tuples(st.sampled_from(["insert", "sample", "prio", "meta", "version"]),
                         st.integers(0, 2**16)), min_size=1, max_size=12)


def _apply(table, ops, last):
  """Run ops on ``table``; ``last`` is the latest sample (for slot/key based ops)."""
  for op, arg in ops:
    if op == "insert":
      table.insert(_items(2, arg % 100), priority=np.float32([arg % 7, 1 + arg % 3]),
                   metadata={"task": arg % 3})
    elif op == "sample":
      if table.count() >= 2:
        last = table.sample(2, timeout=0)
    elif op == "prio" and last is not None:
      table.update_priorities(last.info.slot, last.info.key, np.float32([arg % 5, 0.5]))
    elif op == "delete" and last is not None:
      table.delete(last.info.slot[:1], last.info.key[:1])
    elif op == "meta" and last is not None:
      table.set_metadata(last.info.slot, last.info.key, "task", 7)
    elif op == "version":
      table.set_version(table.version + arg % 3)
  return last


@pytest.mark.parametrize("i", range(len(PAIRS)), ids=lambda i: "-".join(
    type(s).__name__ for s in PAIRS[i]))
@settings(max_examples=6)
@given(ops=OPS, seed=st.integers(0, 2**32 - 1))
def test_round_trip_after_random_ops(i, ops, seed):
  spec = _spec(i)
  table = fr.Table(spec, seed=seed)
  table.insert(_items(2, 0))
  last = _apply(table, ops, None)
  with tempfile.TemporaryDirectory() as d:
    path = table.save(os.path.join(d, "c"))
    back = fr.Table.restore(path)
  assert back.spec == spec
  assert_states_equal(table.snapshot(), back.snapshot())
  h1, h2 = table.host_state(), back.host_state()
  assert h1["version"] == h2["version"] and h1["rng"].tobytes() == h2["rng"].tobytes()
  # The same future calls give the same results on both tables.
  more = [("insert", 5), ("sample", 0), ("prio", 1), ("insert", 9), ("sample", 0)]
  _apply(table, more, last)
  _apply(back, more, last)
  if table.count() >= 2:
    assert_samples_equal(table.sample(2, timeout=0), back.sample(2, timeout=0))
  assert_states_equal(table.snapshot(), back.snapshot())


@pytest.mark.parametrize("sampler,remover", list(itertools.product(
    [fr.Uniform(), fr.Prioritized(0.5), fr.Fifo(), fr.Lifo(), fr.MinHeap(), fr.MaxHeap()],
    [fr.Uniform(), fr.Fifo(), fr.Lifo(), fr.MinHeap(), fr.MaxHeap()])),
    ids=lambda s: type(s).__name__)
def test_every_pairing_round_trips_arbitrary_bits(sampler, remover, tmp_path):
  """No compilation: fill every leaf of a pairing's state with random bits."""
  spec = fr.TableSpec(5, {"a": jnp.zeros((3,), jnp.bfloat16), "b": [jnp.zeros((), jnp.uint8)]},
                      sampler=sampler, remover=remover, metadata=("m1", "m2"),
                      rate_limiter=fr.SampleToInsertRatio(2.5, 3, 10.0), default_priority=0.25)
  shapes = jax.eval_shape(fr.make_table(spec).init)
  rng = np.random.default_rng(0)

  def random_bits(s):
    nbytes = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(s.dtype).reshape(s.shape)

  state = jax.tree_util.tree_map(random_bits, shapes)
  path = ck.save(tmp_path / "c", state, spec, extra={"step": 3})
  r = ck.restore(path, as_numpy=True)
  assert r.spec == spec and r.extra == {"step": 3} and r.host is None
  assert_states_equal(state, r.state)
  assert spec_codec.spec_from_json(json.loads(json.dumps(spec_codec.spec_to_json(spec)))) == spec


def test_counters_near_2_pow_32_survive(tmp_path):
  spec = _spec(0)
  state = fr.make_table(spec).init()
  big = {name: ctr.from_int(2**32 - 2) for name in state.counters}
  state = state.replace(counters=big, next_key=jnp.uint32(2**32 - 1),
                        limiter_diff=jnp.int32(2**30 - 1))
  # A synthetic state (counters not matching its size): trusted, not checked.
  a = fr.Table.from_state(spec, state, seed=5, check=False)  # reuses the spec's compiled ops
  a.insert(_items(2, 0), priority=np.float32([1, 2]))
  a.insert(_items(2, 4), priority=np.float32([3, 4]))
  want = a.stats().to_dict()["inserts"]
  assert want == 2**32 + 2
  path = a.save(tmp_path / "c")
  b = fr.Table.restore(path, check=False)
  assert_states_equal(a.snapshot(), b.snapshot())
  st_b = jax.device_get(b.snapshot())
  assert b.stats().to_dict()["inserts"] == want
  assert int(st_b.next_key) == 3  # wrapped past 2**32
  np.testing.assert_array_equal(st_b.key[:4], np.uint32([2**32 - 1, 0, 1, 2]))
  assert int(st_b.limiter_diff) == 2**30  # saturated, as documented
  assert_samples_equal(a.sample(2), b.sample(2))


def test_table_determinism_with_uniform_remover(tmp_path):
  """Inserts split the host key with a Uniform remover: restore continues the stream."""
  spec = _spec(4)  # MinHeap sampler, Uniform remover
  a = fr.Table(spec, seed=11, version=3)
  for k in range(5):
    a.insert(_items(2, 10 * k), priority=np.float32([k, 5 - k]))
  path = ck.save_table(a, tmp_path / "c")
  b = ck.restore_table(path)
  assert b.version == 3
  for k in range(4):
    a.insert(_items(2, 100 + k))
    b.insert(_items(2, 100 + k))
  assert_samples_equal(a.sample(3), b.sample(3))
  assert_states_equal(a.snapshot(), b.snapshot())


# --- crash safety ------------------------------------------------------------------

def _child_env():
  env = dict(os.environ)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _kill_loop(d: str, kills: int, seed: int):
  """Start the saving worker, SIGKILL it at a random moment, check, repeat."""
  rnd = random.Random(seed)
  start = 0
  mid_save = 0  # kills that left a half-written temporary directory behind
  for _ in range(kills):
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "checkpoint_worker.py"), "saves",
                             d, str(start)], stdout=subprocess.PIPE, env=_child_env(), text=True)
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
  spec = _spec(0)
  state = fr.make_table(spec).init()
  ck.save(ck.step_path(tmp_path, 1), state, spec, extra=1)
  # A save killed before its rename, and a step directory without manifest.
  os.mkdir(tmp_path / ".tmp-ckpt-00000002-99999999-0123abcd")
  (tmp_path / ".tmp-ckpt-00000002-99999999-0123abcd" / "000-data.obs.npy").write_bytes(b"xx")
  os.mkdir(tmp_path / "ckpt-00000003")
  assert ck.latest(tmp_path) == str(tmp_path / "ckpt-00000001")
  assert ck.restore(tmp_path).extra == 1


def test_keep_last_and_steps(tmp_path):
  table = fr.Table(_spec(0))
  for k in range(5):
    table.insert(_items(1, k))
    ck.save_table(table, tmp_path, keep_last=2, fsync=k % 2 == 0)
  steps = ck.list_steps(tmp_path)
  assert [s for s, _ in steps] == [3, 4]
  assert fr.Table.restore(tmp_path).size == 5
  with pytest.raises(FileExistsError):
    ck.save_table(table, tmp_path, step=4)
  ck.save_table(table, tmp_path, step=4, overwrite=True)


# --- errors ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  spec = _spec(1)  # Prioritized sampler, Lifo remover: every tree present
  table = fr.Table(spec)
  table.insert(_items(3, 0), priority=np.float32([1, 2, 3]))
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
  spec = _spec(0)
  state = fr.make_table(spec).init()
  with pytest.raises(ValueError, match=r"state.priority is float32\[7\]"):
    ck.save(tmp_path / "a", state.replace(priority=jnp.zeros((7,), jnp.float32)), spec)
  with pytest.raises(TypeError, match="extra must be JSON"):
    ck.save(tmp_path / "b", state, spec, extra=object())
  with pytest.raises(TypeError, match="TableState"):
    ck.save(tmp_path / "c", {"x": 1}, spec)
  assert not os.listdir(tmp_path)  # nothing half-written


def test_failed_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
  spec = _spec(0)
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


# --- capacity growth -----------------------------------------------------------------

def test_capacity_growth_fifo_ring_keeps_order(tmp_path):
  spec = _spec(0)  # Uniform sampler, Fifo remover, capacity 6
  a = fr.Table(spec)
  for k in range(4):  # keys 0..7 into 6 slots: wraps, write_pos = 2
    a.insert(_items(2, 2 * k))
  a.delete([3], [3])  # a hole in the ring (key 3 sat in slot 3)
  path = a.save(tmp_path / "c")
  big = spec.replace(capacity=10)
  with pytest.raises(ck.CheckpointError, match="allow_capacity_growth"):
    fr.Table.restore(path, spec=big)
  b = fr.Table.restore(path, spec=big, allow_capacity_growth=True)
  st_b = jax.device_get(b.snapshot())
  # Ring unrolled from write_pos (oldest-written slot first), the hole kept in place.
  np.testing.assert_array_equal(st_b.occupied, [1, 0, 1, 1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(st_b.key[[0, 2, 3, 4, 5]], [2, 4, 5, 6, 7])
  np.testing.assert_array_equal(fr.stored_items(spec, st_b)["act"][[0, 2, 3, 4, 5]],
                                [2, 4, 5, 6, 7])
  assert int(st_b.write_pos) == 6 and b.size == 5
  assert b.stats().to_dict()["inserts"] == 8 and b.stats().to_dict()["deletes"] == 1
  for k in range(3):  # keys 8..11 fill slots 6..9, key 12 evicts the oldest (2), 13 the hole
    b.insert(_items(2, 100 + 2 * k))
  st_b = jax.device_get(b.snapshot())
  assert sorted(st_b.key[st_b.occupied].tolist()) == list(range(4, 14))
  assert int(st_b.occ_tree[1]) == 10 and b.stats().to_dict()["evicted_capacity"] == 3


@pytest.mark.parametrize("i", [1, 2], ids=["Prioritized-Lifo", "Fifo-MinHeap"])
def test_capacity_growth_rebuilds_trees(i, tmp_path):
  spec = _spec(i)
  a = fr.Table(spec)
  for k in range(4):
    a.insert(_items(2, 10 * k), priority=np.float32([k + 1, 5 - k]))
  path = a.save(tmp_path / "c")
  big = spec.replace(capacity=11)
  r = ck.restore(path, big, allow_capacity_growth=True, as_numpy=True)
  s, old = r.state, jax.device_get(a.snapshot())
  assert_states_equal(old.counters, s.counters)
  np.testing.assert_array_equal(s.key[:CAP], old.key)  # these removers keep slots
  np.testing.assert_array_equal(s.occupied, np.r_[old.occupied, np.zeros(5, bool)])
  p = big.tree_size
  assert s.occ_tree.shape == (2 * p,) and p == 16
  np.testing.assert_array_equal(s.occ_tree[p:], np.r_[s.occupied, np.zeros(5, bool)])
  np.testing.assert_array_equal(s.occ_tree[1:p], s.occ_tree[2:2 * p:2] + s.occ_tree[3:2 * p:2])
  age = (s.next_key - s.key).astype(np.int64)
  occ = np.flatnonzero(s.occupied)
  if i == 1:  # Prioritized(0.7) sampler, Lifo remover: victim = newest item
    w = np.where(s.occupied, np.power(s.priority, 0.7, dtype=np.float32), 0)
    np.testing.assert_allclose(s.weight_tree[p:p + 11], w, rtol=1e-6)
    np.testing.assert_allclose(s.weight_tree[1], w.sum(), rtol=1e-5)
    assert s.remover_tree[1] == occ[np.argmin(age[occ])]
  else:  # MinHeap remover: lowest priority, ties oldest first
    best = min(occ, key=lambda j: (s.priority[j], -age[j]))
    assert s.remover_tree[1] == best


# --- host table: concurrency, periodic checkpoints ------------------------------------------

@pytest.mark.timeout(30)
def test_save_does_not_hold_the_lock_while_writing(tmp_path, monkeypatch):
  table = fr.Table(_spec(0))
  table.insert(_items(4, 0))
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
  table.insert(_items(2, 50), timeout=1)  # the save is writing: the table keeps serving
  assert table.sample(2, timeout=1).valid.all()
  release.set()
  saver.join(10)
  assert fr.Table.restore(tmp_path / "c").size == 4  # the snapshot, not the later insert


@pytest.mark.timeout(30)
def test_periodic_checkpointer(tmp_path):
  table = fr.Table(_spec(0))
  with ck.PeriodicCheckpointer(table, tmp_path, every_inserts=4, keep_last=2) as pc:
    for k in range(6):
      table.insert(_items(2, k))
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


@pytest.mark.timeout(30)
def test_periodic_checkpointer_reraises_errors(tmp_path, monkeypatch):
  table = fr.Table(_spec(0))
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


# --- sharded ---------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_sharded_round_trip_on_4_devices(tmp_path):
  env = _child_env()
  env["XLA_FLAGS"] = ("--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 "
                      "--xla_llvm_disable_expensive_passes=true")
  out = subprocess.run([sys.executable, os.path.join(HERE, "checkpoint_worker.py"), "sharded",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=140)
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.strip().splitlines()[-1])
  assert res["devices"] == 4 and res["num_shards"] == 4
  assert res["leaves_equal"] and res["sharded_ok"] and res["same_sample"]
  assert res["numpy_shape"] == [4, 4] and res["grown_shape"] == [4, 8]
  assert res["size"] == res["grown_size"] > 0
  assert "pass mesh=" in res["errors"]["no_mesh"]
  assert "4 shards but mesh axis 'data' has 2" in res["errors"]["wrong_mesh"]
  assert "cannot become a host Table" in res["errors"]["host_table"]
