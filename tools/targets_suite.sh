#!/usr/bin/env bash
# The tables the open speed targets are judged by, in one run of at most
# END seconds (default 570): the score options beside the plain path
# (OPTIONS=1; default on an H200 only), packed documents beside the same
# documents as a batch and beside cuDNN's packed layout, then the KV-cache
# decode rows (bfloat16, float8_e4m3fn, int8) once per split size in
# KV_SPLITS ("0" = the plan's rule; e.g. "0 4096" to compare). Each part is
# skipped when too little time is left for it. Tables go to $OUT.
#   bash tools/targets_suite.sh
set -u
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/targets_suite}
mkdir -p "$OUT"
END=${END:-570}
source tools/device_install.sh
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu"  # each table names its jax, commit and device
cd benchmarks
left() { echo $(( END - SECONDS )); }
options=${OPTIONS:-$([[ "$gpu" == *H200* ]] && echo 1 || echo 0)}
if [ "$options" = 1 ] && [ "$(left)" -gt 300 ]; then
  echo "== options at ${SECONDS}s"
  timeout 200 python3 options_bench.py --seqlens 4096 8192 16384 --warmup-s 0.2 --iters 3 \
    --only "softcap 50" ALiBi "dropout 0.1" --no-cudnn --out "$OUT/options.md" 2>&1 | grep "^| [0-9]"
fi
if [ "$(left)" -gt 280 ]; then
  echo "== packed at ${SECONDS}s"
  timeout $(( $(left) - 180 )) python3 packed_bench.py --cases "${CASES:-8x2048,64x256,mixed}" \
    --head-dims 128,64 --warmup-s 0.2 --out "$OUT/packed.md" 2>&1 | grep "^| \|^- "
fi
rows="16:uniform:64 64:uniform:64 16:uniform:0 1:uniform:0"
for split in ${KV_SPLITS:-0}; do
  [ "$(left)" -lt 80 ] && break
  echo "== KV cache, JAX_FLASH2_KV_SPLIT_KEYS=$split at ${SECONDS}s"
  JAX_FLASH2_KV_SPLIT_KEYS=$split timeout "$(left)" python3 kvcache_bench.py --rows $rows \
    --dtypes bfloat16 float8_e4m3fn int8 --dtype-rows $rows --steps 20 --warmup 0.2 \
    --no-baselines --out "$OUT/kv_split$split.md" 2>&1 | grep "^| [0-9]"
done
echo "== done at ${SECONDS}s"
