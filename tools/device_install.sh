#!/usr/bin/env bash
# Installs the package with CUDA on the GPU machine (its jax's headers, so
# --no-build-isolation), logging to $OUT/pip.log; the tools/*_suite.sh scripts source it.
# ARCHS sets the CUDA architectures (default 90a, the H200).
SECONDS=0
JAX_FLASH2_CUDA=on JAX_FLASH2_CUDA_ARCHS=${ARCHS:-90a} CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  timeout 120 python3 -m pip install --no-build-isolation --no-deps . > "$OUT/pip.log" 2>&1 \
  || { echo "pip install failed"; tail -30 "$OUT/pip.log"; exit 1; }
echo "== installed in ${SECONDS}s"
