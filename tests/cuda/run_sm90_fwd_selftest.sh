#!/bin/bash
# Builds (unless a carried build/sm90_fwd_selftest loads) and runs the Hopper
# forward self-test: smoke cases first, the full matrix, timings beside the
# sm80 forward, then compute-sanitizer memcheck and racecheck on small shapes.
# One run on an H200 (well under 5 minutes):
#   bash tests/cuda/run_sm90_fwd_selftest.sh
# Logs go to $OUT (or /tmp/sm90_fwd_selftest_out). REBUILD=1 forces a build,
# SANITIZE=0 skips the sanitizer runs, TIME=0 the timings, FILTER=str runs
# only the cases whose name contains str (FILTER=opt: softcap and ALiBi,
# FILTER=drop: dropout; the sanitizers' --tiny set has cases of both, and
# the timings rows of dropout beside the plain kernel, B2 T8k).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sm90_fwd_selftest_out}
mkdir -p "$OUT"
# wgmma and setmaxnreg need the arch-specific target (sm_90a), spelled with
# -gencode (the -arch=sm_90a shorthand also runs a plain sm_90 pass that
# rejects them on some nvcc versions).
ARCH=-gencode=arch=compute_90a,code=sm_90a
FLAGS="-std=c++17 -O3 -I. --expt-relaxed-constexpr $ARCH"
BIN=build/sm90_fwd_selftest

source tests/cuda/selftest_lib.sh
# The sm80 forward is linked too, for the side-by-side timings.
build_selftest $BIN build/sm90_obj src/cuda/sm90/fwd_sm90_launch.cu \
  src/cuda/sm90/fwd_sm90_launch.cu src/cuda/device_info.cu src/cuda/forward.cu \
  src/cuda/sm80/fwd_*.cu src/cuda/sm80/decode_kernel.cu \
  tests/cuda/sm90_fwd_selftest.cu || exit 1
sass_summary build/sm90_obj/fwd_sm90_launch.o
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rc=0
ARGS=()
[ -n "${FILTER:-}" ] && ARGS=(--filter "$FILTER")
# One process per schedule: a hang (reported as HANG by the binary's
# watchdog, which then exits) in one schedule does not hide the others.
for sch in serial overlap pingpong; do
  echo "== selftest, schedule $sch"
  timeout 180 $BIN --no-time --schedules $sch ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee "$OUT/selftest_$sch.log"
  rc=$((rc | PIPESTATUS[0]))
done
echo "== summary"
grep -h "^FAIL\|^HANG\|failure(s)" "$OUT"/selftest_*.log
if [ "${TIME:-1}" = 1 ]; then
  echo "== timings (median of 20; TFLOP/s = 4 B T S H D / t, halved when causal)"
  timeout 120 $BIN --time-only 2>&1 | tee "$OUT/timings.log"; rc=$((rc | PIPESTATUS[0]))
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  # --tiny: four small cases (causal + empty rows, GQA, window, bhtd) under
  # every schedule.
  echo "== memcheck (--tiny)"
  timeout 90 compute-sanitizer --tool memcheck --error-exitcode 3 $BIN --tiny 2>&1 | tee "$OUT/memcheck.log" | tail -8
  rc=$((rc | PIPESTATUS[0]))
  echo "== racecheck (--tiny)"
  timeout 90 compute-sanitizer --tool racecheck --error-exitcode 3 $BIN --tiny 2>&1 | tee "$OUT/racecheck.log" | tail -8
  rc=$((rc | PIPESTATUS[0]))
fi
echo "== exit status $rc"
exit $rc
