"""jax_flash2.plan: which kernel, tile and grid a call runs on a given GPU, and why.

The answer comes from the same C++ functions the CUDA launch code runs
(src/plan.h), compiled into the CPU extension, so it needs no GPU and cannot
disagree with what the kernels do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jax_flash2 import _ext
from jax_flash2._config import make_config

# Opt-in shared memory per block of each compute capability's GPUs (bytes):
# A100 163 KB; A10 / RTX 30xx / L4 / L40 / RTX 40xx 99 KB; Jetson Orin 163 KB;
# H100 / H200 227 KB.
MAX_SMEM_PER_BLOCK = {
    (8, 0): 166912,
    (8, 6): 101376,
    (8, 7): 166912,
    (8, 9): 101376,
    (9, 0): 232448,
}

_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 1}


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """One direction's plan.

  kernel: "sm90" (Hopper), "sm80-prefill", "sm80-decode" (forward), "sm80"
    (backward), "cpu", or "unsupported".
  reason: for "unsupported", why (the error the call raises); otherwise why a
    faster kernel does not serve the call (e.g. "softcap: the Hopper forward
    does not serve it"); "" when the call runs the first choice.
  head_dim_bucket: the kernel's compile-time head dim (D rounded up).
  tile: the sm80 kernels' tile sizes (block_m, block_n, warps, ...); None for
    the Hopper kernels, whose tile tables live with them (src/cuda/sm90/).
  grid: the sm80 kernel's grid (x, y, z); None for the Hopper kernels.
  splits: key-range splits (split-KV forward) or dQ slices (deterministic
    backward).
  smem_bytes: the sm80 kernel's shared memory per block.
  """

  kernel: str
  reason: str = ""
  head_dim_bucket: int | None = None
  tile: dict[str, Any] | None = None
  grid: tuple[int, int, int] | None = None
  splits: int = 1
  smem_bytes: int = 0


def _kernel_plan(d: dict) -> KernelPlan:
  sm80 = d["kernel"].startswith("sm80")
  return KernelPlan(kernel=d["kernel"], reason=d["reason"],
                    head_dim_bucket=d["bucket"] or None,
                    tile=dict(d["tile"]) if sm80 else None,
                    grid=tuple(d["grid"]) if sm80 else None,
                    splits=int(d["splits"]), smem_bytes=int(d["smem_bytes"]) if sm80 else 0)


def plan(q, k, v, *, compute_capability: tuple[int, int] | None = (9, 0), sm_count: int = 132,
         max_smem_per_block: int | None = None, **options) -> dict[str, KernelPlan]:
  """The kernels flash_attention(q, k, v, **options) runs on a given GPU.

  Args:
    q, k, v: arrays or jax.ShapeDtypeStruct, as for flash_attention.
    compute_capability: (major, minor) of the GPU; None for the CPU kernels.
    sm_count: its multiprocessors (the split-KV count depends on them).
    max_smem_per_block: its opt-in shared memory per block in bytes; by
      default that of the compute capability's GPUs (MAX_SMEM_PER_BLOCK).
    **options: flash_attention's options (causal, window_size, softcap,
      alibi_slopes, segment_ids, deterministic, dropout_rate, ...), checked as
      flash_attention checks them.

  Returns:
    {"forward": KernelPlan, "backward": KernelPlan}.
  """
  if options.get("dropout_rate", 0.0) and options.get("dropout_rng") is None:
    options = dict(options, dropout_rng=np.zeros(2, np.uint32))  # the plan needs no key
  options.pop("return_lse", None)
  config = make_config(q, k, v, **options)
  if compute_capability is None:
    cpu = KernelPlan(kernel="cpu")
    return {"forward": cpu, "backward": cpu}
  major, minor = (int(x) for x in compute_capability)
  if max_smem_per_block is None:
    if (major, minor) not in MAX_SMEM_PER_BLOCK:
      raise ValueError(
          f"jax_flash2.plan: no known shared-memory size for compute capability "
          f"{major}.{minor}; pass max_smem_per_block (one of {sorted(MAX_SMEM_PER_BLOCK)} "
          "is known)")
    max_smem_per_block = MAX_SMEM_PER_BLOCK[(major, minor)]
  batch, seqlen_q, heads_q, head_dim = q.shape
  seqlen_k, heads_kv = k.shape[1:3]
  dtype = _DTYPES.get(np.dtype(q.dtype), 2)  # bfloat16 otherwise
  have_sm90 = _ext.cuda_ext.has_sm90() if _ext.cuda_ext is not None else True
  out = {}
  for direction, backward in (("forward", False), ("backward", True)):
    d = _ext.cpu_ext.plan(
        backward=backward, dtype=dtype, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
        window_left=config.window_left, window_right=config.window_right,
        softcap=config.softcap, has_alibi=config.has_alibi,
        has_segment_ids=config.has_segment_ids, dropout_rate=config.dropout_rate,
        deterministic=bool(config.deterministic and backward), cc_major=major, cc_minor=minor,
        sm_count=int(sm_count), max_smem_per_block=int(max_smem_per_block),
        have_sm90=have_sm90)
    out[direction] = _kernel_plan(d)
  return out
