#!/bin/bash
# Builds (unless a carried build/fwd_selftest loads) and runs the CUDA forward
# self-test, then compute-sanitizer memcheck and racecheck on small shapes.
# One run on the GPU machine:  bash tests/cuda/run_fwd_selftest.sh
# Logs go to $OUT (or /tmp/fwd_selftest_out).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/fwd_selftest_out}
mkdir -p "$OUT"
ARCH=${ARCH:--gencode=arch=compute_90a,code=sm_90a}
FLAGS="-std=c++17 -O3 -I. --expt-relaxed-constexpr $ARCH"
BIN=build/fwd_selftest

source tests/cuda/selftest_lib.sh
build_selftest $BIN build/fwd_obj "" src/cuda/device_info.cu src/cuda/forward.cu \
  src/cuda/sm80/fwd_*.cu src/cuda/sm80/decode_kernel.cu \
  tests/cuda/fwd_selftest.cu || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rc=0
echo "== selftest"
$BIN 2>&1 | tee "$OUT/selftest.log"; rc=$((rc | PIPESTATUS[0]))
# The plan of a 99 KB GPU (cc 8.6 / 8.9): same sm_80 kernels, other tiles and
# stages (src/test_switches.h).
echo "== selftest with 101376 B of shared memory per block (--small)"
JAX_FLASH2_MAX_SMEM_PER_BLOCK=101376 $BIN --small 2>&1 | tee "$OUT/selftest_99kb.log"
rc=$((rc | PIPESTATUS[0]))
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
