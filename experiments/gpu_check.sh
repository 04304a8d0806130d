#!/usr/bin/env bash
# Issue 25's GPU checks in one bounded run (a lent GPU machine has minutes, not hours):
#   1. a smoke test (versions, one insert + sample on the GPU);
#   2. the backend oracle (tests/core/test_backends.py: CPU vs GPU, bit-identical) and the
#      CUDA tests of the torch bridge (tests/interop/test_torch.py -k cuda);
#   3. the in-scan benchmark against flashbax on the same GPU (bench_scan.py --platform=gpu,
#      with a reuse-limited table), the kernels a step of its programs (accel_hlo.py), then
#      the ordered samplers and Reverb's queue;
#   4. with the time left, the core suite with the GPU as JAX's default backend.
# Each step has its own time limit and log under $OUT (default results/gpu); a failing
# step does not stop the next. Wheels in .whl/ (flashbax, dm-tree, ml-collections: what
# the GPU image lacks) are installed into /tmp/site first.
#
#   bash experiments/gpu_check.sh            # BENCH_S / TESTS_S / SUITE_S: step limits
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

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc $rc, $((SECONDS - t0)) s (limit $limit)" | tee -a "$OUT/summary.txt"
  tail -n "${TAIL:-25}" "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv \
    | tee "$OUT/summary.txt"
step smoke 120 $PY - <<'EOF'
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
EOF
TAIL=40 step tests_gpu "${TESTS_S:-150}" env JAX_PLATFORMS=cuda,cpu $PY -m pytest -q -n 12 \
    -p no:cacheprovider -rf tests/core/test_backends.py tests/interop/test_torch.py \
    -k "cuda or backend"
step bench_scan "${BENCH_S:-240}" $PY experiments/bench_scan.py --platform=gpu --rounds=5 --hlo \
    --reuse=8 --ring
# The kernels a step of the same programs, counted as experiments/accel_hlo.py counts them
# (the deviceless count for an H200, BUILD.md finding 27), next to the times above.
step accel_hlo 120 $PY experiments/accel_hlo.py --targets=h200
# The deterministic samplers' top-k selection against their old sort (ORDERED_S=0 skips).
if [ "${ORDERED_S:-120}" != 0 ]; then
  step bench_ordered "${ORDERED_S:-120}" $PY experiments/bench_scan.py --platform=gpu \
      --rounds=3 --cases=ordered,queue
fi
# Whatever time is left (SUITE_S=0 skips it): the core suite with the GPU as the default
# device. Its HLO-structure tests (test_hlo, test_lean, test_inplace, the storage gather
# count) count XLA:CPU's program and fail on XLA:GPU's by design; the rest must pass.
if [ "${SUITE_S:-90}" != 0 ]; then
  TAIL=40 step core_on_gpu "$((${SUITE_S:-90} + 30))" env JAX_PLATFORMS=cuda,cpu timeout -s INT \
      "${SUITE_S:-90}" $PY -m pytest -v -rf --tb=short -n 14 -p no:cacheprovider tests/core \
      --ignore=tests/core/test_hlo.py
fi
cat "$OUT/summary.txt"
