#!/usr/bin/env bash
# One run on the 2-GPU H200 host that checks and measures everything
# at once, each GPU busy with one thing at a time so timings are their own:
#   GPU 1: Hopper backward self-test, then the benchmark grid (+ decode)
#   GPU 0: the pytest suite, then train_lm.py --compare on one GPU
#   both:  train_lm.py --compare data-parallel on two GPUs
# Every step has a timeout; the whole stays under 10 minutes. Logs, tables
# and JSON go to $OUT.
#   bash tools/h200x2_suite.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200x2_suite}
mkdir -p "$OUT"

source tools/device_install.sh

(
  export CUDA_VISIBLE_DEVICES=1
  OUT=/tmp/sm90_bwd timeout ${SELFTEST_TIMEOUT:-200} bash tests/cuda/run_sm90_bwd_selftest.sh \
    > "$OUT/sm90_bwd_selftest.log" 2>&1
  echo "sm90 backward self-test exit $?" >> "$OUT/sm90_bwd_selftest.log"
  (cd benchmarks && timeout ${BENCH_TIMEOUT:-210} python3 gpu_bench.py --xla-max-seqlen 0 \
    --seqlens ${BENCH_SEQLENS:-1024 4096 16384} --out "$OUT/h200.md" > "$OUT/bench.log" 2>&1)
) &
gpu1=$!

(cd tests && CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false \
  timeout ${TEST_TIMEOUT:-250} python3 -m pytest -v -rfE -p no:cacheprovider -n 16 . \
  > "$OUT/pytest.log" 2>&1)
grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest.log" | grep -v "^\[gw.*PASSED" | tail -30
echo "== tests done at ${SECONDS}s"

MODEL=(--seq-len 2048 --dim 1024 --heads 16 --kv-heads 4 --layers 4 --batch 16
       --steps "${STEPS:-20}" --log-every 10 --dtype bfloat16 --compare)
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 examples/train_lm.py "${MODEL[@]}" \
  --json-out "$OUT/train_1gpu.json" > "$OUT/train_1gpu.log" 2>&1
echo "== train 1 GPU exit $? at ${SECONDS}s"
wait $gpu1
echo "== GPU 1 jobs done at ${SECONDS}s"
CUDA_VISIBLE_DEVICES=0,1 timeout 100 python3 examples/train_lm.py "${MODEL[@]}" \
  --json-out "$OUT/train_2gpu.json" > "$OUT/train_2gpu.log" 2>&1
echo "== train 2 GPUs exit $? at ${SECONDS}s"

grep -E "^(FAIL|HANG|PASS.*worst)|ALL PASSED|failure|TIME|SUMMARY|exit|Used|spill" \
  "$OUT/sm90_bwd_selftest.log" | head -40
grep -E "^\|" "$OUT/h200.md" 2>/dev/null || tail -5 "$OUT/bench.log"
for n in 1 2; do
  grep -E "flash kernels|device\(s\):|loss curves|tokens/s|peak MiB|Error" "$OUT/train_${n}gpu.log"
done
