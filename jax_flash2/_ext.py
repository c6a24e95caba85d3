"""Loads the compiled extension modules and registers their FFI targets.

The CPU module is always built; the CUDA module only where nvcc was found at
build time. Registration happens once, on first import of jax_flash2.
"""

from __future__ import annotations

import importlib

import jax

FORWARD_TARGET = "jax_flash2_attention_fwd"
BACKWARD_TARGET = "jax_flash2_attention_bwd"
# CUDA only: kvcache's append of new keys and values (src/cuda/kv_append.cu).
KV_APPEND_TARGET = "jax_flash2_kv_append"

# platform name as jax.ffi.register_ffi_target spells it -> extension module
_MODULES = {"cpu": "jax_flash2._cpu_ext", "CUDA": "jax_flash2._cuda_ext"}


def _load(module_name: str):
  try:
    return importlib.import_module(module_name)
  except ImportError:
    return None


cpu_ext = _load(_MODULES["cpu"])
cuda_ext = _load(_MODULES["CUDA"])

if cpu_ext is None:
  raise ImportError(
      "jax_flash2's compiled extension _cpu_ext is missing: install the package with "
      "`pip install .` (or run tools/build_inplace.sh for an in-tree build)."
  )

for _platform, _module in (("cpu", cpu_ext), ("CUDA", cuda_ext)):
  if _module is not None:
    for _name, _capsule in _module.registrations().items():
      jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)


def kernel_platforms() -> tuple[str, ...]:
  """Lowering platforms ("cpu", "cuda") that have compiled kernels."""
  return ("cpu",) + (("cuda",) if cuda_ext is not None else ())
