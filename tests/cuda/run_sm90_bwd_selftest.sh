#!/bin/bash
# Builds (unless a carried build/sm90_bwd_selftest loads) and runs the Hopper
# backward self-test: the case matrix against the float64 oracle, timings
# beside the sm80 backward, then compute-sanitizer memcheck and racecheck on
# tiny cases. One run on an H200 (under 4 minutes):
#   bash tests/cuda/run_sm90_bwd_selftest.sh
# Logs go to $OUT (or /tmp/sm90_bwd_selftest_out). REBUILD=1 forces a build,
# SANITIZE=0 skips the sanitizer runs, TIME=0 the timings, FILTER=str runs
# only the cases whose name contains str (FILTER=opt: softcap and ALiBi,
# FILTER=drop: dropout; the sanitizers' --tiny set has cases of both, and
# the timings rows of dropout beside the plain kernel, B2 T8k).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sm90_bwd_selftest_out}
mkdir -p "$OUT"
# wgmma and setmaxnreg need the arch-specific target (sm_90a), spelled with
# -gencode (see run_sm90_fwd_selftest.sh).
ARCH=-gencode=arch=compute_90a,code=sm_90a
# -lineinfo (same SASS) lets the sanitizers name file:line for each access.
FLAGS="-std=c++17 -O3 -I. --expt-relaxed-constexpr -lineinfo $ARCH"
BIN=build/sm90_bwd_selftest

source tests/cuda/selftest_lib.sh
# The sm80 backward is linked too (without JF2_HAVE_SM90, so RunBackward is
# the sm80 path), for the side-by-side timings.
build_selftest $BIN build/sm90_bwd_obj src/cuda/sm90/bwd_sm90_launch.cu \
  src/cuda/sm90/bwd_sm90_launch.cu src/cuda/device_info.cu src/cuda/backward.cu \
  src/cuda/sm80/bwd_*.cu \
  tests/cuda/sm90_bwd_selftest.cu || exit 1
sass_summary build/sm90_bwd_obj/bwd_sm90_launch.o
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rc=0
ARGS=()
[ -n "${FILTER:-}" ] && ARGS=(--filter "$FILTER")
echo "== selftest"
# The binary's watchdog reports a hung kernel as HANG and exits; timeout is
# the backstop.
timeout 120 $BIN --no-time ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee "$OUT/selftest.log"
rc=$((rc | PIPESTATUS[0]))
echo "== summary"
grep -h "^FAIL\|^HANG\|failure(s)" "$OUT/selftest.log"
if [ "${TIME:-1}" = 1 ]; then
  echo "== timings (median of 15; TFLOP/s = 2.5 * 4 B T S H D / t, halved when causal)"
  timeout 60 $BIN --time-only 2>&1 | tee "$OUT/timings.log"; rc=$((rc | PIPESTATUS[0]))
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  echo "== memcheck (--tiny)"
  timeout 45 compute-sanitizer --tool memcheck --error-exitcode 3 $BIN --tiny 2>&1 | tee "$OUT/memcheck.log" | tail -8
  rc=$((rc | PIPESTATUS[0]))
  echo "== racecheck (--tiny)"
  # The whole report, unlimited: the analysis pairs (both sides of each
  # race, file:line through -lineinfo) and every per-thread hazard, into
  # racecheck.log; a tail of it showed only the read side of the D = 64
  # hazards. The console gets every pair line and the summary (the per-thread
  # lines can run to thousands; they stay in the file).
  timeout 90 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 0 \
    --error-exitcode 3 $BIN --tiny > "$OUT/racecheck.log" 2>&1
  rc=$((rc | $?))
  if grep -q "Race reported" "$OUT/racecheck.log"; then
    grep -A2 "Race reported" "$OUT/racecheck.log" | head -300
    grep -E "SUMMARY|failure\(s\)|^FAIL" "$OUT/racecheck.log"
  else
    head -150 "$OUT/racecheck.log"  # no pair lines: clean, or a format this grep misses
  fi
  echo "racecheck.log: $(wc -l < "$OUT/racecheck.log") lines"
fi
echo "== exit status $rc"
exit $rc
