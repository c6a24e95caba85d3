#!/usr/bin/env bash
# Builds the extensions here for the GPU machine's Python (3.12) into
# .carry/ext/<the sources' stamp> (tools/ext_stamp.sh), so that
# tools/device_install.sh copies them instead of building there (about 60 s
# of device time a fresh machine). Needs a Python 3.12 with jax and
# nanobind: PY312=/path/to/python3.12. The build is the one `pip install .`
# makes (jax 0.10's FFI headers), for ARCHS (default 90a).
# Use: PY312=... tools/prebuild_for_device.sh, then carry ".carry" in the call.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${PY312:?set PY312 to a Python 3.12 interpreter with jax and nanobind}"
cmake -S . -B build/py312 -G Ninja -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PY312" \
  -DJAX_FLASH2_CUDA=on -DJAX_FLASH2_CUDA_ARCHS="${ARCHS:-90a}" >/dev/null
cmake --build build/py312
out=.carry/ext/$(tools/ext_stamp.sh)
mkdir -p "$out"
cp build/py312/_cpu_ext*.so build/py312/_cuda_ext*.so "$out"/
echo "prebuilt into $out: $(ls "$out" | tr '\n' ' ')"
