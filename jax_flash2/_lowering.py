"""FFI lowering of the primitives per platform; scalars as typed FFI attributes.

float32 on CUDA: the CUDA kernels take 16-bit inputs, so a float32 call lowers
to _blockwise.forward / backward instead, plain JAX over blocks of query rows
(O(T) memory, no T x S tensor) whose matmuls follow jax.default_matmul_precision
(TF32 tensor cores by default on Ampere and later, float32-accurate under
'highest'). A CPU-only build serves float32 on CUDA the same way. Otherwise a
platform without compiled kernels (CUDA in a CPU-only build) raises
NotImplementedError when the computation is compiled, naming the alternative.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.interpreters import mlir

from jax_flash2 import _blockwise, _ext
from jax_flash2._config import ExtraOperands

# Test-only switch: lower float32 calls on CPU by the blockwise path too, so
# that CPU tests cover what float32 on CUDA runs. Read at lowering time (clear
# jax's caches around a change).
_BLOCKWISE_FLOAT32_ON_CPU = False


def _attributes(config) -> dict:
  return dict(
      softmax_scale=np.float32(config.softmax_scale),
      window_left=np.int64(config.window_left),
      window_right=np.int64(config.window_right),
      softcap=np.float32(config.softcap),
      has_alibi=np.bool_(config.has_alibi),
      has_segment_ids=np.bool_(config.has_segment_ids),
      dropout_rate=np.float32(config.dropout_rate),
      has_kv_seqlens=np.bool_(config.has_kv_seqlens),
      page_size=np.int64(config.page_size),
  )


def _without_unused_inputs(ctx, args, config):
  """The extra operands (ALiBi slopes, the two segment ids, dropout seeds)
  that the call does not read become zero-size constants, so that XLA
  computes nothing for them: their zero fills cost a kernel launch each
  (about 2 us apiece on the H200)."""
  core_args, extra_args = ExtraOperands.split(args)
  core_avals, extra_avals = ExtraOperands.split(ctx.avals_in)
  args, avals = list(core_args), list(core_avals)
  for arg, aval, used in zip(extra_args, extra_avals, ExtraOperands.used(config)):
    if not used:
      arg = mlir.ir_constant(np.zeros((0,), aval.dtype))
      aval = jax.core.ShapedArray((0,), aval.dtype)
    args.append(arg)
    avals.append(aval)
  return ctx.replace(avals_in=avals), args


def _blockwise_rule(backward: bool):
  """Lowers a primitive to its plain-JAX blockwise twin (same operands, same
  results); the matmul precision is jax's default, set by the caller's
  jax.default_matmul_precision."""
  fn = _blockwise.backward if backward else _blockwise.forward

  def blockwise(*args, config):
    core, extras = ExtraOperands.split(args)
    return fn(*core, extras, config)

  def rule(ctx, *args, config):
    return mlir.lower_fun(functools.partial(blockwise, config=config),
                          multiple_results=True)(ctx, *args)

  return rule


def _cpu_rule(target: str, backward: bool):
  ffi_rule = jax.ffi.ffi_lowering(target)
  blockwise_rule = _blockwise_rule(backward)

  def rule(ctx, *args, config):
    if (_BLOCKWISE_FLOAT32_ON_CPU and ctx.avals_in[0].dtype == np.float32
        and not config.has_kv_seqlens):
      return blockwise_rule(ctx, *args, config=config)
    ctx, args = _without_unused_inputs(ctx, args, config)
    return ffi_rule(ctx, *args, **_attributes(config))

  return rule


def _gpu_plan() -> tuple[int, int]:
  """(multiprocessors, compute capability major) the workspace is sized for:
  the split-KV plan depends on the first, and only cc 9.x runs the Hopper
  kernels, whose stream-K slots take up to ~17 MB more. The largest count of
  the local GPUs; 9 when any of them is a 9.x, since the workspace must cover
  every device the executable runs on (the sm80 kernels need no more)."""
  try:
    devices = jax.local_devices(backend="gpu")
  except RuntimeError:  # lowering for CUDA without a local GPU (jax.export)
    devices = []
  counts = [getattr(d, "core_count", 0) or 0 for d in devices]
  majors = [int(str(getattr(d, "compute_capability", "0")).split(".")[0] or 0)
            for d in devices]
  # Without a GPU to ask, plan for an H100/H200 (132 SMs, cc 9.0): the plan
  # only sets how much scratch the call gets, never correctness.
  sm_count = max(counts, default=0) or 132
  cc_major = 9 if 9 in majors or not any(majors) else max(majors)
  return sm_count, cc_major


def _cuda_rule(target: str, backward: bool):
  ffi_rule = jax.ffi.ffi_lowering(target)
  blockwise_rule = _blockwise_rule(backward)

  def rule(ctx, *args, config):
    if ctx.avals_in[0].dtype == np.float32:
      if config.has_kv_seqlens:  # the blockwise path has no per-sequence lengths
        raise NotImplementedError(
            "jax_flash2: a KV-cache call in float32 has no CUDA kernel; use bfloat16/float16 "
            "or implementation='reference'")
      return blockwise_rule(ctx, *args, config=config)
    # Only the backward's dQ sum has an order to fix (the forward has no atomics).
    deterministic = bool(config.deterministic and backward)
    shapes = [aval.shape for aval in ctx.avals_in[:2]]
    if not all(isinstance(d, int) for shape in shapes for d in shape):
      # The workspace output's size is a function of the shapes.
      raise NotImplementedError(
          f"jax_flash2: the CUDA kernels need static shapes (got q/k shapes {shapes}); "
          "export for CUDA with concrete sizes, or use implementation='reference'"
      )
    batch, seqlen_q, heads_q, head_dim = ctx.avals_in[0].shape
    seqlen_k, heads_kv = ctx.avals_in[1].shape[1:3]
    if config.page_size > 0:  # k is a page pool: S is the block table's pages
      seqlen_k = ExtraOperands.split(ctx.avals_in)[1].block_table.shape[1] * config.page_size
    ctx, args = _without_unused_inputs(ctx, args, config)
    sm_count, cc_major = _gpu_plan()
    # Scratch (split-KV partials; D and the fp32 dQ accumulator) is an extra
    # output, so XLA allocates it with the call's other buffers.
    nbytes = _ext.cuda_ext.workspace_bytes(
        backward, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
        config.window_left, config.window_right, sm_count, deterministic, cc_major,
        has_segment_ids=bool(config.has_segment_ids), segment_keys=config.max_segment_length)
    workspace = jax.core.ShapedArray((max(int(nbytes), 1),), np.uint8)
    ctx = ctx.replace(avals_out=[*ctx.avals_out, workspace])
    extra = (dict(deterministic=np.bool_(deterministic)) if backward else
             dict(segment_keys=np.int64(config.max_segment_length)))
    results = ffi_rule(ctx, *args, sm_count=np.int64(sm_count), **extra, **_attributes(config))
    return results[:-1]

  return rule


def _missing_rule(platform: str, backward: bool):
  blockwise_rule = _blockwise_rule(backward)

  def rule(ctx, *args, config):
    if ctx.avals_in[0].dtype == np.float32 and not config.has_kv_seqlens:  # no kernel needed
      return blockwise_rule(ctx, *args, config=config)
    raise NotImplementedError(
        f"jax_flash2 was built without {platform} kernels (reinstall with nvcc on PATH, or "
        "JAX_FLASH2_CUDA=on); pass implementation='reference' for plain JAX"
    )

  return rule


def register(fwd_p, bwd_p) -> None:
  for prim, target in ((fwd_p, _ext.FORWARD_TARGET), (bwd_p, _ext.BACKWARD_TARGET)):
    backward = prim is bwd_p
    mlir.register_lowering(prim, _cpu_rule(target, backward), platform="cpu")
    cuda_rule = (_cuda_rule(target, backward) if _ext.cuda_ext is not None
                 else _missing_rule("cuda", backward))
    mlir.register_lowering(prim, cuda_rule, platform="cuda")
