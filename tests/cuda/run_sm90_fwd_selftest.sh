#!/bin/bash
# Builds (unless a carried build/sm90_fwd_selftest loads) and runs the Hopper
# forward self-test: smoke cases first, the full matrix, timings beside the
# sm80 forward, then compute-sanitizer memcheck and racecheck on small shapes.
# Meant for one device call (an H200; well under 5 minutes):
#   bash tests/cuda/run_sm90_fwd_selftest.sh
# Logs go to $OUT (or /tmp/sm90_fwd_selftest_out). REBUILD=1 forces a build,
# SANITIZE=0 skips the sanitizer runs, TIME=0 the timings, FILTER=str runs
# only the cases whose name contains str.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sm90_fwd_selftest_out}
mkdir -p "$OUT" build/sm90_obj
# wgmma and setmaxnreg need the arch-specific target (sm_90a), spelled with
# -gencode (HOPPER.md: the -arch=sm_90a shorthand also ran a plain sm_90 pass
# that rejects them on some nvcc versions).
ARCH=-gencode=arch=compute_90a,code=sm_90a
FLAGS="-std=c++17 -O3 -I. --expt-relaxed-constexpr $ARCH -DJF2_SM90_ALL_SCHEDULES=1"
BIN=build/sm90_fwd_selftest

build() {
  local pids=() f
  # The sm80 forward is linked too, for the side-by-side timings.
  for f in src/cuda/sm90/fwd_sm90_launch.cu src/cuda/fwd_launch.cu src/cuda/fwd_hdim*.cu \
           tests/cuda/sm90_fwd_selftest.cu; do
    local extra=""
    [ "$f" = src/cuda/sm90/fwd_sm90_launch.cu ] && extra="-Xptxas -v"
    nvcc $FLAGS $extra -c "$f" -o "build/sm90_obj/$(basename "$f" .cu).o" \
      2> "$OUT/build_$(basename "$f" .cu).log" &
    pids+=($!)
  done
  local ok=0
  for pid in "${pids[@]}"; do wait "$pid" || ok=1; done
  # Errors and warnings (ptxas -v info lines aside) go to the console.
  grep -hv "ptxas info\|bytes stack frame" "$OUT"/build_*.log
  [ $ok -eq 0 ] && nvcc $ARCH build/sm90_obj/*.o -o $BIN
}

if [ "${REBUILD:-0}" = 1 ] || ! $BIN --probe >/dev/null 2>&1; then
  echo "== building $BIN"
  SECONDS=0
  build || { echo "BUILD FAILED"; exit 1; }
  echo "== built in ${SECONDS}s"
  echo "ptxas, sm90 kernels (count, line):"
  grep -E "Used|spill|C75" "$OUT/build_fwd_sm90_launch.log" | sort | uniq -c
fi
if command -v cuobjdump >/dev/null; then
  cuobjdump --dump-sass build/sm90_obj/fwd_sm90_launch.o > "$OUT/fwd_sm90.sass" 2>&1
  echo "== SASS: $(grep -c HGMMA "$OUT/fwd_sm90.sass") HGMMA, $(grep -cE 'LDL|STL' "$OUT/fwd_sm90.sass") LDL/STL"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
rc=0
ARGS=()
[ -n "${FILTER:-}" ] && ARGS=(--filter "$FILTER")
# One process per schedule: a hang (reported as HANG by the binary's
# watchdog, which then exits) in one schedule does not hide the others.
for sch in serial overlap pingpong; do
  echo "== selftest, schedule $sch"
  timeout 90 $BIN --no-time --schedules $sch ${ARGS[@]+"${ARGS[@]}"} 2>&1 | tee "$OUT/selftest_$sch.log"
  rc=$((rc | PIPESTATUS[0]))
done
echo "== summary"
grep -h "^FAIL\|^HANG\|failure(s)" "$OUT"/selftest_*.log
if [ "${TIME:-1}" = 1 ]; then
  echo "== timings (median of 20; TFLOP/s = 4 B T S H D / t, halved when causal)"
  timeout 60 $BIN --time-only 2>&1 | tee "$OUT/timings.log"; rc=$((rc | PIPESTATUS[0]))
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  # --tiny: four small cases (causal + empty rows, GQA, window, bhtd) under
  # every schedule.
  echo "== memcheck (--tiny)"
  timeout 45 compute-sanitizer --tool memcheck --error-exitcode 3 $BIN --tiny 2>&1 | tee "$OUT/memcheck.log" | tail -8
  rc=$((rc | PIPESTATUS[0]))
  echo "== racecheck (--tiny)"
  timeout 45 compute-sanitizer --tool racecheck --error-exitcode 3 $BIN --tiny 2>&1 | tee "$OUT/racecheck.log" | tail -8
  rc=$((rc | PIPESTATUS[0]))
fi
echo "== exit status $rc"
exit $rc
