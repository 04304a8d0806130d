"""The in-scan step programs that bench_scan.py times and accel_hlo.py counts
(experiments/scan_steps.py): ours update the state in place in every order of calls, and
so does flashbax's in the cases whose ratios are the headline (insert then sample, insert).

A program that copied a whole buffer every step would time the copy, not the replay
step. flashbax's sample-then-add does copy its buffer each step (nothing orders its gather
before its add; README's `smp-ins` rows say so), as does its prioritized step (its own
sum-tree update); those are its programs as a user writes them, not checked here."""

import jax
import jax.numpy as jnp
import pytest

import funcreplay as fr
from experiments import scan_steps
from experiments.timing import example
from funcreplay.core import hlo

CAPACITY = 1 << 12
BATCH = 64


def _rows(*lead):
  return jax.tree_util.tree_map(lambda v: jnp.zeros(lead + jnp.shape(v), jnp.asarray(v).dtype),
                                example())


def _big_copies(fn, state, *args):
  text = jax.jit(fn, donate_argnums=0).lower(state, jnp.int32(0), *args).compile().as_text()
  return hlo.text_counts(text, big=CAPACITY)["big_copies"]


@pytest.mark.parametrize("kind", ["scan", "smp-ins", "insert1"])
def test_uniform_steps_copy_no_buffer(kind):
  fbx = pytest.importorskip("flashbax")
  xs = _rows(4, 1 if kind == "insert1" else 16)
  t = fr.make_table(fr.TableSpec(CAPACITY, example()), native=False)
  assert _big_copies(scan_steps.table_uniform_steps(t, BATCH)[kind], t.init(), xs) == 0
  if kind != "smp-ins":
    buf = fbx.make_item_buffer(max_length=CAPACITY, min_length=1, sample_batch_size=BATCH,
                               add_batches=True)
    assert _big_copies(scan_steps.flashbax_uniform_steps(buf)[kind], buf.init(example()),
                       xs) == 0


def test_prioritized_step_copies_no_buffer_outside_the_rare_completion():
  t = fr.make_table(fr.TableSpec(CAPACITY, example(), sampler=fr.Prioritized(0.6)),
                    native=False)
  # One copy of the weight tree, inside the rare exact completion's branch (BUILD.md).
  assert _big_copies(scan_steps.table_prioritized_step(t, BATCH), t.init()) <= 1


def test_gpu_profile_counts_a_programs_device_events(tmp_path):
  """experiments/gpu_profile.py's reading of a ``jax.profiler`` trace, on the CPU (on a
  GPU machine the same code reads the GPU's process): a traced call's events are found,
  each with a name and a duration, and a 2-step scan of one fusion runs it twice."""
  from experiments import gpu_profile

  def fn(s, i0):
    body = lambda c, _: (jnp.sin(c) * 2.0 + i0, None)  # noqa: E731
    s = jax.lax.scan(body, s, None, length=2)[0]
    return s, jnp.sum(s)

  events = gpu_profile.profile(fn, jnp.ones((4096,)), jnp.float32(1.0), device="/host:CPU")
  assert events and all(isinstance(us, float) and us >= 0 for _, _, us in events)
  names = [ev for _, ev, _ in events]
  assert any(names.count(n) >= 2 and "fusion" in n for n in names), sorted(set(names))
