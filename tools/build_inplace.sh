#!/usr/bin/env bash
# Developer build: compiles the extensions with CMake into build/dev and copies
# them next to the Python sources, so `python -c "import jax_flash2"` works from
# the repository root without reinstalling. CUDA off unless JAX_FLASH2_CUDA=on.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DPython_EXECUTABLE="$(command -v python3)" \
  -DJAX_FLASH2_CUDA="${JAX_FLASH2_CUDA:-off}" >/dev/null
cmake --build build/dev
cp build/dev/_cpu_ext*.so jax_flash2/
if ls build/dev/_cuda_ext*.so >/dev/null 2>&1; then cp build/dev/_cuda_ext*.so jax_flash2/; fi
