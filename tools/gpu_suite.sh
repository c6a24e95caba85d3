#!/usr/bin/env bash
# Everything worth checking on the GPU machine, in one run:
#   bash tools/gpu_suite.sh            (logs and tables under $OUT)
# 1. install with CUDA for sm_90a (the H200; ~30 s on 16 cores)
# 2. the pytest suite on GPU $TEST_GPU, in parallel processes sharing it
#    (TESTS=files to choose, SUITE=gpu for the GPU-path files alone, PART=K/N
#    for part K of N, IDS=file for the ids listed in it, e.g. those a run cut
#    by its time limit left: `tools/test_part.py --left`). With XLA's GEMM
#    autotuning off (below) and 14 workers it ran 1.6-1.7 tests/s on an H100
#    (with autotuning and 8-16 workers, 190-240 tests per 10 minutes): the
#    whole suite (about 1,050 tests) in two runs of the 10-minute limit.
# 3. the quickstart
# Optional jobs, run on GPU $AUX_GPU: beside the tests when it differs from
# $TEST_GPU (a 2-GPU host), after them otherwise, so timings never share a GPU:
#   SELFTEST=1  the standalone sm80 forward and backward self-tests + sanitizers
#   SM90=1      the Hopper forward and backward self-tests + sanitizers
#               (SM90=fwd or SM90=bwd: one of them)
#   NCU=1       ncu sections of the Hopper backward kernel
#   VARIANTS=1  the variant benchmark table alone
#   QUANT=1     the decode kernel's int8 / fp8 dequantization: its GPU test,
#               then the KV-cache table
#   BENCH=1     the benchmark grid and the variant table
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
TEST_GPU=${TEST_GPU:-0}
AUX_GPU=${AUX_GPU:-$TEST_GPU}

source tools/device_install.sh

aux_jobs() {
  export CUDA_VISIBLE_DEVICES=$AUX_GPU
  if [ "${SELFTEST:-0}" = 1 ]; then
    echo "== sm80 forward self-test"
    OUT=/tmp/fwd_selftest timeout 300 bash tests/cuda/run_fwd_selftest.sh 2>&1 | grep -v "^PASS"
    echo "== sm80 backward self-test"
    timeout 300 bash tests/cuda/run_bwd_selftest.sh 2>&1 | grep -v "^PASS\|^ok"
    echo "== dropout mask self-test"
    nvcc -std=c++17 -O3 -I. -gencode=arch=compute_90a,code=sm_90a \
      tests/cuda/dropout_selftest.cu -o build/dropout_selftest && timeout 60 build/dropout_selftest
  fi
  case "${SM90:-0}" in 1|*fwd*)
    echo "== sm90 forward self-test"
    OUT=/tmp/sm90_selftest timeout 300 bash tests/cuda/run_sm90_fwd_selftest.sh 2>&1 | grep -v "^PASS"
  esac
  case "${SM90:-0}" in 1|*bwd*)
    echo "== sm90 backward self-test"
    OUT=/tmp/sm90_bwd_selftest timeout 300 bash tests/cuda/run_sm90_bwd_selftest.sh 2>&1 | grep -v "^PASS"
    cp /tmp/sm90_bwd_selftest/racecheck.log "$OUT/sm90_bwd_racecheck.log"
  esac
  if [ "${NCU:-0}" = 1 ]; then
    # Where the Hopper backward's time goes (B4 T=S=4096 H16 D128, its
    # first timed launch): stall reasons, issue slots, memory traffic.
    echo "== ncu, Hopper backward"
    timeout 150 ncu --clock-control none -k regex:BwdSm90Kernel -s 1 -c 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      build/sm90_bwd_selftest --time-only > "$OUT/ncu_bwd.txt" 2>&1
    grep -vE "^TIME|^device" "$OUT/ncu_bwd.txt" | head -150
  fi
  if [ "${QUANT:-0}" = 1 ]; then
    echo "== quantized KV caches in the decode kernel"
    (cd tests && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 300 python3 -m pytest -q \
      -p no:cacheprovider test_kvcache_gpu.py -k quantized 2>&1 | tail -15)
    (cd benchmarks && timeout 240 python3 kvcache_bench.py --quick \
      --steps 20 --warmup 0.2 --out "$OUT/kvcache_quant.md" 2>&1 | grep -A30 "^Command")
  fi
  if [ "${VARIANTS:-0}" = 1 ]; then
    (cd benchmarks && timeout 240 python3 variant_bench.py --out "$OUT/h200_variants.md" 2>&1 | tail -30)
  fi
  echo "== aux jobs done at ${SECONDS}s"
  if [ "${BENCH:-0}" = 1 ]; then
    (cd benchmarks && timeout 420 python3 gpu_bench.py --xla-max-seqlen 2048 --out "$OUT/h200.md" \
      2>&1 | grep -v "^{" | tail -45)
    (cd benchmarks && timeout 200 python3 variant_bench.py --out "$OUT/h200_variants.md" 2>&1 | tail -20)
  fi
}

run_tests() {
  # Several pytest workers share the GPU: no preallocation, or the second one
  # finds the memory taken. Run from tests/ so the installed package is imported.
  # --dist loadgroup: tests of one xdist_group (the context-parallel checks,
  # a subprocess on 8 host devices) share one worker and so one subprocess.
  SECONDS=0
  # PART=K/N: only part K of N of the suite (tools/test_part.py), so that
  # N calls of at most 10 minutes run all of it. Test ids hold spaces: an array.
  local -a tests=(${TESTS:-.})
  # SUITE=gpu: the files that test the CUDA paths themselves, and the CPU
  # kernels under this machine's jax (about 230 tests, ~8 minutes with 12 workers).
  if [ "${SUITE:-}" = gpu ]; then
    tests=(test_gpu_paths.py test_packed_gpu.py test_score_options_gpu.py test_dropout_gpu.py
           test_kvcache_gpu.py test_float32_blockwise.py test_head_dims.py test_hostile_inputs.py
           test_cpu_platform.py)
  fi
  if [ -n "${PART:-}" ]; then
    mapfile -t tests < <(python3 tools/test_part.py "${PART%/*}" "${PART#*/}")
    echo "== part $PART: ${#tests[@]} tests"
  fi
  if [ -n "${IDS:-}" ]; then
    mapfile -t tests < "$IDS"
    echo "== $IDS: ${#tests[@]} tests"
  fi
  # No GEMM autotuning: it multiplies XLA's compile time for the reference
  # backend's matmuls, and the tests check values, not speed.
  (cd tests && CUDA_VISIBLE_DEVICES=$TEST_GPU XLA_PYTHON_CLIENT_PREALLOCATE=false \
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    timeout -s INT "${TEST_TIMEOUT:-420}" python3 -m pytest -v -rfE -p no:cacheprovider \
    --tb=short --durations=25 -n "${WORKERS:-14}" --dist loadgroup "${tests[@]}" > "$OUT/pytest.log" 2>&1)
  # -v keeps every finished test's result when the timeout cuts the run; SIGINT
  # lets pytest still print the failures' tracebacks and the summary.
  grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | grep -v "^\[gw.*PASSED" | tail -30
  grep -A8 "slowest 25 durations" "$OUT/pytest.log"
  echo "== tests in ${SECONDS}s"
  CUDA_VISIBLE_DEVICES=$TEST_GPU timeout 120 python3 examples/quickstart.py 2>&1 \
    | tee "$OUT/quickstart.log"
}

if [ "$AUX_GPU" != "$TEST_GPU" ]; then
  aux_jobs > "$OUT/aux.log" 2>&1 &
  aux_pid=$!
  run_tests
  wait $aux_pid
  cat "$OUT/aux.log"
else
  run_tests
  aux_jobs 2>&1 | tee "$OUT/aux.log"
fi
