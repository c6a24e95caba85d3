#!/usr/bin/env bash
# Everything worth checking on the GPU machine, in one device call:
#   bash tools/gpu_session.sh            (logs and tables under $OUT)
# 1. install with CUDA for sm_90a (the H200; ~20 s on 16 cores)
# 2. the pytest suite on the GPU, in parallel processes sharing the GPU
# 3. the quickstart
# 4. optional: BENCH=1 runs the benchmark grid; SM90=1 the Hopper self-test.
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"

SECONDS=0
JAX_FLASH2_CUDA=on JAX_FLASH2_CUDA_ARCHS=${ARCHS:-90a} CMAKE_BUILD_PARALLEL_LEVEL=16 \
  python3 -m pip install --no-build-isolation --no-deps . > "$OUT/pip.log" 2>&1 \
  || { echo "pip install failed"; tail -30 "$OUT/pip.log"; exit 1; }
echo "== installed in ${SECONDS}s"

# Several pytest workers share the GPU: no preallocation, or the second one
# finds the memory taken. Run from tests/ so the installed package is imported.
SECONDS=0
(cd tests && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${TEST_TIMEOUT:-420}" \
  python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-6}" ${TESTS:-.} 2>&1 | tee "$OUT/pytest.log" | tail -25)
echo "== tests in ${SECONDS}s"

timeout 120 python3 examples/quickstart.py 2>&1 | tee "$OUT/quickstart.log"

if [ "${SM90:-0}" = 1 ]; then
  OUT="$OUT" timeout 300 bash tests/cuda/run_sm90_fwd_selftest.sh 2>&1 | tail -40
fi
if [ "${BENCH:-0}" = 1 ]; then
  timeout 400 python3 benchmarks/gpu_bench.py --xla-max-seqlen 2048 --out "$OUT/h200.md" 2>&1 \
    | grep -v "^{" | tail -45
fi
