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

# The environment variable that hands the cache directory to pytest-xdist's workers.
_CACHE_DIR_VARIABLE = "FUNCREPLAY_TEST_XLA_CACHE"


def _share_compiled_programs():
  """XLA's persistent compilation cache, in one directory for the whole test run.

  Many tests build tables with equal specs (every executor, every parametrization), so
  their programs are the same HLO: with the cache each is compiled once and read back
  after, where every ``make_table`` (and ``_free_compiled_programs`` below) made JAX
  compile it again. The same executables run, so no result changes
  (tests/core/test_reference_model.py alone: 178 -> 106 s; the whole suite on the 2-core
  VM: 21.6 -> 19.3 minutes, 1,093 tests passed both times).

  One directory for both pytest-xdist workers: the first process to load this file (the
  xdist controller, or a plain pytest) makes it and names it in ``_CACHE_DIR_VARIABLE``,
  which the workers it starts inherit, so a program that tests on both workers build is
  compiled once (``--dist loadgroup`` spreads a test's parametrizations over both):
  tests/core and tests/native on the 2-core VM, 673 -> 629 s (1,260 -> 1,163 s of CPU;
  one run each, back to back). JAX writes an entry in place, without a lock (none is
  taken without a size limit, and with one each write lists the whole directory): a
  worker that reads an entry the other is still writing fails to decompress it, warns,
  and compiles the program itself. Set by ``jax.config``, not by JAX's own environment
  variables, so that subprocesses the tests start (their own JAX programs) do not share
  it; removed at the first process's exit.
  """
  import atexit
  import shutil
  import tempfile

  import jax

  path = os.environ.get(_CACHE_DIR_VARIABLE)
  if not path:
    path = tempfile.mkdtemp(prefix="funcreplay-test-xla-cache-")
    os.environ[_CACHE_DIR_VARIABLE] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_share_compiled_programs()


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
