#!/usr/bin/env bash
# The multi-GPU checks and measurements on the 2-GPU host, in one run on the GPU machine:
#   bash tools/multi_gpu_suite.sh     (logs, JSON and the table under $OUT)
# a. install with CUDA for sm_90a
# b. tests/multi_device_checks.py on both GPUs (bf16 inputs), and, at the same
#    time (neither is timed), c. the Flax, export and training-example tests on
#    GPU 0
# d. examples/train_lm.py --compare (flash, then jax.nn.dot_product_attention,
#    each in its own process) on 1 GPU and on 2 GPUs; the flash process is the
#    plain run (the same command without --compare, plus --attention flash)
# e. benchmarks/results/h200x2.md from d's JSON, copied to $OUT
# Every step has a timeout (120 + 150 + 2 x 105 s at most, so the whole stays
# within 8 minutes); a step that fails is reported and the others still run;
# the exit status is 1 if any failed. STEPS sets the training steps (default 30).
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/multi_gpu_suite}
mkdir -p "$OUT"
failed=""

source tools/device_install.sh
nvidia-smi -L
# From /tmp: `python3 -c` puts the cwd first on sys.path, and the source tree has
# no built extension.
(cd /tmp && python3 -c "import jax, jax_flash2
print('jax', jax.__version__, jax.devices(), jax_flash2.kernel_info())")

# b and c share the GPUs: no preallocation, or one finds the memory taken. The
# scripts run from tests/ and examples/, so the installed package is imported.
SECONDS=0
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 \
  python3 tests/multi_device_checks.py --platform gpu --devices 2 \
  > "$OUT/multi_device_checks.log" 2>&1 &
checks=$!
# pytest-xdist workers when it is installed.
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-4}")
(cd tests && CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 \
  python3 -m pytest -q -p no:cacheprovider $workers \
  test_flax.py test_export.py test_train_example.py > "$OUT/pytest_gpu.log" 2>&1) \
  || failed="$failed pytest"
wait "$checks" || failed="$failed multi_device_checks"
echo "== multi_device_checks on 2 GPUs (full log: multi_device_checks.log)"
grep -E "^(PASS|FAIL|SKIP) |^[0-9]+ passed|devices\)|x NVIDIA" "$OUT/multi_device_checks.log" | cut -c1-220
echo "== pytest test_flax.py test_export.py test_train_example.py on 1 GPU (pytest_gpu.log)"
tail -8 "$OUT/pytest_gpu.log"
echo "== b and c in ${SECONDS}s"

# d: alone on the GPUs, so the timings are their own.
MODEL=(--seq-len 2048 --dim 1024 --heads 16 --kv-heads 4 --layers 4 --batch 16
       --steps "${STEPS:-30}" --log-every 10 --dtype bfloat16)
for n in 1 2; do
  SECONDS=0
  devices=$([ "$n" = 1 ] && echo 0 || echo 0,1)
  echo "== train_lm.py --compare on $n GPU(s) (train_${n}gpu.log)"
  CUDA_VISIBLE_DEVICES=$devices timeout 105 python3 examples/train_lm.py "${MODEL[@]}" \
    --compare --json-out "$OUT/train_${n}gpu.json" > "$OUT/train_${n}gpu.log" 2>&1 \
    || failed="$failed train_${n}gpu"
  grep -E "flash kernels|device\(s\):|loss curves|tokens/s  |peak MiB|Error" "$OUT/train_${n}gpu.log"
  echo "   (${SECONDS}s)"
done

mkdir -p benchmarks/results
python3 benchmarks/multi_gpu_table.py "$OUT/train_1gpu.json" "$OUT/train_2gpu.json" \
  --checks "$OUT/multi_device_checks.log" --out benchmarks/results/h200x2.md \
  --command "bash tools/multi_gpu_suite.sh  # train_lm.py ${MODEL[*]} --compare" \
  || failed="$failed table"
cp benchmarks/results/h200x2.md "$OUT/" 2>/dev/null

if [ -n "$failed" ]; then
  echo "== FAILED:$failed"
  exit 1
fi
echo "== all passed"
