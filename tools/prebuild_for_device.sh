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
dest=.carry/ext/$(tools/ext_stamp.sh)
PYTHON="$PY312" BUILD_DIR=build/py312 DEST="$dest" JAX_FLASH2_CUDA=on \
  JAX_FLASH2_CUDA_ARCHS="${ARCHS:-90a}" tools/build_inplace.sh
echo "prebuilt into $dest: $(ls "$dest" | tr '\n' ' ')"
