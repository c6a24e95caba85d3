"""Attention over a KV cache (contiguous or paged), forward only.

flash_attention_with_kvcache follows FlashAttention's flash_attn_with_kvcache:
each sequence of the batch has its own number of cached keys (cache_seqlens,
a traced [B] int32 that may change every step without recompiling), the cache
is preallocated ([B, S_max, K, D]) or paged ([num_pages, page_size, K, D] read
through a block table), new keys and values may be appended by the same call,
and the cache may be stored in int8 or float8_e4m3fn with float32 scales.

Shape letters as in jax_flash2.api: B batch, T new queries per sequence, H
query heads, K key/value heads (H % K == 0), D head dim; S_max the cache's
capacity per sequence (S_max of a contiguous cache, P * page_size of a paged
one with P = block_table.shape[1]).

The kernels get the per-sequence key counts, the block table and a quantized
cache's scales as more operands of the forward custom call
(ExtraOperands.kv_seqlens, .block_table and .kv_scales, read when
AttentionConfig.has_kv_seqlens / .page_size > 0 / .kv_quantized). The
append writes the new keys and values into the cache before the call: on
CUDA one custom call (jax_flash2_kv_append) for both caches, elsewhere (and
without the CUDA extension) one XLA scatter per cache, bit for bit the same;
either is in place when the cache buffers are donated (jax.jit(...,
donate_argnums=...)).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import _config, _ext, _plan, _primitives, _scores
from jax_flash2._config import SUPPORTED_DTYPES

__all__ = ["PAGE_SIZE_MULTIPLE", "QUANTIZED_DTYPES", "flash_attention_with_kvcache", "plan",
           "quantize", "reference_with_kvcache"]

# A page holds whole 16-key steps of the decode kernel (its smallest warp
# step; a step never straddles two pages), so the page table is read once per
# step.
PAGE_SIZE_MULTIPLE = 16
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
# src/flash_params.h's KvQuant of a cache dtype.
_KV_QUANT = {np.dtype(jnp.int8): 1, np.dtype(jnp.float8_e4m3fn): 2}
_NAME = "flash_attention_with_kvcache"


def _err(cls, message: str):
  return cls(f"{_NAME}: {message}")


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def _concrete(x) -> np.ndarray | None:
  """x as a numpy array when its value is known at trace time, else None
  (traced, or abstract: a jax.ShapeDtypeStruct)."""
  if isinstance(x, jax.core.Tracer) or not isinstance(x, (jax.Array, np.ndarray)):
    return None
  return np.asarray(x)


class _Layout(NamedTuple):
  """What the checks derive from the shapes."""
  batch: int
  seqlen_q: int        # T
  num_kv_heads: int    # K
  capacity: int        # S_max
  page_size: int       # 0: contiguous
  num_pages: int       # paged: the pool's pages
  quantized: bool
  append: bool


def _check(q, k_cache, v_cache, cache_seqlens, k, v, block_table, k_scale, v_scale) -> _Layout:
  for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
    if not _is_array(x):
      raise _err(TypeError, f"{name} must be an array; got {type(x).__name__}")
    if x.ndim != 4:
      raise _err(ValueError, f"{name}.shape must be rank 4; got {tuple(x.shape)}")
  if q.dtype not in SUPPORTED_DTYPES:
    names = ", ".join(jnp.dtype(d).name for d in SUPPORTED_DTYPES)
    raise _err(TypeError, f"q.dtype must be one of {names}; got {q.dtype}")
  batch, seqlen_q, num_heads, head_dim = q.shape
  if k_cache.shape != v_cache.shape:
    raise _err(ValueError, f"k_cache.shape and v_cache.shape must be equal; got "
                           f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
  if k_cache.dtype != v_cache.dtype:
    raise _err(TypeError, f"k_cache and v_cache must share one dtype; got {k_cache.dtype} "
                          f"and {v_cache.dtype}")
  quantized = k_cache.dtype in QUANTIZED_DTYPES
  if not quantized and k_cache.dtype != q.dtype:
    raise _err(TypeError, f"k_cache.dtype must be q's ({q.dtype}), or int8 / float8_e4m3fn "
                          f"with k_scale and v_scale; got {k_cache.dtype}")
  num_kv_heads = k_cache.shape[2]
  if k_cache.shape[3] != head_dim:
    raise _err(ValueError, f"head dims (q.shape[3], k_cache.shape[3]) must be equal; got "
                           f"({head_dim}, {k_cache.shape[3]})")
  if not 1 <= head_dim <= _config.MAX_HEAD_DIM:
    raise _err(ValueError, f"head_dim D must be in [1, {_config.MAX_HEAD_DIM}]; got {head_dim}")
  if seqlen_q < 1 or num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
    raise _err(ValueError, f"(T, H, K) = ({seqlen_q}, {num_heads}, {num_kv_heads}) must be >= 1 "
                           "with H % K == 0 (MHA, GQA or MQA)")

  if block_table is None:
    page_size, num_pages = 0, 0
    if k_cache.shape[0] != batch:
      raise _err(ValueError, f"k_cache.shape[0] must be q's batch {batch} for a contiguous "
                             f"cache [B, S_max, K, D] (pass block_table for a paged one); got "
                             f"{tuple(k_cache.shape)}")
    capacity = k_cache.shape[1]
    if capacity < 1:
      raise _err(ValueError, f"k_cache.shape[1] (S_max) must be >= 1; got {capacity}")
  else:
    if not _is_array(block_table):
      raise _err(TypeError, f"block_table must be an int32 array [B, max_pages]; got "
                            f"{type(block_table).__name__}")
    if block_table.dtype != jnp.int32:
      raise _err(TypeError, f"block_table.dtype must be int32; got {block_table.dtype}")
    if block_table.ndim != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
      raise _err(ValueError, f"block_table.shape must be [B, max_pages] = ({batch}, >= 1); got "
                             f"{tuple(block_table.shape)}")
    num_pages, page_size = k_cache.shape[:2]
    if page_size < 1 or page_size % PAGE_SIZE_MULTIPLE:
      raise _err(ValueError, f"page_size (k_cache.shape[1] of a paged cache [num_pages, "
                             f"page_size, K, D]) must be a positive multiple of "
                             f"{PAGE_SIZE_MULTIPLE}; got {page_size}")
    if num_pages < 1:
      raise _err(ValueError, "k_cache must hold at least one page")
    capacity = block_table.shape[1] * page_size

  if not _is_array(cache_seqlens):
    raise _err(TypeError, f"cache_seqlens must be an int32 array [B]; got "
                          f"{type(cache_seqlens).__name__}")
  if cache_seqlens.dtype != jnp.int32:
    raise _err(TypeError, f"cache_seqlens.dtype must be int32; got {cache_seqlens.dtype}")
  if tuple(cache_seqlens.shape) != (batch,):
    raise _err(ValueError, f"cache_seqlens.shape must be [B] = ({batch},); got "
                           f"{tuple(cache_seqlens.shape)}")

  if (k is None) != (v is None):
    raise _err(ValueError, "k and v must be given together (to append) or both be None")
  append = k is not None
  if append:
    for name, x in (("k", k), ("v", v)):
      if not _is_array(x):
        raise _err(TypeError, f"{name} must be an array; got {type(x).__name__}")
      if tuple(x.shape) != (batch, seqlen_q, num_kv_heads, head_dim):
        raise _err(ValueError, f"{name}.shape must be [B, T, K, D] = "
                               f"{(batch, seqlen_q, num_kv_heads, head_dim)}; got "
                               f"{tuple(x.shape)}")
      if x.dtype != q.dtype:
        raise _err(TypeError, f"{name}.dtype must be q's ({q.dtype}); got {x.dtype}")

  if quantized:
    shapes = [(num_kv_heads,)] + ([(num_pages, num_kv_heads)] if block_table is not None else [])
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
      if scale is None:
        raise _err(ValueError, f"k_cache of dtype {k_cache.dtype} needs {name} (float32 [K], "
                               "or [num_pages, K] for a paged cache)")
      if not _is_array(scale) or scale.dtype != jnp.float32:
        raise _err(TypeError, f"{name} must be a float32 array; got "
                              f"{getattr(scale, 'dtype', type(scale).__name__)}")
      if tuple(scale.shape) not in shapes:
        raise _err(ValueError, f"{name}.shape must be one of {shapes} ([K] per KV head"
                               f"{', [num_pages, K] per page and KV head' if len(shapes) > 1 else ''}"
                               f"); got {tuple(scale.shape)}")
  elif k_scale is not None or v_scale is not None:
    raise _err(ValueError, f"k_scale / v_scale are for int8 / float8_e4m3fn caches; this cache "
                           f"is {k_cache.dtype}")

  layout = _Layout(batch, seqlen_q, num_kv_heads, capacity, page_size, num_pages, quantized,
                   append)
  _check_values(layout, cache_seqlens, block_table)
  return layout


def _check_values(layout: _Layout, cache_seqlens, block_table) -> None:
  """Checks of the values known at trace time; traced ones are trusted (the
  kernels clamp lengths to [0, S_max] and read a page id outside the pool as
  zeros, so they never read out of bounds)."""
  lengths = _concrete(cache_seqlens)
  if lengths is None:
    return
  new = layout.seqlen_q if layout.append else 0
  limit = layout.capacity - new
  if lengths.size and (lengths.min() < 0 or lengths.max() > limit):
    where = "S_max" if not layout.page_size else "max_pages * page_size"
    raise _err(ValueError,
               f"cache_seqlens must be in [0, {limit}] ({where} = {layout.capacity}"
               f"{f' minus the {new} appended tokens' if new else ''}); got values in "
               f"[{lengths.min()}, {lengths.max()}]")
  table = None if block_table is None else _concrete(block_table)
  if table is None:
    return
  # Only the pages a sequence uses must be valid; the rest of its row is never read.
  used_pages = -(-(lengths + new) // layout.page_size)
  used = np.arange(table.shape[1])[None, :] < used_pages[:, None]
  bad = used & ((table < 0) | (table >= layout.num_pages))
  if bad.any():
    b, j = map(int, np.argwhere(bad)[0])
    raise _err(ValueError, f"block_table[{b}, {j}] = {int(table[b, j])} is not a page of the "
                           f"cache (expected ids in [0, {layout.num_pages}) for the "
                           f"{int(used_pages[b])} pages sequence {b} uses)")


@jax.custom_jvp
def _forward_only(x):
  """x itself; differentiating through it raises. Applied to every float
  input, so each route (the kernels, a gathered copy, the reference) is
  forward only alike."""
  return x


@_forward_only.defjvp
def _forward_only_jvp(primals, tangents):
  raise NotImplementedError(
      "jax_flash2.flash_attention_with_kvcache is forward only (it has no gradient); "
      "differentiate jax_flash2.flash_attention instead")


def _guarded(x):
  return _forward_only(x) if _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating) else x


def _scale_of(scale, page_ids):
  """The float32 scale per (entry, KV head) for a [K] or [num_pages, K] scale;
  page_ids: the pages of the entries (any shape), None for a contiguous cache."""
  if scale.ndim == 1 or page_ids is None:
    return scale
  return jnp.take(scale, page_ids, axis=0, mode="clip")  # [..., K]


def quantize(x, dtype, scale):
  """x / scale in the cache dtype (int8: rounded, saturated to [-127, 127];
  float8_e4m3fn: saturated to +-448). scale broadcasts against x's [..., K, D]
  as [..., K]."""
  y = x.astype(jnp.float32) / scale[..., None]
  if jnp.dtype(dtype) == jnp.int8:
    return jnp.clip(jnp.round(y), -127, 127).astype(jnp.int8)
  bound = float(jnp.finfo(jnp.float8_e4m3fn).max)
  return jnp.clip(y, -bound, bound).astype(dtype)


def _append(k_cache, v_cache, k, v, cache_seqlens, block_table, layout, k_scale, v_scale):
  """The caches with k, v [B, T, K, D] written at positions cache_seqlens[b] +
  t (through the block table when paged; quantized for an int8 / fp8 cache),
  in place on donated buffers. A position outside [0, S_max) or a page id
  outside the pool (traced values are not checked) drops the token, never
  wrapped. Tokens that land on one slot (a page shared by two sequences)
  race: which values stay is unspecified, as with any XLA scatter.

  On CUDA one custom call writes both caches (_append_kernel: one launch
  where the scatters take several small dependent kernels); on other
  platforms, or without the CUDA extension, _append_xla. Both give the same
  bits."""
  args = (k_cache, v_cache, k, v, cache_seqlens, block_table, layout, k_scale, v_scale)
  if _ext.cuda_ext is None:
    return _append_xla(*args)
  return jax.lax.platform_dependent(cuda=lambda: _append_kernel(*args),
                                    default=lambda: _append_xla(*args))


def _append_xla(k_cache, v_cache, k, v, cache_seqlens, block_table, layout, k_scale, v_scale):
  """_append in XLA: the positions and slots computed as arrays, then one
  scatter per cache (mode="drop" skips the out-of-range slots)."""
  pos = cache_seqlens[:, None] + jnp.arange(layout.seqlen_q, dtype=jnp.int32)[None, :]  # [B, T]
  ok = (pos >= 0) & (pos < layout.capacity)
  if layout.page_size:
    page = jnp.take_along_axis(block_table, jnp.clip(pos // layout.page_size, 0,
                                                     block_table.shape[1] - 1), axis=1)
    page_ok = ok & (page >= 0) & (page < layout.num_pages)
    index = (jnp.where(page_ok, page, layout.num_pages), pos % layout.page_size)
    page_ids = index[0]
  else:
    index = (jnp.arange(layout.batch)[:, None], jnp.where(ok, pos, layout.capacity))
    page_ids = None
  if layout.quantized:
    k = quantize(k, k_cache.dtype, _scale_of(k_scale, page_ids))
    v = quantize(v, v_cache.dtype, _scale_of(v_scale, page_ids))
  k_cache = k_cache.at[index].set(k.astype(k_cache.dtype), mode="drop")
  v_cache = v_cache.at[index].set(v.astype(v_cache.dtype), mode="drop")
  return k_cache, v_cache


def _append_kernel(k_cache, v_cache, k, v, cache_seqlens, block_table, layout, k_scale, v_scale):
  """_append as the CUDA extension's jax_flash2_kv_append: both caches in
  one launch, its results aliased to the caches (input_output_aliases), so
  that XLA updates them in place. Absent operands (the block table of a
  contiguous cache, the scales of an unquantized one) are zero-size."""
  if not layout.quantized:
    k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
  absent = lambda dtype: np.zeros((0,), dtype)  # a constant: XLA computes nothing for it
  # vmap runs the call once per example: the kernel takes one batch of sequences.
  call = jax.ffi.ffi_call(
      _ext.KV_APPEND_TARGET,
      (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
       jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
      input_output_aliases={0: 0, 1: 1}, vmap_method="sequential")
  return tuple(call(
      k_cache, v_cache, k, v, cache_seqlens,
      absent(np.int32) if block_table is None else block_table,
      absent(np.float32) if k_scale is None else k_scale,
      absent(np.float32) if v_scale is None else v_scale,
      page_size=np.int64(layout.page_size)))


def _dequantize(cache, scale, layout, dtype):
  """A quantized cache in `dtype`: per KV head (scale [K]) or per page and KV
  head ([num_pages, K])."""
  s = scale[:, None, :, None] if scale.ndim == 2 else scale[None, None, :, None]
  return (cache.astype(jnp.float32) * s).astype(dtype)


def _kv_scales(k_scale, v_scale, block_table, layout):
  """The kernels' kv_scales operand, float32 [B, 2, 1 or P, K]: k's and v's
  scale per (sequence, page slot, KV head). [K] scales once per sequence; a
  [num_pages, K] one through the block table (P = block_table.shape[1]; a
  page id outside the pool takes a clipped one, for rows the kernels read as
  zeros)."""
  slots = block_table.shape[1] if k_scale.ndim == 2 or v_scale.ndim == 2 else 1
  shape = (layout.batch, slots, layout.num_kv_heads)
  return jnp.stack([jnp.broadcast_to(_scale_of(s, block_table), shape)
                    for s in (k_scale, v_scale)], axis=1)


def _gathered(cache, block_table, layout):
  """[B, S_max, K, D]: the contiguous cache, or each sequence's pages in order."""
  if not layout.page_size:
    return cache
  pages = jnp.take(cache, block_table, axis=0, mode="clip")  # [B, P, page, K, D]
  return pages.reshape((layout.batch, layout.capacity) + cache.shape[2:])


def reference_with_kvcache(q, k_cache, v_cache, lengths, block_table, config, layout,
                           alibi_slopes=None, k_scale=None, v_scale=None, sinks=None):
  """(out [B, T, H, D], lse [B, H, T]) in plain JAX, over the updated cache.

  lengths [B]: each sequence's visible keys. The pages are gathered, the
  cache dequantized, and every key at or past a sequence's length (or in a
  page id outside the pool) is replaced by zeros with a select before any
  product, so NaN or garbage there never reaches the output.
  """
  compute = jnp.promote_types(q.dtype, jnp.float32)
  batch, seqlen_q, num_heads, head_dim = q.shape
  num_kv_heads, capacity = layout.num_kv_heads, layout.capacity
  group = num_heads // num_kv_heads
  keys, values = (_gathered(c, block_table, layout).astype(compute) for c in (k_cache, v_cache))
  page_ids = None
  if layout.page_size:
    page_ids = jnp.repeat(block_table, layout.page_size, axis=1)  # [B, S_max]
  if layout.quantized:
    for name, scale in (("k", k_scale), ("v", v_scale)):
      s = _scale_of(scale, page_ids)  # [K] or [B, S_max, K]
      s = s[:, :, :, None] if s.ndim == 3 else s[None, None, :, None]
      if name == "k":
        keys = keys * s.astype(compute)
      else:
        values = values * s.astype(compute)
  lengths = jnp.clip(lengths, 0, capacity)
  j = jnp.arange(capacity)
  valid = j[None, :] < lengths[:, None]  # [B, S_max]
  if layout.page_size:
    in_pool = (page_ids >= 0) & (page_ids < layout.num_pages)
    keys = jnp.where(in_pool[:, :, None, None], keys, 0)
    values = jnp.where(in_pool[:, :, None, None], values, 0)
  keys = jnp.where(valid[:, :, None, None], keys, 0)
  values = jnp.where(valid[:, :, None, None], values, 0)

  qg = q.astype(compute).reshape(batch, seqlen_q, num_kv_heads, group, head_dim)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys,
                      precision=jax.lax.Precision.HIGHEST) * config.softmax_scale
  if config.softcap > 0:
    scores = config.softcap * jnp.tanh(scores / config.softcap)
  # distance[b, t, j] = t + L_b - T - j: the diagonal aligned to each sequence's end.
  distance = (jnp.arange(seqlen_q)[None, :, None] + (lengths[:, None, None] - seqlen_q)
              - j[None, None, :])
  if config.has_alibi:
    slopes = jax.lax.stop_gradient(jnp.broadcast_to(
        jnp.asarray(alibi_slopes, compute), (batch, num_heads)))
    bias = -slopes.reshape(batch, num_kv_heads, group)[:, :, :, None, None] * jnp.abs(
        distance).astype(compute)[:, None, None]
    scores = scores + bias
  mask = jnp.broadcast_to(valid[:, None, :], distance.shape)
  if config.window_left >= 0:
    mask &= distance <= config.window_left
  if config.window_right >= 0:
    mask &= distance >= -config.window_right
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  if sinks is not None:  # in the softmax, as reference.py
    sinks = jnp.asarray(sinks).astype(compute).reshape(1, num_kv_heads, group, 1, 1)
  probs, lse = _scores.normalize(scores, sinks)  # [B, K, G, T, S], [B, K, G, T]
  out = jnp.einsum("bkgts,bskd->btkgd", probs, values, precision=jax.lax.Precision.HIGHEST)
  out = out.reshape(batch, seqlen_q, num_heads, head_dim).astype(q.dtype)
  return out, lse.reshape(batch, num_heads, seqlen_q)


def _kernel_direct(q, k_cache, v_cache, lengths, block_table, config, layout, alibi_slopes,
                   kv_scales=None):
  """(out, lse) from the platform's forward kernel with the KV-cache operands
  (the CPU kernels; on CUDA the decode kernel). kv_scales (_kv_scales): the
  caches are quantized, and the kernel dequantizes them."""
  view = jax.ShapeDtypeStruct((layout.batch, layout.capacity, layout.num_kv_heads, q.shape[3]),
                              q.dtype)
  extras = _config.extra_operands(q, view, alibi_slopes)
  table = block_table if layout.page_size else jnp.zeros((layout.batch, 1), jnp.int32)
  extras = extras._replace(kv_seqlens=jnp.clip(lengths, 0, layout.capacity).astype(jnp.int32),
                           block_table=table)
  if kv_scales is not None:
    extras = extras._replace(kv_scales=kv_scales)
    config = dataclasses.replace(config, kv_quantized=True)
  out, lse = _primitives.flash_fwd_p.bind(q, k_cache, v_cache, *extras, config=config)
  return out, lse


def _kernel_gathered(q, k_cache, v_cache, lengths, block_table, config, layout, alibi_slopes):
  """(out, lse) from flash_attention's kernels over a gathered copy of the
  visible cache: for the CUDA calls the decode kernel cannot serve (more
  packed rows than it holds, softcap, ALiBi). Each sequence's L_b visible keys
  are right-aligned in an [B, S_max, K, D] copy, so that the kernels' one
  bottom-right diagonal (offset S_max - T) is each sequence's own
  (t + L_b - T), ALiBi distances included; the slots before them hold zeros
  under a segment id no query has."""
  from jax_flash2 import api
  capacity = layout.capacity
  lengths = jnp.clip(lengths, 0, capacity)
  source = jnp.arange(capacity)[None, :] - (capacity - lengths)[:, None]  # [B, S_max]; < 0: pad
  present = source >= 0
  index = jnp.clip(source, 0, capacity - 1)[:, :, None, None]

  def aligned(cache):
    full = _gathered(cache, block_table, layout)
    return jnp.where(present[:, :, None, None], jnp.take_along_axis(full, index, axis=1), 0)

  q_ids = jnp.zeros(q.shape[:2], jnp.int32)
  kv_ids = jnp.where(present, 0, 1).astype(jnp.int32)
  left, right = config.window_left, config.window_right
  return api.flash_attention(q, aligned(k_cache), aligned(v_cache), causal=False,
                             softmax_scale=config.softmax_scale, window_size=(left, right),
                             softcap=config.softcap, alibi_slopes=alibi_slopes,
                             segment_ids=(q_ids, kv_ids), return_lse=True)


def _decode_kernel_serves(q, k_cache, v_cache, block_table, config, alibi_slopes) -> bool:
  """Whether the CUDA decode kernel serves the call on this host's GPUs (on
  a (9, 0) GPU when there is none to ask, as the lowering plans)."""
  try:
    gpus = jax.local_devices(backend="gpu")
  except RuntimeError:
    gpus = []
  ccs = {tuple(int(x) for x in str(getattr(d, "compute_capability", "9.0")).split("."))
         for d in gpus} or {(9, 0)}
  options = dict(softmax_scale=config.softmax_scale,
                 window_size=(config.window_left, config.window_right), softcap=config.softcap,
                 alibi_slopes=alibi_slopes, causal=False, sm_count=132,
                 max_smem_per_block=None)
  for cc in ccs:
    if cc not in _plan.MAX_SMEM_PER_BLOCK:
      return False
    kernel = _forward_plan(q, k_cache, v_cache, block_table, cc, **options)["forward"].kernel
    if kernel != "sm80-decode":
      return False
  return True


def _kernel(q, k_cache, v_cache, lengths, block_table, config, layout, alibi_slopes,
            k_scale, v_scale):
  """(out, lse) from the platform's kernels: the CPU kernels read the cache
  directly (a quantized one too, dequantizing as they load it); on CUDA the
  decode kernel does where it serves the call, else flash_attention's
  kernels over a gathered copy (_kernel_gathered)."""
  head_dim = q.shape[3]
  if head_dim % 8:
    raise _err(NotImplementedError,
               f"the kernels take head dims that are multiples of 8 (a cache of D={head_dim} "
               "would need a padded copy); use implementation='reference'")
  scales = _kv_scales(k_scale, v_scale, block_table, layout) if layout.quantized else None

  def direct():  # the kernel reads the cache (a quantized one with its scales) itself
    return _kernel_direct(q, k_cache, v_cache, lengths, block_table, config, layout,
                          alibi_slopes, scales)

  def cuda():
    # float32 has no CUDA decode kernel: it takes the gathered path, whose
    # flash_attention runs float32 as the other CUDA float32 calls do. A
    # quantized cache goes to the decode kernel itself where its plan takes
    # one (D % 16 == 0), else as a q-dtype copy made here.
    decode = lambda kc, vc: q.dtype != jnp.float32 and _decode_kernel_serves(
        q, kc, vc, block_table, config, alibi_slopes)
    if decode(k_cache, v_cache):
      return direct()
    kc, vc = k_cache, v_cache
    if layout.quantized:
      kc = _dequantize(kc, k_scale, layout, q.dtype)
      vc = _dequantize(vc, v_scale, layout, q.dtype)
    args = (q, kc, vc, lengths, block_table, config, layout, alibi_slopes)
    return _kernel_direct(*args) if decode(kc, vc) else _kernel_gathered(*args)

  return jax.lax.platform_dependent(cpu=direct, cuda=cuda)


def plan(q, k_cache, v_cache, *, block_table=None, compute_capability: tuple[int, int] | None = (9, 0),
         sm_count: int = 132, max_smem_per_block: int | None = None, causal: bool = True,
         softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None):
  """The kernel flash_attention_with_kvcache(q, k_cache, v_cache, ...) runs on a
  given GPU, from src/plan.h as jax_flash2.plan (arrays or
  jax.ShapeDtypeStruct; cache_seqlens and the appended k, v do not change it).

  Returns {"forward": jax_flash2._plan.KernelPlan}: on CUDA always the decode
  kernel ("sm80-decode", on Hopper too: it is the one kernel that reads
  per-sequence lengths and block tables), or "unsupported" with the reason
  (more than its packed-row limit of T * H / K, softcap or ALiBi). For an
  int8 / float8_e4m3fn cache, the kernel that reads it, or, when that is
  none, the one that reads its dequantized copy (the reason says so).
  """
  options = dict(sm_count=sm_count, max_smem_per_block=max_smem_per_block, causal=causal,
                 softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                 alibi_slopes=alibi_slopes)
  stored = _forward_plan(q, k_cache, v_cache, block_table, compute_capability, **options)
  if k_cache.dtype not in QUANTIZED_DTYPES or stored["forward"].kernel != "unsupported":
    return stored
  copy = jax.ShapeDtypeStruct(k_cache.shape, q.dtype)
  result = _forward_plan(q, copy, copy, block_table, compute_capability, **options)
  if result["forward"].kernel == "unsupported":
    return result
  forward = dataclasses.replace(result["forward"], reason=(
      f"over XLA's {jnp.dtype(q.dtype).name} copy of the cache ({stored['forward'].reason})"))
  return {"forward": forward}


def _forward_plan(q, k_cache, v_cache, block_table, compute_capability, *, sm_count,
                  max_smem_per_block, causal, softmax_scale, window_size, softcap,
                  alibi_slopes):
  """plan() for the cache as stored (an int8 / fp8 one read by the kernel itself)."""
  lengths = jax.ShapeDtypeStruct((q.shape[0],), jnp.int32)
  layout = _check(q, k_cache, v_cache, lengths, None, None, block_table,
                  *((jax.ShapeDtypeStruct((k_cache.shape[2],), jnp.float32),) * 2
                    if k_cache.dtype in QUANTIZED_DTYPES else (None, None)))
  view = jax.ShapeDtypeStruct((layout.batch, layout.capacity, layout.num_kv_heads, q.shape[3]),
                              q.dtype)
  config = _config.make_config(q, view, view, causal=causal, softmax_scale=softmax_scale,
                               window_size=window_size, softcap=softcap,
                               alibi_slopes=alibi_slopes)
  if compute_capability is None:
    return {"forward": _plan.KernelPlan(kernel="cpu")}
  major, minor = (int(x) for x in compute_capability)
  if max_smem_per_block is None:
    max_smem_per_block = _plan.MAX_SMEM_PER_BLOCK[(major, minor)]
  have_sm90 = _ext.cuda_ext.has_sm90() if _ext.cuda_ext is not None else True
  d = _ext.cpu_ext.plan(
      backward=False, dtype=_plan._DTYPES.get(np.dtype(q.dtype), 2), batch=layout.batch,
      seqlen_q=layout.seqlen_q, seqlen_k=layout.capacity, heads_q=q.shape[2],
      heads_kv=layout.num_kv_heads, head_dim=-(-q.shape[3] // 8) * 8,
      window_left=config.window_left, window_right=config.window_right, softcap=config.softcap,
      has_alibi=config.has_alibi, has_segment_ids=False, dropout_rate=0.0, deterministic=False,
      cc_major=major, cc_minor=minor, sm_count=int(sm_count),
      max_smem_per_block=int(max_smem_per_block), have_sm90=have_sm90, has_kv_seqlens=True,
      page_size=layout.page_size, kv_quant=_KV_QUANT.get(np.dtype(k_cache.dtype), 0))
  return {"forward": _plan._kernel_plan(d)}


def flash_attention_with_kvcache(q, k_cache, v_cache, *, cache_seqlens, k=None, v=None,
                                 block_table=None, causal: bool = True,
                                 softmax_scale: float | None = None,
                                 window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                                 alibi_slopes=None, sinks=None, return_lse: bool = False,
                                 k_scale=None,
                                 v_scale=None, implementation: str | None = None):
  """Attention of T new queries per sequence over a KV cache; forward only.

  Args:
    q: [B, T, H, D] float16, bfloat16 or float32 (T = 1 for decode, more for
      chunked prefill or speculative verification).
    k_cache, v_cache: contiguous [B, S_max, K, D], or paged [num_pages,
      page_size, K, D] with block_table; q's dtype, or int8 / float8_e4m3fn
      with k_scale, v_scale. page_size must be a multiple of 16
      (PAGE_SIZE_MULTIPLE).
    cache_seqlens: int32 [B], may be traced: sequence b has cache_seqlens[b]
      keys in the cache, positions [0, cache_seqlens[b]). Keys at or past a
      sequence's visible length are never read by the kernels (the reference
      masks them with a select), so NaN or garbage there never reaches out.
    k, v: None, or [B, T, K, D] in q's dtype: appended to the cache at
      positions cache_seqlens[b] ... cache_seqlens[b] + T - 1 (through the
      block table when paged; quantized with k_scale / v_scale for an int8 /
      fp8 cache) and attended together with it. The call then also returns
      the updated caches; under jax.jit with the caches donated
      (donate_argnums) the update is in place (no copy of the cache).
    block_table: None (contiguous cache), or int32 [B, max_pages]: the page
      ids of each sequence in order; S_max = max_pages * page_size. Only the
      pages a sequence uses are read (or checked).
    causal: the diagonal aligns to each sequence's own end, as in
      flash_attn_with_kvcache. The visible length of sequence b is
      L_b = cache_seqlens[b] + T with k, v (the appended tokens included) and
      L_b = cache_seqlens[b] without; query t (0-based) sees keys
      j <= t + L_b - T. With k, v that is j <= cache_seqlens[b] + t (each
      new token sees the cache and the new tokens up to itself); without,
      the last query sees all L_b keys. A query with no visible key (L_b = 0,
      or t + L_b - T < 0) returns 0 and LSE -inf.
    softmax_scale, window_size, softcap, alibi_slopes: as flash_attention,
      with S - T replaced by L_b - T: the window around that diagonal, the
      ALiBi bias -slope * |t + L_b - T - j|.
    sinks: None or float32 [H], attention sinks as flash_attention (a query
      with no visible key then returns 0 and LSE the sink).
    return_lse: also return the LSE [B, H, T] float32.
    k_scale, v_scale: float32 scales of a quantized cache: [K] (per KV head)
      or, for a paged cache, [num_pages, K] (per page and KV head). The
      stored value x_q stands for x_q * scale (int8: symmetric, |x_q| <=
      127; float8_e4m3fn: |x_q| <= 448); appended tokens are stored as
      round / saturate(x / scale). The reference dequantizes before the
      products; the CPU kernels dequantize each row as they load it, and the
      CUDA decode kernel in registers (no copy, half the bytes read); calls
      it does not serve read a q-dtype copy made by XLA (kvcache.plan
      says which).
    implementation: None or "kernel" (the platform's kernels), or
      "reference" (plain JAX; gathers the pages and materializes the scores).
      The CPU kernels read the cache directly. On CUDA the decode kernel
      does (any GPU, Hopper included; bfloat16 / float16) for up to its
      packed-row limit T * H / K <= 32 (16 at D > 128 or on 99 KB GPUs),
      without softcap or ALiBi; other calls (float32 among them) run
      flash_attention's kernels over a gathered copy of the visible keys
      ([B, S_max, K, D], O(S_max) memory per sequence). kvcache.plan tells
      which.

  Returns:
    out [B, T, H, D] in q's dtype; with return_lse, (out, lse). With k, v,
    the updated (k_cache, v_cache) follow: (out, k_cache, v_cache) or
    (out, lse, k_cache, v_cache).

  Errors: wrong types, shapes, dtypes and options raise TypeError /
  ValueError naming the argument at trace time; concrete cache_seqlens
  outside [0, S_max - T_appended] and concrete block-table ids outside the
  pool (among the pages a sequence uses) raise ValueError. Traced values are
  not checked: the kernels clamp lengths to [0, S_max] and read a page id
  outside the pool as zeros, so they never read out of bounds, and an
  append position outside the cache is dropped. Differentiating raises
  (forward only). vmap of a paged kernel call raises NotImplementedError.
  """
  _config.check_bool("return_lse", return_lse)
  _config.check_bool("causal", causal)
  layout = _check(q, k_cache, v_cache, cache_seqlens, k, v, block_table, k_scale, v_scale)
  view = jax.ShapeDtypeStruct((layout.batch, layout.capacity, layout.num_kv_heads, q.shape[3]),
                              q.dtype)
  config = _config.make_config(q, view, view, causal=causal, softmax_scale=softmax_scale,
                               window_size=window_size, softcap=softcap,
                               alibi_slopes=alibi_slopes, implementation=implementation,
                               sinks=sinks)
  config = dataclasses.replace(config, has_kv_seqlens=True, page_size=layout.page_size)
  q, k_cache, v_cache, k, v, k_scale, v_scale, alibi_slopes, sinks = (_guarded(x) for x in (
      q, k_cache, v_cache, k, v, k_scale, v_scale, alibi_slopes, sinks))

  if layout.append:
    k_cache, v_cache = _append(k_cache, v_cache, k, v, cache_seqlens, block_table, layout,
                               k_scale, v_scale)
    lengths = cache_seqlens + layout.seqlen_q
  else:
    lengths = cache_seqlens
  if config.implementation == "reference":
    out, lse = reference_with_kvcache(q, k_cache, v_cache, lengths, block_table, config, layout,
                                      alibi_slopes, k_scale, v_scale, sinks=sinks)
  else:
    out, lse = _kernel(q, k_cache, v_cache, lengths, block_table, config, layout, alibi_slopes,
                       k_scale, v_scale)
    if sinks is not None:  # the exact rescale of flash_attention (_scores.add_sinks)
      out, lse = _scores.add_sinks(out, lse, sinks)
  result = (out, lse) if return_lse else (out,)
  if layout.append:
    result += (k_cache, v_cache)
  return result[0] if len(result) == 1 else result
