"""One local Ray cluster for the tests of funcreplay.ray (tests/ray/test_ray*.py).

Every test there carries ``xdist_group("ray")`` and runs with ``--dist loadgroup`` (the
Makefile's), so all of them run on one pytest-xdist worker and the cluster starts once.
"""

from __future__ import annotations

import os
import warnings

import pytest

ray = pytest.importorskip("ray", reason="funcreplay.ray needs Ray (pip install 'funcreplay[ray]')")

from tests.ray import common  # noqa: E402


@pytest.fixture(scope="package", autouse=True)
def cluster():
  # Workers inherit this environment (the worktree on PYTHONPATH, CPU-only JAX).
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  old = os.environ.get("PYTHONPATH")
  os.environ["PYTHONPATH"] = os.pathsep.join(
      [root] + [p for p in (old or "").split(os.pathsep) if p])
  # Producer / learner classes travel by value (workers need not import tests/).
  ray.cloudpickle.register_pickle_by_value(common)
  with warnings.catch_warnings():  # JAX's fork warning: Ray forks only to exec its daemons
    warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
    ray.init(num_cpus=2, include_dashboard=False, namespace="funcreplay-tests",
             log_to_driver=False, object_store_memory=common.OBJECT_STORE_BYTES)
  yield
  ray.shutdown()
  if old is None:
    os.environ.pop("PYTHONPATH", None)
  else:
    os.environ["PYTHONPATH"] = old


@pytest.fixture(autouse=True)
def _ship_test_module(request):
  """Classes and functions a test module defines travel to the workers by value too."""
  ray.cloudpickle.register_pickle_by_value(request.module)
