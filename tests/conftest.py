import os

# Tests run on CPU; keep XLA from grabbing every core's worth of threads on the
# 2-core CI machine, and skip XLA's expensive CPU optimisation passes: test
# tables are tiny, so compilation dominates and the passes cost more than they
# save (about 20% less CPU time for the suite; results are unchanged).
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0 "
    "--xla_llvm_disable_expensive_passes=true")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from hypothesis import HealthCheck, settings  # noqa: E402

# function_scoped_fixture: ``both_implementations`` only picks the implementation;
# it holds nothing that examples could share.
settings.register_profile(
    "ci", deadline=None, max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

import pytest  # noqa: E402


@pytest.fixture(params=["native", "portable"])
def both_implementations(request, monkeypatch):
  """Run a test once with the native CPU kernels and once with the portable JAX
  implementation (``funcreplay.native``): both must honour the same contract.

  It sets ``FUNCREPLAY_NATIVE``, which tables built with ``native=None`` read when their
  programs are built (``funcreplay.native.use_native``; there is no mutable default).
  Modules opt in with ``pytestmark = pytest.mark.usefixtures("both_implementations")``.
  The native run fails (not skips) when a compiler exists but the kernels do
  not build; it skips only on a machine without a C++ compiler.
  """
  from tests.helpers import require_native_kernels

  if request.param == "native":
    require_native_kernels()  # skips when the environment already turned them off
    monkeypatch.setenv("FUNCREPLAY_NATIVE", "1")
  else:
    monkeypatch.setenv("FUNCREPLAY_NATIVE", "0")
  yield request.param


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drop every cached compiled program after each test module.

  Each XLA:CPU executable holds ~3 memory mappings and a process may have
  65530 (``vm.max_map_count``). Without this a pytest-xdist worker reached
  ~65,160 mappings by the end of the suite, and runs that crossed the limit
  died inside a later XLA compilation (segfault or abort, at a different
  test each time). Modules share few programs, so recompiling costs little.
  """
  yield
  import gc

  import funcreplay

  funcreplay.clear_caches()
  gc.collect()
