"""Shared helpers for the absl experiments: metrics files, learning-curve plots, XLA flags.

Every experiment writes into its ``--workdir``:

* ``metrics.jsonl``: one JSON object per line, ``{"step": int, "wall": float, **scalars}``;
* TensorBoard event files (``events.out.tfevents.*``) when ``tensorboardX`` is
  importable (``tensorboard --logdir <workdir>``); skipped with a log line otherwise;
* PNG figures made by ``plot_curve`` (matplotlib with the headless ``Agg`` backend).

Nothing here imports JAX at module import time, so ``set_platform_flags`` can
run before JAX initialises its backends.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping, Optional, Sequence

from absl import logging

try:  # optional: TensorBoard events
  import tensorboardX
except ImportError:  # pragma: no cover - depends on the environment
  tensorboardX = None


def set_platform_flags(platform: Optional[str] = None, single_thread_eigen: bool = False) -> None:
  """Set JAX/XLA environment flags; call before JAX creates its backends.

  Args:
    platform: e.g. ``"cpu"``; sets ``JAX_PLATFORMS`` unless already set.
    single_thread_eigen: add ``--xla_cpu_multi_thread_eigen=false`` to
      ``XLA_FLAGS`` (useful on small shared CPUs where intra-op threads fight
      with other processes; small MLPs gain nothing from them).
  """
  if platform:
    os.environ.setdefault("JAX_PLATFORMS", platform)
  if single_thread_eigen:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
      os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false").strip()


def to_python(x: Any) -> Any:
  """Scalars / 0-d arrays -> Python numbers (floats stay floats; NaN kept as NaN)."""
  if hasattr(x, "item") and getattr(x, "ndim", 0) == 0:
    x = x.item()
  if isinstance(x, bool):
    return x
  if isinstance(x, int):
    return x
  if isinstance(x, float):
    return x
  try:
    return float(x)
  except (TypeError, ValueError):
    return x


class MetricsWriter:
  """Append scalar metrics to ``<workdir>/metrics.jsonl`` and TensorBoard events.

  Example::

    with MetricsWriter(workdir) as w:
      w.write(step, {"return": 21.0, "loss": 0.3})

  Non-finite values are written as JSON ``null`` (strict JSON) and skipped in
  TensorBoard.
  """

  def __init__(self, workdir: str, tensorboard: bool = True, filename: str = "metrics.jsonl"):
    if not workdir:
      raise ValueError("MetricsWriter: workdir must be a non-empty path.")
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.path = os.path.join(workdir, filename)
    self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
    self._t0 = time.monotonic()
    self._tb = None
    if tensorboard:
      if tensorboardX is None:
        logging.info("tensorboardX not installed: no TensorBoard events (metrics.jsonl only).")
      else:
        self._tb = tensorboardX.SummaryWriter(logdir=workdir, flush_secs=5)

  @property
  def has_tensorboard(self) -> bool:
    return self._tb is not None

  def write(self, step: int, scalars: Mapping[str, Any]) -> dict:
    """Write one record; returns it (Python numbers, ``None`` for non-finite)."""
    rec = {"step": int(step), "wall": round(time.monotonic() - self._t0, 4)}
    for k, v in scalars.items():
      v = to_python(v)
      if isinstance(v, float) and not math.isfinite(v):
        v = None
      rec[k] = v
      if self._tb is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
        self._tb.add_scalar(k, v, global_step=int(step))
    self._file.write(json.dumps(rec) + "\n")
    self._file.flush()
    return rec

  def close(self) -> None:
    if not self._file.closed:
      self._file.close()
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> "MetricsWriter":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_metrics(path: str) -> list:
  """The records of a ``metrics.jsonl`` file (or of ``<workdir>/metrics.jsonl``)."""
  if os.path.isdir(path):
    path = os.path.join(path, "metrics.jsonl")
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def plot_metric(workdir: str, key: str, title: str, xlabel: str = "learner step",
                filename: str = "learning_curve.png") -> Optional[str]:
  """Plot ``key`` of ``<workdir>/metrics.jsonl`` against its steps (``plot_curve``) as
  ``<workdir>/<filename>``; returns the path, or None when no record has ``key``."""
  recs = [r for r in read_metrics(workdir) if key in r]
  steps, values = [r["step"] for r in recs], [r[key] for r in recs]
  if not steps:
    return None
  return plot_curve(os.path.join(workdir, filename), steps, values, title, key, xlabel)


def plot_curve(path: str, steps: Sequence[float], values: Sequence[float], title: str,
               ylabel: str, xlabel: str = "env steps", hline: Optional[float] = None) -> str:
  """Save a line plot of ``values`` against ``steps`` as a PNG at ``path``; returns ``path``.

  ``hline`` draws a dashed reference line (e.g. a target return).
  """
  import matplotlib  # noqa: PLC0415 (lazy: only experiments that plot need it)
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415

  fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
  ax.plot(list(steps), [float("nan") if v is None else v for v in values], lw=1.5)
  if hline is not None:
    ax.axhline(hline, ls="--", color="gray", lw=1)
  ax.set_title(title)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  d = os.path.dirname(path)
  if d:
    os.makedirs(d, exist_ok=True)
  fig.savefig(path)
  plt.close(fig)
  return path


def write_json(path: str, obj: Any) -> str:
  """Write ``obj`` as indented JSON (creating the directory); returns ``path``."""
  d = os.path.dirname(path)
  if d:
    os.makedirs(d, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, sort_keys=True, default=to_python)
    f.write("\n")
  return path


class Timer:
  """Wall and process-CPU time since construction (``elapsed()`` -> (wall_s, cpu_s))."""

  def __init__(self):
    self._w0 = time.perf_counter()
    self._c0 = time.process_time()

  def elapsed(self):
    return time.perf_counter() - self._w0, time.process_time() - self._c0
