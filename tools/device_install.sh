#!/usr/bin/env bash
# Installs the package with CUDA on the GPU machine (its jax's headers, so
# --no-build-isolation), logging to $OUT/pip.log; the tools/*_suite.sh scripts source it.
# ARCHS sets the CUDA architectures (default 90a, the H200).
# Extensions prebuilt for this tree and this Python (tools/prebuild_for_device.sh,
# in .carry/ext/<stamp>) are used in place instead, the sources put on PYTHONPATH.
SECONDS=0
py_tag=$(python3 -c 'import sys; print(f"cpython-{sys.version_info[0]}{sys.version_info[1]}")')
prebuilt=.carry/ext/$(tools/ext_stamp.sh)
rm -f "$OUT/prebuilt.log"  # a suite reusing $OUT: only this attempt's error
if ls "$prebuilt"/_cuda_ext."$py_tag"-*.so >/dev/null 2>&1 && cp "$prebuilt"/*.so jax_flash2/ &&
   (cd /tmp && PYTHONPATH="$OLDPWD" python3 -c "import jax_flash2._cuda_ext") > "$OUT/prebuilt.log" 2>&1; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  echo "== prebuilt extensions ($prebuilt) in place"
else
  if [ -s "$OUT/prebuilt.log" ]; then
    echo "== prebuilt extensions do not import:"; tail -3 "$OUT/prebuilt.log"
  elif [ -d .carry/ext ]; then
    echo "== no prebuilt extensions for this tree ($prebuilt; carried: $(ls .carry/ext | tr '\n' ' '))"
  fi
  rm -f jax_flash2/_c*_ext.*.so  # none left to shadow the installed package
  JAX_FLASH2_CUDA=on JAX_FLASH2_CUDA_ARCHS=${ARCHS:-90a} CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    timeout 120 python3 -m pip install --no-build-isolation --no-deps . > "$OUT/pip.log" 2>&1 \
    || { echo "pip install failed"; tail -30 "$OUT/pip.log"; exit 1; }
  echo "== installed in ${SECONDS}s"
fi
