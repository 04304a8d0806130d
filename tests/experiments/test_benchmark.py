"""The benchmark driver (experiments/benchmark.py) and the core section, at toy sizes.

The driver must keep going when a section is missing, cannot import an
optional peer, or fails; it must then exit non-zero, and still write the
JSON and the table. The core section must produce well-formed rows.
"""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENTS = os.path.join(ROOT, "experiments")
sys.path.insert(0, EXPERIMENTS)

import benchmark  # noqa: E402

ROW = dict(section="fake", case="insert b1", funcreplay=200.0, peer=100.0, peer_name="numpy",
           unit="items/s", ratio=2.0)


def _module(name, run):
  m = types.ModuleType(name)
  m.run = run
  return m


def _loader(modules):
  """An importer over a dict: ``None`` = optional peer missing, absent = no module."""
  def load(name):
    if name not in modules:
      raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    if modules[name] is None:
      raise ModuleNotFoundError("No module named 'somepeer'", name="somepeer")
    return modules[name]
  return load


def _boom(small):
  raise RuntimeError("section exploded")


@pytest.mark.timeout(60)
def test_driver_runs_every_section_and_fails_at_the_end(tmp_path, capsys):
  calls = []

  def ok(small):
    calls.append(small)
    return [dict(ROW)]

  out = tmp_path / "sub" / "bench.json"
  mods = {"bench_bad": _module("bench_bad", _boom), "bench_ok": _module("bench_ok", ok),
          "bench_optional": None}
  code = benchmark.drive(["bad", "ok", "optional", "missing"], small=True, out=str(out),
                         loader=_loader(mods))
  assert code == 1
  assert calls == [True]  # the section after the failing one still ran, with small=True
  report = json.loads(out.read_text())
  sec = report["sections"]
  assert sec["bad"]["status"] == "error" and "section exploded" in sec["bad"]["error"]
  assert sec["ok"]["status"] == "ok"
  assert sec["optional"]["status"] == "skipped" and "somepeer" in sec["optional"]["reason"]
  assert sec["missing"]["status"] == "skipped"
  assert "bench_missing.py" in sec["missing"]["reason"]
  assert report["rows"] == [ROW]
  assert report["small"] is True
  m = report["machine"]
  assert m["cores"] >= 1 and m["devices"] and m["versions"]["jax"] and m["cpu"]
  text = capsys.readouterr().out
  assert "| section | case | funcreplay | peer | peer_name | unit | ratio |" in text
  assert "| fake | insert b1 | 200 | 100 | numpy | items/s | 2.00x |" in text
  assert "FAILED section bad" in text and "skipped section missing" in text


@pytest.mark.timeout(60)
def test_driver_all_ok_exits_zero_and_rejects_malformed_rows(tmp_path):
  good = _module("bench_good", lambda small: [dict(ROW)])
  assert benchmark.drive(["good"], small=False, out=None, loader=_loader({"bench_good": good})) == 0
  for bad_row in (dict(ROW, ratio=float("nan")), {k: v for k, v in ROW.items() if k != "unit"},
                  dict(ROW, peer="fast")):
    mod = _module("bench_x", lambda small, r=bad_row: [r])
    res = benchmark.run_section("x", True, _loader({"bench_x": mod}))
    assert res["status"] == "error", bad_row
    assert res["rows"] == []
  res = benchmark.run_section("x", True, _loader({"bench_x": _module("bench_x", lambda s: {})}))
  assert res["status"] == "error" and "list" in res["error"]


def test_sections_may_define_the_same_absl_flags():
  from absl import flags

  def load(name):  # like a section module defining --out at import
    flags.DEFINE_string("bench_test_out", name, "a section's own flag")
    return _module(name, lambda small: [dict(ROW, case=flags.FLAGS["bench_test_out"].value)])

  for name in ("one", "two"):
    res = benchmark.run_section(name, True, load)
    assert res["status"] == "ok", res.get("error")
    assert res["rows"][0]["case"] == f"bench_{name}"
  assert "bench_test_out" not in flags.FLAGS


@pytest.mark.timeout(120)
def test_driver_command_line_with_section_files(tmp_path):
  """The real script and importer: section files found on PYTHONPATH."""
  (tmp_path / "bench_fine.py").write_text(textwrap.dedent(f"""
      NOTES = ["a note"]
      def run(small):
        return [{ROW!r}]
  """))
  (tmp_path / "bench_boom.py").write_text("def run(small):\n  raise ValueError('kaputt')\n")
  (tmp_path / "bench_nopeer.py").write_text("import not_a_real_peer_pkg_xyz\n")
  out = tmp_path / "r.json"
  env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, os.path.join(EXPERIMENTS, "benchmark.py"),
       "--sections=boom,fine,nopeer,absent", "--small", f"--out={out}",
       f"--plot={tmp_path / 'plot.png'}"],
      capture_output=True, text=True, env=env, timeout=110)
  assert proc.returncode == 1, proc.stderr[-2000:]
  report = json.loads(out.read_text())
  sec = report["sections"]
  assert [sec[k]["status"] for k in ("boom", "fine", "nopeer", "absent")] == \
      ["error", "ok", "skipped", "skipped"]
  assert "kaputt" in sec["boom"]["error"]
  assert "not_a_real_peer_pkg_xyz" in sec["nopeer"]["reason"]
  assert sec["fine"]["notes"] == ["a note"]
  assert report["rows"] == [ROW]
  assert "| fake | insert b1 |" in proc.stdout
  assert (tmp_path / "plot.png").stat().st_size > 1000


@pytest.mark.timeout(180)
def test_core_section_tiny_rows_are_well_formed():
  import bench_core
  rows = bench_core.run(True, sizes=bench_core.TINY, peers=("flashbax", "numpy"))
  cases = {r["case"] for r in rows}
  tiny = bench_core.TINY
  for b in tiny.insert_batches:
    assert f"insert b{b}" in cases
  assert any(c.startswith("sample b8 (ours: no repl.") for c in cases)
  assert any(c.startswith("lax.scan insert") for c in cases)
  assert "insert b1 in lax.scan (per item)" in cases
  assert any(c.startswith("prioritized sample+update b8") for c in cases)
  assert {r["peer_name"].split()[0] for r in rows} == {"flashbax", "numpy"}
  for r in rows:
    assert set(benchmark.ROW_KEYS) <= set(r)
    assert r["section"] == "core" and r["unit"] in ("items/s", "steps/s")
    for k in ("funcreplay", "peer", "ratio"):
      assert math.isfinite(r[k]) and r[k] > 0, r
    assert r["ratio"] == pytest.approx(r["funcreplay"] / r["peer"])
  assert any("without replacement" in n for n in bench_core.NOTES)
  with pytest.raises(ValueError, match="multiple of fill_chunk"):
    bench_core.run(True, sizes=bench_core.Sizes(1000, (1,), (8,), (8,), 2, 1, 8, 300, 0.001, 1))


def test_numpy_ring_reference_wraps():
  import bench_core
  ring = bench_core.NumpyRing(5)
  ring.insert(bench_core.transitions(3, seed=1))
  ring.insert(bench_core.transitions(4, seed=2))  # wraps: slots 3, 4, 0, 1
  second = bench_core.transitions(4, seed=2)["reward"]
  first = bench_core.transitions(3, seed=1)["reward"]
  assert ring.size == 5 and ring.pos == 2
  assert ring.data["reward"].tolist() == [second[2], second[3], first[2], second[0], second[1]]
  s = ring.sample(16)
  assert s["obs"].shape == (16, bench_core.OBS) and set(s["reward"]) <= set(ring.data["reward"])


def _scan_case_checks():
  """What ``bench_scan.py`` must print for each group of its cases (issue 25's in-scan
  benchmark): a ratio for every kind, and the HLO counts with the uniform case."""
  from experiments import bench_scan_ordered, bench_scan_queue, bench_scan_removers

  def uniform(out):
    assert "HLO uniform sample b256" in out
    assert "HLO uniform sample b256, holes=False" in out
    for kind in ["scan", "smp-ins", "insert1", "insert1-1k"]:
      assert re.search(rf" {kind} +portable .* ratio +[0-9.]+x", out), (kind, out)
    assert re.search(r" scan +reuse8 .* ratio +[0-9.]+x", out), out
    assert re.search(r" scan +noholes .* ratio +[0-9.]+x", out), out
    assert re.search(r" scan +replace .* ratio +[0-9.]+x", out), out
    assert re.search(r" scan +index .* ratio +[0-9.]+x", out), out
    assert re.search(r" scan +index-reuse8 .* ratio +[0-9.]+x", out), out

  def prioritized(out):
    for kind in ["prio", "prio8", "prio32"]:
      assert re.search(rf" {kind} +portable .* ratio +[0-9.]+x", out), (kind, out)

  def removers(out):
    for remover in bench_scan_removers.REMOVERS:
      assert re.search(rf"removers +{remover} .* ratio +[0-9.]+x", out), (remover, out)

  def queue(out):
    for kind in bench_scan_queue.KINDS:
      for name in ("portable", "ring"):
        assert re.search(rf"queue +{kind} +{name} .* ratio +[0-9.]+x", out), (kind, name, out)

  def ordered(out):
    for kind in bench_scan_ordered.KINDS:
      assert re.search(rf"ordered +{kind} +select .* sort .* ratio +[0-9.]+x", out), (kind, out)

  return {"uniform": uniform, "prioritized,prioritized-small": prioritized,
          "removers": removers, "queue": queue, "ordered": ordered}


# One test per group of cases (not one for all): each compiles its own programs, and
# pytest-xdist can run them on both workers (one test of every case took ~90 s).
@pytest.mark.parametrize("cases", ["uniform", "prioritized,prioritized-small", "removers",
                                   "queue", "ordered"])
def test_bench_scan_runs_every_case_at_a_tiny_size(cases, monkeypatch, capsys):
  """``bench_scan.py``'s cases run end to end and print a ratio for each kind: at 4,096
  rows (1,024 for the removers and the queue), one round, portable only."""
  from experiments import bench_scan, bench_scan_ordered, bench_scan_queue, bench_scan_removers
  monkeypatch.setattr(bench_scan, "CAPACITY", 1 << 12)
  monkeypatch.setattr(bench_scan, "FILL_CHUNK", 1 << 10)
  monkeypatch.setattr(bench_scan_removers, "CAPACITY", 1 << 10)
  monkeypatch.setattr(bench_scan_removers, "FILL_CHUNK", 1 << 8)
  monkeypatch.setattr(bench_scan_queue, "CAPACITY", 1 << 10)
  monkeypatch.setattr(bench_scan_ordered, "CAPACITY", 1 << 10)
  bench_scan.start(rounds=1, target_s=0.001, hlo=cases == "uniform", native=False, reuse=8,
                   ring=True, replace=True, index=True, cases=cases)
  _scan_case_checks()[cases](capsys.readouterr().out)
