#!/usr/bin/env bash
# Developer build: compiles the extensions with CMake into build/dev and copies
# them next to the Python sources, so `python -c "import jax_flash2"` works from
# the repository root without reinstalling. CUDA off unless JAX_FLASH2_CUDA=on;
# JAX_FLASH2_CUDA_ARCHS as for pip. PYTHON, BUILD_DIR and DEST build for another
# interpreter into another folder (tools/prebuild_for_device.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build/dev}
dest=${DEST:-jax_flash2}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="${PYTHON:-$(command -v python3)}" \
  -DJAX_FLASH2_CUDA="${JAX_FLASH2_CUDA:-off}" \
  ${JAX_FLASH2_CUDA_ARCHS:+-DJAX_FLASH2_CUDA_ARCHS="$JAX_FLASH2_CUDA_ARCHS"} >/dev/null
cmake --build "$build"
mkdir -p "$dest"
cp "$build"/_cpu_ext*.so "$dest"/
if ls "$build"/_cuda_ext*.so >/dev/null 2>&1; then cp "$build"/_cuda_ext*.so "$dest"/; fi
