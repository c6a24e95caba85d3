#!/bin/bash
# Packed sequences (segment ids) on the Hopper kernels, in one run on the GPU machine:
# builds the package and the Hopper self-tests at once, then runs the
# self-tests (the segment-id pre-pass against its CPU model, the kernels'
# segment-id cases and the plain matrix), compute-sanitizer memcheck and
# racecheck on them (--tiny), tests/test_packed_gpu.py, and
# benchmarks/packed_bench.py. Summaries go to the console; every log into
# $OUT/packed_logs.tgz.
#   bash tests/cuda/run_sm90_packed.sh
# STEPS picks the steps (default "selftest sanitize pytest bench");
# BENCH_ARGS are passed to packed_bench.py, PYTEST_FILES (default
# test_packed_gpu.py test_gpu_paths.py) and PYTEST_ARGS (e.g. "-n 8") to
# pytest, SANITIZE_TOOLS (default "memcheck racecheck") to the sanitize step.

set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/sm90_packed_out}
LOGS=/tmp/sm90_packed_logs
rm -rf "$LOGS"
mkdir -p "$OUT" "$LOGS"/pkg "$LOGS"/fwd "$LOGS"/bwd build
STEPS=${STEPS:-selftest sanitize pytest bench}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SECONDS=0
ARCH=-gencode=arch=compute_90a,code=sm_90a
source tests/cuda/selftest_lib.sh

nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
# Builds, in parallel.
(OUT=$LOGS/pkg ARCHS=90a TIME=0 bash tools/device_install.sh > "$LOGS/pkg/install.txt" 2>&1) &
pkg_pid=$!
need_selftests=0
[[ $STEPS == *selftest* || $STEPS == *sanitize* ]] && need_selftests=1
[ $need_selftests = 1 ] && (
  OUT=$LOGS/fwd FLAGS="-std=c++17 -O3 -I. --expt-relaxed-constexpr -lineinfo $ARCH"
  REBUILD=1 build_selftest build/sm90_fwd_selftest build/sm90_fwd_obj \
    src/cuda/sm90/fwd_sm90_launch.cu src/cuda/sm90/fwd_sm90_launch.cu src/cuda/device_info.cu \
    src/cuda/forward.cu src/cuda/sm80/fwd_*.cu src/cuda/sm80/decode_kernel.cu \
    tests/cuda/sm90_fwd_selftest.cu
) > "$LOGS/fwd/build.txt" 2>&1 &
fwd_pid=$!
[ $need_selftests = 1 ] && (
  OUT=$LOGS/bwd FLAGS="-std=c++17 -O3 -I. --expt-relaxed-constexpr -lineinfo $ARCH"
  REBUILD=1 build_selftest build/sm90_bwd_selftest build/sm90_bwd_obj \
    src/cuda/sm90/bwd_sm90_launch.cu src/cuda/sm90/bwd_sm90_launch.cu src/cuda/device_info.cu \
    src/cuda/backward.cu src/cuda/sm80/bwd_*.cu tests/cuda/sm90_bwd_selftest.cu
) > "$LOGS/bwd/build.txt" 2>&1 &
bwd_pid=$!
if [ $need_selftests = 1 ]; then
  nvcc -std=c++17 -O3 -I. -lineinfo $ARCH tests/cuda/sm90_prepass_selftest.cu \
    -o build/sm90_prepass_selftest > "$LOGS/prepass_build.txt" 2>&1
  echo "== pre-pass self-test built (rc $?)"
fi
if [[ $STEPS == *selftest* ]] && [ -x build/sm90_prepass_selftest ]; then
  timeout 60 build/sm90_prepass_selftest > "$LOGS/prepass_selftest.txt" 2>&1
  echo "-- pre-pass self-test: rc $?"; grep -E "^FAIL|^TIME|failure\(s\)" "$LOGS/prepass_selftest.txt"
fi

rc=0
wait $bwd_pid; b_rc=$?
echo "== bwd self-test built (rc $b_rc) at ${SECONDS}s"; grep -E "Used|spill|error|FAILED" "$LOGS/bwd/build.txt" | sort | uniq -c | head -20
if [ $b_rc = 0 ] && [[ $STEPS == *selftest* ]]; then
  timeout 150 build/sm90_bwd_selftest --no-time > "$LOGS/bwd/selftest.txt" 2>&1 &
  bwd_run=$!
fi
wait $fwd_pid; f_rc=$?
echo "== fwd self-test built (rc $f_rc) at ${SECONDS}s"; grep -E "Used|spill|error|FAILED" "$LOGS/fwd/build.txt" | sort | uniq -c | head -20
if [ $f_rc = 0 ] && [[ $STEPS == *selftest* ]]; then
  (for sch in pingpong overlap; do
     timeout 120 build/sm90_fwd_selftest --no-time --schedules $sch > "$LOGS/fwd/selftest_$sch.txt" 2>&1
   done) &
  fwd_run=$!
fi
wait $pkg_pid; p_rc=$?
echo "== package installed (rc $p_rc) at ${SECONDS}s"; tail -n 3 "$LOGS/pkg/install.txt"
[ $p_rc != 0 ] && tail -n 40 "$LOGS/pkg/pip.log"

if [[ $STEPS == *pytest* ]] && [ $p_rc = 0 ]; then
  echo "== pytest tests/test_packed_gpu.py"
  (cd tests && timeout "${PYTEST_TIMEOUT:-200}" python3 -m pytest -q -rfE -p no:cacheprovider ${PYTEST_ARGS:-} \
     --tb=short ${PYTEST_FILES:-test_packed_gpu.py test_gpu_paths.py}) > "$LOGS/pytest.txt" 2>&1 &
  py_run=$!
fi
for pid_name in bwd_run fwd_run py_run; do
  if [ -n "${!pid_name:-}" ]; then wait "${!pid_name}"; rc=$((rc | $?)); fi
done
echo "== correctness runs done at ${SECONDS}s (rc $rc)"
if [ -f "$LOGS/bwd/selftest.txt" ]; then
  echo "-- bwd self-test:"; grep -E "^FAIL|^HANG|failure\(s\)" "$LOGS/bwd/selftest.txt" | head -20
  echo "   PASS lines: $(grep -c '^PASS' "$LOGS/bwd/selftest.txt"), seg PASS: $(grep -c '^PASS seg' "$LOGS/bwd/selftest.txt")"
fi
for sch in pingpong overlap; do
  f="$LOGS/fwd/selftest_$sch.txt"
  [ -f "$f" ] || continue
  echo "-- fwd self-test $sch: PASS $(grep -c '^PASS' "$f"), seg PASS $(grep -c '^PASS seg' "$f"), FAIL/HANG:"
  grep -E "^FAIL|^HANG" "$f" | head -12
  grep -A3 "^FAIL seg" "$f" | head -20
  tail -n 2 "$f"
done
if [ -f "$LOGS/pytest.txt" ]; then
  echo "-- pytest:"; grep -E "^(FAILED|ERROR)|passed|failed|Error" "$LOGS/pytest.txt" | head -30
  tail -n 3 "$LOGS/pytest.txt"
fi

if [[ $STEPS == *sanitize* ]]; then
  for t in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    for bin in sm90_prepass_selftest sm90_bwd_selftest sm90_fwd_selftest; do
      [ -x build/$bin ] || continue
      extra="--tiny"; [ $bin = sm90_fwd_selftest ] && extra="--tiny --schedules pingpong"
      [ $bin = sm90_prepass_selftest ] && extra="--no-time"
      timeout "${SANITIZE_TIMEOUT:-45}" compute-sanitizer --tool $t --error-exitcode 3 build/$bin $extra \
        > "$LOGS/${bin}_$t.txt" 2>&1
      echo "== $t $bin: rc $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/${bin}_$t.txt" | head -1) PASS $(grep -c '^PASS' "$LOGS/${bin}_$t.txt") FAIL $(grep -c '^FAIL' "$LOGS/${bin}_$t.txt")"
    done
  done
fi

if [[ $STEPS == *bench* ]] && [ $p_rc = 0 ]; then
  echo "== packed_bench at ${SECONDS}s"
  (cd benchmarks && timeout "${BENCH_TIMEOUT:-240}" python3 packed_bench.py ${BENCH_ARGS:-}) 2>&1 \
    | tee "$LOGS/bench.txt" | grep -v "^W0000\|^I0000"
fi
echo "== done at ${SECONDS}s"
tar -czf "$OUT/packed_logs.tgz" -C /tmp sm90_packed_logs
exit $rc
