"""Core section of the benchmark: the pure functional table in jit vs its peers.

Measured in one process, on the 524-byte transition ``obs f32[64], next_obs
f32[64], action i32, reward f32, discount f32`` at capacity 1,000,000 (small:
65,536), every table full before timing starts:

- ``insert bB``: items/s of a jitted, donated ``insert`` vs flashbax's item
  buffer (jitted, donated ``add``), a numpy ring buffer, cpprb's
  ``ReplayBuffer.add`` and TorchRL's ``ReplayBuffer.extend``/``add``.
- ``sample bB``: items/s of ``sample`` vs the same peers' uniform sampling.
  Ours runs with its default semantics: without replacement within the batch,
  staleness mask and reuse counters on (``version`` passed, ``max_staleness``
  and ``max_times_sampled`` set, never reached); every peer samples with
  replacement and has neither mask. The ``(ours: with repl., no masks)`` cases
  are the same call at the peers' semantics.
- ``prioritized sample+update bB``: one sample plus a priority write-back
  (ours fused in one jitted call) vs flashbax's prioritised item buffer
  (``device="cpu"`` path, sample + ``set_priorities`` in one jitted call),
  cpprb's ``PrioritizedReplayBuffer`` and TorchRL's prioritized buffer (all
  with replacement; ours without, plus a ``with repl.`` case). Each writes
  back ``|reward| + 0.01`` of the batch it sampled, as a learner writes back
  its TD errors; the jitted peers take their key from the step index.
- ``lax.scan``: K training-loop steps inside one jitted ``lax.scan`` (the
  Anakin layout): insert a batch of transitions + sample a batch whose every
  leaf is read (as a learner would; reading only part of it lets XLA drop the
  other gathers), vs flashbax in the same scan; and K single-item inserts in a
  scan, per item, against the host peers' single-item insert from Python.

The groups live in ``bench_core_uniform.py`` and ``bench_core_prioritized.py``; the
sizes, the peers' plumbing and the rows in ``bench_core_common.py``.

Every timed operation is a ``Runner``; runners of one group are measured
round-robin (``repeats`` rounds, median seconds per call), so load from other
processes on a shared machine hits every configuration alike. Outputs of every
call (sampled data included) are kept alive and waited for, so XLA cannot drop
the gather. Peers that do not import are skipped with a printed line.

  python experiments/bench_core.py --small --out=results/bench_core.json
  python experiments/bench_core.py --scan   # issue 25's in-scan cases (bench_scan.py)
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Optional, Sequence

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from experiments.bench_core_common import (  # noqa: E402
  FULL,
  NOTES,
  PEERS,
  SECTION,
  SMALL,
  TINY,
  NumpyRing,
  Sizes,
)
from experiments.bench_core_prioritized import prioritized_group  # noqa: E402
from experiments.bench_core_uniform import uniform_group  # noqa: E402
from experiments.timing import (  # noqa: E402
  ITEM_BYTES,
  OBS,
  Holder,
  Runner,
  consume,
  example,
  measure,
  transitions,
)

# Read from here by tests/experiments, bench_hugepages.py and benchmark.py (``NOTES``).
__all__ = ["FULL", "ITEM_BYTES", "NOTES", "OBS", "PEERS", "SECTION", "SMALL", "TINY", "Holder",
           "NumpyRing", "Runner", "Sizes", "consume", "example", "main", "measure", "run",
           "transitions"]


def run(small: bool, sizes: Optional[Sizes] = None, peers: Sequence[str] = PEERS) -> list:
  """The ``core`` section of ``experiments/benchmark.py``: one row per (case, peer).

  Args:
    small: CI-sized (``SMALL``: capacity 65,536) instead of ``FULL`` (1,000,000).
    sizes: overrides both (e.g. ``TINY`` in tests).
    peers: which of ``PEERS`` to measure (missing packages are skipped).
  """
  sz = sizes or (SMALL if small else FULL)
  if sz.capacity % sz.fill_chunk:
    raise ValueError(f"Sizes.capacity {sz.capacity} must be a multiple of fill_chunk "
                     f"{sz.fill_chunk}.")
  del NOTES[:]
  NOTES.append("ours samples without replacement with staleness/reuse masks on unless the case "
               "says 'with repl.'; every peer samples with replacement and has no masks")
  NOTES.append("flashbax prioritised buffer uses its device='cpu' code path")
  print(f"[core] capacity {sz.capacity:,}, item {ITEM_BYTES} B, jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, peers {list(peers)}")
  rows: list = []
  for group in (uniform_group, prioritized_group):
    t0 = time.perf_counter()
    group(sz, tuple(peers), rows)
    gc.collect()  # free this group's 1M-slot tables before the next group allocates its own
    print(f"[core] {group.__name__} done in {time.perf_counter() - t0:.1f} s")
  return rows


def main(argv):
  del argv
  from absl import flags
  f = flags.FLAGS
  if f.scan:  # issue 25's in-scan cases, portable and native vs flashbax (bench_scan.py)
    from experiments import bench_scan
    bench_scan.start(hlo=True, rounds=f.scan_rounds, platform=f.scan_platform)
    return
  rows = run(f.small)
  for r in rows:
    print(f"{r['case']:<48} {r['funcreplay']:>14,.0f} {r['peer']:>14,.0f} {r['unit']:>8} "
          f"{r['ratio']:>7.2f}x  {r['peer_name']}")
  if f.out:
    os.makedirs(os.path.dirname(f.out) or ".", exist_ok=True)
    with open(f.out, "w") as fh:
      json.dump(dict(rows=rows, notes=NOTES), fh, indent=1)


if __name__ == "__main__":
  from absl import app, flags
  flags.DEFINE_bool("small", False, "CI-sized run")
  flags.DEFINE_string("out", "", "JSON output ('' = none)")
  flags.DEFINE_bool("scan", False, "run only issue 25's in-scan cases and HLO counts "
                    "(experiments/bench_scan.py)")
  flags.DEFINE_integer("scan_rounds", 5, "interleaved rounds of the --scan cases")
  flags.DEFINE_string("scan_platform", "", "backend of the --scan cases: cpu, gpu, tpu "
                      "('': JAX's default)")
  app.run(main)
