#!/bin/bash
# Builds (unless a carried build/fwd_selftest loads) and runs the CUDA forward
# self-test, then compute-sanitizer memcheck and racecheck on small shapes.
# Meant for one device call:  bash tests/cuda/run_fwd_selftest.sh
# Logs go to $OUT (or /tmp/fwd_selftest_out).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/fwd_selftest_out}
mkdir -p "$OUT" build/fwd_obj
ARCH=${ARCH:--gencode=arch=compute_90a,code=sm_90a}
BIN=build/fwd_selftest

build() {
  local pids=() f
  for f in src/cuda/fwd_launch.cu src/cuda/fwd_hdim*.cu tests/cuda/fwd_selftest.cu; do
    nvcc -std=c++17 -O3 -I. --expt-relaxed-constexpr $ARCH -c "$f" \
      -o "build/fwd_obj/$(basename "$f" .cu).o" &
    pids+=($!)
  done
  local ok=0
  for pid in "${pids[@]}"; do wait "$pid" || ok=1; done
  [ $ok -eq 0 ] && nvcc $ARCH build/fwd_obj/*.o -o $BIN
}

if [ "${REBUILD:-0}" = 1 ] || ! $BIN --probe >/dev/null 2>&1; then
  echo "== building $BIN"
  SECONDS=0
  build || { echo "BUILD FAILED"; exit 1; }
  echo "== built in ${SECONDS}s"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rc=0
echo "== selftest"
$BIN 2>&1 | tee "$OUT/selftest.log"; rc=$((rc | PIPESTATUS[0]))
if [ "${SANITIZE:-1}" = 1 ]; then
  echo "== memcheck (--small)"
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 $BIN --small 2>&1 | tee "$OUT/memcheck.log" | tail -4
  rc=$((rc | PIPESTATUS[0]))
  echo "== racecheck (--tiny)"
  timeout 120 compute-sanitizer --tool racecheck --error-exitcode 3 $BIN --tiny 2>&1 | tee "$OUT/racecheck.log" | tail -4
  rc=$((rc | PIPESTATUS[0]))
fi
echo "== exit status $rc"
exit $rc
