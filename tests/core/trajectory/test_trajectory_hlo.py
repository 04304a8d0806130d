"""The common trajectory programs stay lean: no ``conditional`` / ``while`` in the optimized
HLO of ``add`` and of the uniform ``sample`` (closed form and index), as tests/core/test_hlo.py
pins for the item table (on XLA:GPU each is a device-to-host sync)."""

import jax
import jax.numpy as jnp
import pytest

import funcreplay as fr
from funcreplay.core import hlo

STEP = {"obs": jax.ShapeDtypeStruct((8,), jnp.float32), "r": jax.ShapeDtypeStruct((), jnp.float32)}


@pytest.mark.parametrize("cross", [True, False])
@pytest.mark.parametrize("period", [1, 8])
def test_add_and_uniform_sample_have_no_control_flow(cross, period):
  spec = fr.TrajectorySpec(16, 4096, 32, period, STEP, cross_episodes=cross)
  table = fr.make_trajectory_table(spec)
  state = table.init()
  steps = {"obs": jnp.zeros((16, 1, 8)), "r": jnp.zeros((16, 1))}
  first = None if cross else jnp.zeros((16, 1), bool)
  add = hlo.counts(lambda s, x, f: table.add(s, x, first=f), state, steps, first,
                   donate_argnums=0)
  sample = hlo.counts(lambda s, k: table.sample(s, k, batch_size=64), state,
                      jax.random.key(0), donate_argnums=0)
  for name, c in (("add", add), ("sample", sample)):
    assert c["conditional"] == 0 and c["while"] == 0, (name, c)
    assert c["big_copies"] == 0, (name, c)  # donated buffers updated in place


def test_prioritized_step_updates_in_place():
  """add + sample + update_priorities in one program copy neither the weight tree nor the
  priority column (each read is ordered before the in-place writes)."""
  spec = fr.TrajectorySpec(16, 4096, 32, 1, STEP, sampler=fr.Prioritized(0.6),
                           cross_episodes=True)
  table = fr.make_trajectory_table(spec)
  steps = {"obs": jnp.zeros((16, 1, 8)), "r": jnp.zeros((16, 1))}

  def step(s, x, k):
    s = table.add(s, x)
    s, smp = table.sample(s, k, batch_size=64)
    s = table.update_priorities(s, smp.info.slot, smp.info.key, jnp.abs(smp.data["r"][:, 0]))
    return s, smp.data
  c = hlo.counts(step, table.init(), steps, jax.random.key(0), donate_argnums=0)
  # The only big copies are jax's random bits of the rare exact completion (inside its cond).
  assert c["big_copies"] <= 2 and c["conditional"] == 1, c
  assert hlo.counts(table.add, table.init(), steps, donate_argnums=0)["big_copies"] == 0
