#!/usr/bin/env bash
# Issue 25's GPU checks in one bounded run (a lent GPU machine has minutes, not hours).
# Steps, in the order given by $CHECKS (default: all, in this order):
#   smoke    versions, one insert + sample on the GPU;
#   tests    the backend oracle (tests/core/test_backends.py: CPU vs GPU, bit-identical)
#            and the CUDA tests of the torch bridge (tests/interop/test_torch.py -k cuda);
#   bench    the in-scan benchmark against flashbax on the same GPU (bench_scan.py
#            --platform=gpu, with a reuse-limited table and tables without holes);
#   profile  the kernels a step of the same programs and their GPU time, from JAX's
#            profiler trace (gpu_profile.py), beside the deviceless count (accel_hlo.py);
#   lean     the HLO-structure tests of the lean programs with the GPU as the default
#            device (test_inplace, test_lean: they count XLA:CPU's program, so failures
#            there show where XLA:GPU's program differs; BUILD.md "On XLA:GPU" item 4);
#   ordered  the ordered samplers and Reverb's queue (bench_scan.py --cases=ordered,queue);
#   suite    the core suite with the GPU as JAX's default backend (SUITE_S seconds).
# Each step has its own time limit and log under $OUT (default results/gpu); a failing
# step does not stop the next. Wheels in .whl/ (flashbax, dm-tree, ml-collections: what
# the GPU image lacks) are installed into /tmp/site first.
#
#   bash experiments/gpu_check.sh                 # CHECKS="bench profile": some steps
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# Several processes share the GPU (pytest workers): no process takes 75% of its memory.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# The bench and profile steps compile the same programs: the second takes them from disk.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $((SECONDS - t0)) s (limit $limit)" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

smoke() {
  step smoke 90 $PY - <<'PYEOF'
import importlib.metadata as md, jax, jax.numpy as jnp, numpy as np
import funcreplay as fr
print({p: md.version(p) for p in ("jax", "jaxlib", "flashbax", "torch", "numpy")})
print(jax.devices())
spec = fr.TableSpec(1024, {"obs": jax.ShapeDtypeStruct((4,), jnp.float32),
                           "a": jax.ShapeDtypeStruct((), jnp.int32)})
t = fr.make_table(spec)
s = jax.jit(t.insert)(t.init(), {"obs": jnp.ones((8, 4)), "a": jnp.arange(8, dtype=jnp.int32)})
s, b = jax.jit(t.sample, static_argnames="batch_size")(s, jax.random.PRNGKey(0), batch_size=4)
print(b.data["a"].devices(), np.asarray(b.data["a"]), np.asarray(b.info.key))
PYEOF
}
tests() {
  TAIL=40 step tests "${TESTS_S:-150}" env JAX_PLATFORMS=cuda,cpu $PY -m pytest -q -n 12 \
      -p no:cacheprovider -rf tests/core/test_backends.py tests/interop/test_torch.py \
      -k "cuda or backend"
}
bench() {
  step bench "${BENCH_S:-240}" $PY experiments/bench_scan.py --platform=gpu --rounds=5 --hlo \
      --reuse=8 --ring
}
profile() {
  TAIL=60 step profile "${PROFILE_S:-150}" $PY experiments/gpu_profile.py
}
lean() {
  TAIL=60 step lean "${LEAN_S:-120}" env JAX_PLATFORMS=cuda,cpu $PY -m pytest -q -rf --tb=line \
      -n 12 -p no:cacheprovider tests/core/test_inplace.py tests/core/test_lean.py
}
ordered() {
  step ordered "${ORDERED_S:-120}" $PY experiments/bench_scan.py --platform=gpu --rounds=3 \
      --cases=ordered,queue
}
suite() {  # the HLO-structure tests count XLA:CPU's program (see lean); the rest must pass
  TAIL=40 step suite "$((${SUITE_S:-90} + 30))" env JAX_PLATFORMS=cuda,cpu timeout -s INT \
      "${SUITE_S:-90}" $PY -m pytest -q -rf --tb=short -n 14 -p no:cacheprovider tests/core \
      --ignore=tests/core/test_hlo.py --ignore=tests/core/test_inplace.py \
      --ignore=tests/core/test_lean.py
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv \
    | tee "$OUT/summary.txt"
for check in ${CHECKS:-smoke tests bench profile lean ordered suite}; do
  "$check"
done
cat "$OUT/summary.txt"
