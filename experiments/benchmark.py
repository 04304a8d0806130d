"""The benchmark driver: every ``experiments/bench_<section>.py`` in one run.

Each section module exposes ``run(small: bool) -> list[dict]`` whose rows have
the keys ``section, case, funcreplay, peer, peer_name, unit, ratio`` (ratio > 1
means funcreplay is better). The driver runs the sections in order, prints a
markdown table, writes JSON with the machine it ran on, and a bar chart of
the ratios (PNG, when matplotlib is installed).

- A section whose module does not exist, or whose import fails (an optional
  peer not installed), is reported as *skipped* with the reason.
- An exception inside ``run`` (or malformed rows) is reported as an *error*;
  the remaining sections still run and the driver exits non-zero at the end.

  python experiments/benchmark.py                       # all sections, full size
  python experiments/benchmark.py --sections=core --small --out=results/bench_small.json \
      --plot=results/bench_small.png
"""

from __future__ import annotations

import datetime
import importlib
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence

from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (HERE, ROOT):  # section modules import as ``bench_<name>``; they import funcreplay
  if _p not in sys.path:
    sys.path.insert(0, _p)

SECTIONS = ("core", "host", "torch", "checkpoint", "sharding", "trajectory")
ROW_KEYS = ("section", "case", "funcreplay", "peer", "peer_name", "unit", "ratio")
_VERSIONED = ("jax", "jaxlib", "numpy", "torch", "flashbax", "cpprb", "torchrl", "tensordict",
              "dm-reverb")


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def _mem_gib() -> Optional[float]:
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
  except (ValueError, OSError, AttributeError):
    return None


def _version(dist: str) -> Optional[str]:
  """Installed version, read from metadata (importing torch just to ask costs seconds)."""
  from importlib import metadata
  try:
    return metadata.version(dist)
  except metadata.PackageNotFoundError:
    return None


def _git_commit() -> Optional[str]:
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                         timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                           text=True, timeout=10).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else None
  except (OSError, subprocess.SubprocessError):
    return None


def machine_info() -> dict:
  """What the numbers were measured on. Starts the JAX backend (see ``drive``)."""
  import jax
  devices = jax.devices()
  info = dict(
      cpu=_cpu_model(), cores=os.cpu_count(),
      cores_usable=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
      memory_gib=_mem_gib(), platform=platform.platform(), python=platform.python_version(),
      jax_backend=devices[0].platform, devices=[str(d) for d in devices],
      device_kinds=sorted({d.device_kind for d in devices}),
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      versions={d: _version(d) for d in _VERSIONED}, git=_git_commit(),
      loadavg_start=os.getloadavg() if hasattr(os, "getloadavg") else None)
  return info


def _check_rows(name: str, rows) -> List[dict]:
  """The rows, or ValueError naming what is wrong with them."""
  if not isinstance(rows, list):
    raise ValueError(f"section {name!r}: run() must return a list of dicts, got "
                     f"{type(rows).__name__}.")
  for i, r in enumerate(rows):
    missing = [k for k in ROW_KEYS if not isinstance(r, dict) or k not in r]
    if missing:
      raise ValueError(f"section {name!r}: row {i} lacks keys {missing}: {r!r}.")
    for k in ("funcreplay", "peer", "ratio"):
      v = r[k]
      if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise ValueError(f"section {name!r}: row {i} ({r['case']!r}) has non-finite {k}={v!r}.")
  return rows


def run_section(name: str, small: bool,
                loader: Callable[[str], object] = importlib.import_module) -> dict:
  """Import ``bench_<name>`` and run it. Never raises: the outcome is in the result.

  Returns:
    dict with ``status`` ('ok' | 'skipped' | 'error'), ``seconds``, ``rows``, and
    ``reason`` (skipped) or ``error`` + ``traceback`` (error); ``notes`` where the
    module has a ``NOTES`` list.
  """
  t0 = time.perf_counter()
  # Section modules define absl flags on the global FLAGS at import, often with the
  # same names (--out, --capacity, --repeats): drop a section's flags once it is done
  # so the next section can define its own instead of failing with DuplicateFlagError.
  flags_before = set(flags.FLAGS)
  try:
    res = _import_and_run(name, small, loader)
  finally:
    for flag in set(flags.FLAGS) - flags_before:
      try:
        delattr(flags.FLAGS, flag)
      except AttributeError:  # its short name went with the long one
        pass
  res["seconds"] = time.perf_counter() - t0
  return res


def _import_and_run(name, small, loader) -> dict:
  mod_name = f"bench_{name}"
  res: Dict = dict(status="ok", rows=[])
  try:
    mod = loader(mod_name)
  except ModuleNotFoundError as e:
    if e.name == mod_name:
      res.update(status="skipped", reason=f"no module experiments/{mod_name}.py")
    else:
      res.update(status="skipped", reason=f"import failed: {type(e).__name__}: {e}")
  except ImportError as e:
    res.update(status="skipped", reason=f"import failed: {type(e).__name__}: {e}")
  except Exception as e:  # noqa: BLE001 -- a module that cannot even import is an error
    res.update(status="error", error=f"import of {mod_name} failed: {type(e).__name__}: {e}",
               traceback=traceback.format_exc())
  else:
    try:
      if not callable(getattr(mod, "run", None)):
        raise TypeError(f"{mod_name} has no run(small) function.")
      res["rows"] = _check_rows(name, mod.run(small))
      notes = getattr(mod, "NOTES", None)
      if notes:
        res["notes"] = list(notes)
    except Exception as e:  # noqa: BLE001 -- one broken section must not hide the others
      res.update(status="error", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(),
                 rows=[])
  return res


def _fmt(v: float) -> str:
  if v >= 100:
    return f"{v:,.0f}"
  return f"{v:.3g}"


def markdown(results: Dict[str, dict]) -> str:
  """A markdown table of every row, then one line per skipped or failed section."""
  lines = ["| section | case | funcreplay | peer | peer_name | unit | ratio |",
           "|---|---|---:|---:|---|---|---:|"]
  for res in results.values():
    for r in res["rows"]:
      lines.append(f"| {r['section']} | {r['case']} | {_fmt(r['funcreplay'])} | "
                   f"{_fmt(r['peer'])} | {r['peer_name']} | {r['unit']} | {r['ratio']:.2f}x |")
  for name, res in results.items():
    if res["status"] == "skipped":
      lines.append(f"\nskipped section {name}: {res['reason']}")
    elif res["status"] == "error":
      lines.append(f"\nFAILED section {name}: {res['error']}")
  return "\n".join(lines)


def plot(rows: List[dict], path: str, title: str) -> bool:
  """Bar chart of every row's ratio (log scale; > 1 = funcreplay better). False without
  matplotlib."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("skip plot: matplotlib not installed")
    return False
  labels = [f"{r['section']}: {r['case']} vs {r['peer_name']}" for r in rows]
  ratios = [r["ratio"] for r in rows]
  fig, ax = plt.subplots(figsize=(13, 0.28 * len(rows) + 1.2))
  colors = ["tab:green" if x >= 1 else "tab:red" for x in ratios]
  ax.barh(range(len(rows)), ratios, color=colors)
  ax.set_xscale("log")
  ax.axvline(1.0, color="black", linewidth=0.8)
  ax.set_yticks(range(len(rows)), labels, fontsize=7)
  ax.invert_yaxis()
  ax.set_xlabel("ratio (> 1: funcreplay better)")
  ax.set_title(title, fontsize=9)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  print(f"wrote {path}")
  return True


def drive(sections: Sequence[str], small: bool, out: Optional[str],
          loader: Callable[[str], object] = importlib.import_module,
          plot_path: Optional[str] = None) -> int:
  """Run ``sections`` in order; print the table; write ``out`` (JSON) and ``plot_path``
  (PNG). Returns the exit code: 1 if a section failed, else 0."""
  # Start the JAX backend before any section module is imported: a module may set
  # XLA_FLAGS at import (bench_sharding asks for 8 fake devices for its own
  # subprocess), which must not change the devices the in-process sections use.
  machine = machine_info()
  print(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['jax_backend']} "
        f"({len(machine['devices'])} device(s)), jax {machine['versions']['jax']}, "
        f"torch {machine['versions']['torch']}, load {machine['loadavg_start']}")
  results: Dict[str, dict] = {}
  for name in sections:
    print(f"== section {name} ({'small' if small else 'full'})", flush=True)
    res = run_section(name, small, loader)
    results[name] = res
    if res["status"] == "error":
      print(res["traceback"], file=sys.stderr)
    print(f"== section {name}: {res['status']} in {res['seconds']:.1f} s"
          + (f" ({res.get('reason') or res.get('error')})" if res["status"] != "ok" else ""),
          flush=True)
  machine["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
  print()
  print(markdown(results))
  if out:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    report = dict(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        small=small, machine=machine,
        sections={k: {kk: vv for kk, vv in v.items() if kk != "rows"} for k, v in results.items()},
        rows=[r for v in results.values() for r in v["rows"]])
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
      json.dump(report, f, indent=1, default=str)
    os.replace(tmp, out)
    print(f"\nwrote {out}")
  rows = [r for v in results.values() for r in v["rows"]]
  if plot_path and rows:
    plot(rows, plot_path, f"funcreplay vs peers ({'small' if small else 'full'}): "
         f"{machine['cpu']}, {machine['cores']} cores, {machine['jax_backend']}")
  failed = [k for k, v in results.items() if v["status"] == "error"]
  if failed:
    print(f"\nsections failed: {failed}", file=sys.stderr)
  return 1 if failed else 0


def _parse_sections(text: str) -> List[str]:
  names = [s.strip() for s in text.split(",") if s.strip()]
  for n in names:
    if not n.isidentifier():
      raise ValueError(f"--sections: {n!r} is not a section name (e.g. core,host).")
  return names


# The driver's flags live in their own FlagValues: section modules define flags of
# their own on the global FLAGS at import (bench_sharding has --out too), which
# would otherwise collide with these.
_FLAGS = flags.FlagValues()
flags.DEFINE_string("sections", ",".join(SECTIONS),
                    "comma-separated sections; each is experiments/bench_<name>.py",
                    flag_values=_FLAGS)
flags.DEFINE_bool("small", False, "CI-sized run of every section (each < ~60 s)",
                  flag_values=_FLAGS)
flags.DEFINE_string("out", "results/benchmark.json", "JSON output ('' = none)",
                    flag_values=_FLAGS)
flags.DEFINE_string("plot", "results/benchmark.png", "bar chart of the ratios ('' = none)",
                    flag_values=_FLAGS)


def _parse_flags(argv):
  """Parse the driver's flags, then the rest with absl's global FLAGS (--help, logging)."""
  try:
    rest = _FLAGS(argv, known_only=True)
  except flags.Error as e:
    sys.stderr.write(f"FATAL Flags parsing error: {e}\n")
    sys.exit(1)
  return flags.FLAGS(rest)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  sys.exit(drive(_parse_sections(_FLAGS.sections), _FLAGS.small, _FLAGS.out or None,
                 plot_path=_FLAGS.plot or None))


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
