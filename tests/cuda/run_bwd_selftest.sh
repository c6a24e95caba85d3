#!/usr/bin/env bash
# Builds (unless a carried build/bwd_selftest loads) and runs the CUDA
# backward self-test (all cases, then timings per head-dim bucket), then
# memcheck and racecheck on its small cases. Every case runs with the
# device's shared memory, an A100's (163 KB) and that of cc 8.6 / 8.9 GPUs
# (99 KB: the small-smem tiles).
# Usage (repository root): tests/cuda/run_bwd_selftest.sh
# ARCH overrides the target (default sm_90a, the H200 of the device machine);
# REBUILD=1 forces a build. Logs go to $OUT (or /tmp/bwd_selftest_out).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/bwd_selftest_out}
mkdir -p "$OUT"
ARCH=${ARCH:--gencode=arch=compute_90a,code=sm_90a}
FLAGS="-std=c++17 -O3 -I. --expt-relaxed-constexpr -Xcompiler -fopenmp $ARCH"
ARCH="$ARCH -lgomp"  # the link line: the host reference runs under OpenMP
BIN=build/bwd_selftest

source tests/cuda/selftest_lib.sh
build_selftest $BIN build/bwd_obj "" src/cuda/backward.cu src/cuda/sm80/bwd_*.cu src/cuda/device_info.cu \
  tests/cuda/bwd_selftest.cu || exit 1

status=0
"$BIN" || status=1
echo "== timings per head-dim bucket"
"$BIN" time || status=1
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    echo "== compute-sanitizer --tool $tool (small cases)"
    compute-sanitizer --tool "$tool" --error-exitcode 3 "$BIN" small
    rc=$?
    echo "== $tool exit code $rc"
    [ $rc -eq 0 ] || status=1
  done
else
  echo "compute-sanitizer not found"
fi
exit $status
