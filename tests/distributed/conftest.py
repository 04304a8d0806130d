"""Fixtures of the sharded-table tests: the 4-shard mesh (skips without 8 devices) and a
prioritized sharded table with unequal fill."""

import jax
import numpy as np
import pytest

import funcreplay as fr
from funcreplay import distributed as frs
from tests.distributed.common import ITEM, PRIOS, N, unequal_state


@pytest.fixture(scope="module")
def mesh():
  if jax.device_count() < 8:
    pytest.skip("needs 8 CPU devices; run by test_suite_on_8_cpu_devices in a subprocess")
  # Auto axes: the tests index and reduce sharded outputs freely. Explicit
  # axes (jax.make_mesh's default) are covered by test_explicit_mesh.
  return jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


@pytest.fixture(scope="module")
def unequal(mesh):
  """A prioritized sharded table with unequal fill (one shard empty), built once."""
  t = frs.make_sharded_table(fr.TableSpec(4 * 8, ITEM, sampler=fr.Prioritized(1.0)), mesh)
  st, pr, mask = unequal_state(t, PRIOS)
  return t, st, pr.astype(np.float64), mask
