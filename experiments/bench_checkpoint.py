"""Checkpoint save / restore throughput (GB/s) against np.save / np.load of the same bytes.

The table holds ``--items`` items of 524 bytes (obs float32[128], action
int32, reward float32, discount float32), every slot occupied; the state also
carries its per-slot columns and trees (~25 bytes per slot). In every repeat,
round-robin:

* ``funcreplay.checkpoint.save`` (CRC-32 per file, every file fsynced,
  atomic rename, parent fsynced);
* the same with ``fsync=False`` (atomic, safe against process crashes, not
  power loss);
* ``np.save`` of the same arrays, one file each, no fsync (data may still sit
  in the page cache when it returns);
* ``np.save`` + ``fsync`` per file (the same durability as the checkpoint);
* ``funcreplay.checkpoint.restore(as_numpy=True)`` (reads, verifies every
  CRC) against ``np.load`` of the np.save files;
* the same with ``verify=False`` (no CRC pass);
* ``funcreplay.checkpoint.restore`` (the same, then ``jax.device_put``)
  against ``np.load`` + ``jax.device_put``.

Reads come from the page cache (the files were just written), for both.
``os.sync()`` runs before every measurement, so no writer pays for another's
dirty pages. Medians over ``--repeats``.

  python experiments/bench_checkpoint.py --items=1000000 --out=results/bench_checkpoint.json
"""

import functools
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import funcreplay as fr  # noqa: E402
from funcreplay import checkpoint as ck  # noqa: E402
from funcreplay.core import counters as ctr  # noqa: E402
from funcreplay.core import indexes  # noqa: E402

FLAGS = flags.FLAGS
NOTES = []  # filled by run(): the disk and the lock hold, for the benchmark driver


def _define_flags():
  # Only when run as a script: the benchmark driver imports every section into
  # one process, and bench_sharding defines --out / --repeats on the same FLAGS.
  flags.DEFINE_integer("items", 1_000_000, "table capacity (every slot filled)")
  flags.DEFINE_integer("repeats", 5, "round-robin repeats; the median is reported")
  flags.DEFINE_string("dir", "", "directory to write into ('' = a temporary one in $TMPDIR)")
  flags.DEFINE_string("out", "", "JSON output ('' = none)")

ITEM = {"obs": jnp.zeros((128,), jnp.float32), "action": jnp.zeros((), jnp.int32),
        "reward": jnp.zeros((), jnp.float32), "discount": jnp.zeros((), jnp.float32)}


def _state(n: int):
  spec = fr.TableSpec(n, ITEM)
  state = fr.make_table(spec).init()
  rng = np.random.default_rng(0)
  data = {"obs": rng.standard_normal((n, 128), dtype=np.float32),
          "action": rng.integers(0, 18, n, dtype=np.int32),
          "reward": rng.standard_normal(n, dtype=np.float32),
          "discount": np.ones(n, np.float32)}
  state = state.replace(data=jax.device_put(data), occupied=jnp.ones((n,), bool),
                        key=jnp.arange(n, dtype=jnp.uint32), next_key=jnp.uint32(n),
                        counters={**state.counters, "inserts": ctr.from_int(n)})
  # Trees derived from the columns: a consistent state (Table.from_state checks it).
  state = jax.jit(functools.partial(indexes.rebuild, spec))(state)
  return spec, jax.block_until_ready(state)


def _disk(path: str) -> str:
  """'device fstype' of the mount holding ``path``."""
  path = os.path.realpath(path)
  best = ("?", "?", "")
  with open("/proc/mounts") as f:
    for line in f:
      dev, mnt, fs = line.split()[:3]
      if path.startswith(mnt) and len(mnt) >= len(best[2]):
        best = (dev, fs, mnt)
  return f"{best[0]} ({best[1]}, mounted at {best[2]})"


def _np_save(d, arrays, fsync):
  os.mkdir(d)
  for i, a in enumerate(arrays):
    p = os.path.join(d, f"{i:03d}.npy")
    with open(p, "wb") as f:
      np.save(f, a)
      if fsync:
        f.flush()
        os.fsync(f.fileno())


def _np_load(d, n):
  return [np.load(os.path.join(d, f"{i:03d}.npy")) for i in range(n)]


def measure(items: int, repeats: int, directory: str) -> dict:
  spec, state = _state(items)
  arrays = [np.asarray(x) for x in jax.tree_util.tree_leaves(jax.device_get(state))]
  nbytes = sum(a.nbytes for a in arrays)
  times = {k: [] for k in ("fr_save", "fr_save_nofsync", "np_save", "np_save_fsync",
                           "fr_restore_host", "fr_restore_noverify", "np_load", "fr_restore",
                           "np_load_put",
                           "snapshot")}
  table = fr.Table.from_state(spec, state)
  for r in range(repeats):
    paths = {k: os.path.join(directory, f"{k}-{r}") for k in ("fr", "frn", "np", "npf")}

    def timed(key, fn):
      # Start every measurement with no dirty pages: otherwise a writer without
      # fsync pays for the previous one's writeback (the kernel throttles it).
      os.sync()
      t0 = time.perf_counter()
      out = fn()
      jax.block_until_ready(out)
      times[key].append(time.perf_counter() - t0)
      return out

    timed("fr_save", lambda: ck.save(paths["fr"], state, spec))  # noqa: B023
    timed("fr_save_nofsync",
          lambda: ck.save(paths["frn"], state, spec, fsync=False))  # noqa: B023
    timed("np_save", lambda: _np_save(paths["np"], arrays, False))  # noqa: B023
    timed("np_save_fsync", lambda: _np_save(paths["npf"], arrays, True))  # noqa: B023
    timed("fr_restore_host", lambda: ck.restore(paths["fr"], as_numpy=True).state)  # noqa: B023
    timed("fr_restore_noverify",
          lambda: ck.restore(paths["fr"], as_numpy=True, verify=False).state)  # noqa: B023
    loaded = timed("np_load", lambda: _np_load(paths["np"], len(arrays)))  # noqa: B023
    got = timed("fr_restore", lambda: ck.restore(paths["fr"]).state)  # noqa: B023
    timed("np_load_put",
          lambda: jax.device_put(_np_load(paths["np"], len(arrays))))  # noqa: B023
    if r == 0:  # the restore is bit-exact (checked once, outside the timings)
      for a, b in zip(arrays, jax.tree_util.tree_leaves(got), strict=True):
        assert a.tobytes() == np.asarray(b).tobytes()
      assert sum(x.nbytes for x in loaded) == nbytes
    del got, loaded
    # What Table.save holds the lock for: the device-side copy of the state.
    timed("snapshot", table.snapshot)
    for p in paths.values():
      shutil.rmtree(p, ignore_errors=True)
  med = {k: float(np.median(v)) for k, v in times.items()}
  gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
  return dict(items=items, bytes=nbytes, repeats=repeats, seconds=med, gb_per_s=gbs,
              disk=_disk(directory))


def _rows(res: dict) -> list:
  g = res["gb_per_s"]
  case = f"{res['items']:,} x 524 B"
  rows = []
  for op, ours, peer, name in [
      ("save", "fr_save", "np_save", "np.save (no fsync)"),
      ("save", "fr_save", "np_save_fsync", "np.save + fsync"),
      ("save fsync=False", "fr_save_nofsync", "np_save", "np.save (no fsync)"),
      ("restore to host", "fr_restore_host", "np_load", "np.load"),
      ("restore to host verify=False", "fr_restore_noverify", "np_load", "np.load"),
      ("restore to device", "fr_restore", "np_load_put", "np.load + device_put"),
  ]:
    rows.append(dict(section="checkpoint", case=f"{op} {case}", funcreplay=g[ours], peer=g[peer],
                     peer_name=name, unit="GB/s", ratio=g[ours] / g[peer]))
  return rows


def run(small: bool) -> list:
  """The ``checkpoint`` section of ``experiments/benchmark.py`` (GB/s, ratio > 1: faster)."""
  with tempfile.TemporaryDirectory() as d:
    res = measure(100_000 if small else 1_000_000, 3 if small else 5, d)
  NOTES[:] = [_summary(res)]
  return _rows(res)


def _summary(res: dict) -> str:
  s = res["seconds"]
  return (f"checkpoint: {res['bytes'] / 1e9:.3f} GB state on disk {res['disk']}; save = CRC-32 + "
          f"fsync per file + atomic rename; Table.save holds the table lock only for the "
          f"snapshot: {s['snapshot'] * 1e3:.0f} ms of a {s['fr_save']:.2f} s save")


def main(_):
  with tempfile.TemporaryDirectory(dir=FLAGS.dir or None) as d:
    res = measure(FLAGS.items, FLAGS.repeats, d)
  rows = _rows(res)
  print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, disk {res['disk']}, "
        f"{res['bytes'] / 1e9:.3f} GB of state, median of {res['repeats']}")
  print(f"{'case':<46} {'funcreplay':>11} {'peer':>11} {'ratio':>7}  peer")
  for r in rows:
    print(f"{r['case']:<46} {r['funcreplay']:>7.3f} GB/s {r['peer']:>6.3f} GB/s "
          f"{r['ratio']:>7.2f}  {r['peer_name']}")
  print(_summary(res))
  if FLAGS.out:
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out, "w") as f:
      json.dump(dict(jax=jax.__version__, result=res, rows=rows), f, indent=1)
    print(f"wrote {FLAGS.out}")


if __name__ == "__main__":
  _define_flags()
  app.run(main)
