#!/usr/bin/env bash
# Builds and runs the CUDA backward self-test (all cases, then timings per
# head-dim bucket), then memcheck and racecheck on its small cases.
# Usage (repository root): tests/cuda/run_bwd_selftest.sh
# ARCH overrides the target (default sm_90a, the H200 of the device machine).
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCH=${ARCH:--gencode=arch=compute_90a,code=sm_90a}
BUILD=${BUILD:-/tmp/jf2_bwd_build}
mkdir -p "$BUILD"
FLAGS="-std=c++17 -O3 -I. --expt-relaxed-constexpr $ARCH"
pids=()
for f in src/cuda/bwd_*.cu src/cuda/device_info.cu; do
  nvcc $FLAGS -c "$f" -o "$BUILD/$(basename "$f" .cu).o" & pids+=($!)
done
nvcc $FLAGS -Xcompiler -fopenmp -c tests/cuda/bwd_selftest.cu -o "$BUILD/bwd_selftest.o" & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid" || { echo "BUILD FAILED"; exit 1; }; done
nvcc $ARCH "$BUILD"/*.o -o "$BUILD/bwd_selftest" -lgomp || { echo "LINK FAILED"; exit 1; }

status=0
"$BUILD/bwd_selftest" || status=1
echo "== timings per head-dim bucket"
"$BUILD/bwd_selftest" time || status=1
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool (small cases)"
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$BUILD/bwd_selftest" small
    rc=$?
    echo "== $tool exit code $rc"
    [ $rc -eq 0 ] || status=1
  done
else
  echo "compute-sanitizer not found"
fi
exit $status
