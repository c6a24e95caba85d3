"""Public API: flash_attention and flash_attention_varlen.

The arguments are checked into one frozen, hashable AttentionConfig and the
array options gathered into ExtraOperands (both in _config); the call then goes
to the custom_jvp in _autodiff (kernels) or to `reference` (plain JAX).

Shape letters used throughout the package:
  B batch, T query length, S key/value length, H query heads,
  K key/value heads (H % K == 0: MHA K == H, GQA 1 < K < H, MQA K == 1),
  D head dim, 1 to 256.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import _autodiff, _ext, _scores, _varlen, reference
from jax_flash2._config import (AttentionConfig, ExtraOperands, SUPPORTED_DTYPES, check_bool,
                                extra_operands, kernel_head_dim, make_config,
                                shape_error)

__all__ = ["AttentionConfig", "ExtraOperands", "SUPPORTED_DTYPES", "extra_operands",
           "flash_attention", "flash_attention_varlen", "kernel_info", "make_config"]


def flash_attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                    return_lse: bool = False, window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, segment_ids=None,
                    deterministic: bool = False, dropout_rate: float = 0.0,
                    dropout_rng: jax.Array | None = None, sinks=None,
                    max_segment_length: int | None = None,
                    implementation: str | None = None):
  """FlashAttention-2: softmax(q k^T * scale [masked]) v without the T x S matrix.

  Args:
    q: [B, T, H, D] float16, bfloat16 or float32; any D from 1 to 256 (the
      kernels run D rounded up to a multiple of 8: q, k, v are zero-padded
      to it and the output sliced back, the scale staying 1 / sqrt(D)).
      float32 on CUDA runs a blockwise plain-JAX path (the CUDA kernels take
      16-bit inputs): O(T) memory, never a [B, H, T, S] tensor, matmuls at
      jax.default_matmul_precision (TF32 tensor cores by default on Ampere
      and later GPUs, as for jax's own float32 matmuls; float32-accurate
      under jax.default_matmul_precision("highest")).
    k, v: [B, S, K, D], same dtype; H % K == 0 (MHA, GQA, MQA: K/V heads are
      shared by H // K query heads, never copied).
    causal: query i sees keys j <= i + S - T (aligned bottom-right, as in
      FlashAttention-2, so with T < S the last query sees every key). A query
      that sees no key (T > S) returns 0 and LSE -inf.
    softmax_scale: defaults to 1 / sqrt(D). A static real number, finite and
      > 0 also as a float32 (the kernels' attribute type).
    return_lse: also return the logsumexp of the scaled, masked scores.
    window_size: (left, right) local attention around the bottom-right-aligned
      diagonal: query i sees keys i + S - T - left <= j <= i + S - T + right;
      -1 = unbounded. Combined with causal, right is at most 0. Ints >= -1; a
      bound >= max(T, S) is unbounded, one beyond int64 an error.
    softcap: if > 0, scaled scores s become softcap * tanh(s / softcap)
      (Gemma-2); 0 = off. When > 0 it must stay finite and > 0 as a float32.
    alibi_slopes: None, or float32 [H] or [B, H]: adds
      -slope[b, h] * |i + S - T - j| to the score of query i and key j, after
      the softmax scale and after softcap (FlashAttention-2's order: its
      kernels cap first, then add the bias in final score units). The bias
      enters the LSE too. FlashAttention-2's causal kernels add slope * j
      instead, which gives the same output but an LSE shifted by
      slope * (i + S - T) per row; here the LSE always includes the distance
      form. The slopes are treated as constants: their cotangent is zero.
      Concrete slopes must be finite (checked); traced ones are trusted.
    segment_ids: None, or a pair (q_segment_ids [B, T], kv_segment_ids
      [B, S]) of integer arrays: packed sequences. Other integer dtypes are
      cast to int32: concrete ids must fit in int32 (checked); traced ids of a
      wider dtype wrap modulo 2**32 unchecked (2**32 then matches 0). Query i sees key j
      only if their ids are equal, in addition to causal and window_size
      (which stay positional: with packed self-attention, T == S, causal is
      causal within each segment). A query with no same-id key returns 0 and
      LSE -inf. K/V blocks with no same-id pair are skipped. Padding can be
      given its own id.
    max_segment_length: None, or a static int >= 1 with segment_ids: a speed
      hint, the most keys any segment id has in a row (the longest
      document). The Hopper forward cannot read the ids on the host and
      otherwise chooses its tile for documents of up to 2048 keys; with D <=
      64 and documents of at most 256 keys, the bound lets it take the tile
      such short sequences run as a batch. It is not checked against the
      ids: a wrong bound changes the speed only, never the results.
      flash_attention_varlen passes its max_seqlen_k.
    deterministic: a backward with a fixed summation order, bit-identical run
      to run. The CPU kernels always are (dQ partials are summed in a fixed
      order), so this costs nothing there. On Hopper (cc 9.0) the CUDA
      backward then has the key blocks add into each query block's dQ one
      after another, in key-block order, instead of in any order; the sm80
      kernels sum dQ in per-CTA slices added in a fixed order, with a grid of
      about one CTA per multiprocessor. Either way the workspace covers those
      slices (up to 1 GiB).
    dropout_rate: static float in [0, 1), 0 = off: dropout on the attention
      weights, out = (Z o P / (1 - dropout_rate)) v with P the softmax and Z
      a keep mask, P(keep) = 1 - dropout_rate. The rate is applied in
      256ths: the nearest multiple of 1/256 in [1/256, 255/256]
      (reference.applied_dropout_rate), whose 1 / (1 - rate) scales the
      survivors. The LSE stays that of the undropped softmax. The mask is
      never stored: it is a pure function of a per-(batch, head) seed drawn
      from dropout_rng and the position (query i, key j), regenerated in the
      backward (see src/flash_dropout.h).
      Served by every backend (CPU and CUDA kernels, reference); forward-mode
      AD with dropout raises NotImplementedError.
    dropout_rng: a jax PRNG key (jax.random.key, or a raw uint32 key of the
      default implementation's shape, (2,) for threefry); required when
      dropout_rate > 0. The same key gives the same mask on
      every backend; it gets no gradient.
    sinks: None, or float32 [H]: attention sinks (gpt-oss), one learnable
      logit per query head that joins every row's softmax denominator
      without a value: P_ij = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij)),
      s the final score (scaled, capped, ALiBi-biased, masked); the sink is
      used as given (not scaled, capped or biased). The LSE includes it; a
      row that sees no key returns 0 and LSE sinks[h]. Differentiable
      (reverse and forward mode). With dropout, the keep mask applies to
      this P. On every backend: the kernels compute the attention without
      the sink and one elementwise pass rescales out and the LSE (exact).
      Concrete sinks must be finite (checked); a traced NaN gives its head
      NaN rows.
    implementation: None or "kernel" (the compiled kernels of the platform),
      or "reference" (plain JAX, materializes the T x S scores).

  Returns:
    out [B, T, H, D] in q's dtype; with return_lse, (out, lse) with lse
    [B, H, T] float32. Both are differentiable in q, k, v.

  NaN: a NaN among the scores a query row sees (a NaN in its q row, or in a
  visible key) gives that row NaN out and LSE, and NaN gradients; a NaN in a
  visible value row gives NaN out with a finite LSE. A row that sees no key
  still returns 0 and LSE -inf. Every backend agrees on this.

  Errors: bad arguments raise at trace time, naming the argument: TypeError
  for a wrong type (arrays, dtypes, non-bool flags, non-number scalars,
  traced scalars), ValueError for a wrong value (shapes, H or K = 0,
  H % K != 0, non-finite or float32-unrepresentable scalars, window bounds
  < -1 or beyond int64, non-finite concrete ALiBi slopes, concrete segment
  ids outside int32, a dropout key of the wrong shape, dropout without a
  key); NotImplementedError for a valid request a backend cannot serve.
  """
  check_bool("return_lse", return_lse)
  config = make_config(q, k, v, causal=causal, softmax_scale=softmax_scale,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       segment_ids=segment_ids, deterministic=deterministic,
                       dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                       implementation=implementation, sinks=sinks,
                       max_segment_length=max_segment_length)
  extras = extra_operands(q, k, alibi_slopes, segment_ids, dropout_rng, config.dropout_rate)
  if config.implementation == "reference":
    out, lse = reference.forward_from_config(q, k, v, extras, config, sinks=sinks)
  else:
    head_dim = q.shape[3]
    padded = kernel_head_dim(head_dim)
    if padded != head_dim:
      # Outside the custom_jvp: jnp.pad and the slice carry the gradients.
      widths = ((0, 0),) * 3 + ((0, padded - head_dim),)
      q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
    out, lse = _autodiff.attention(q, k, v, extras, config)
    out = out[..., :head_dim]
    if sinks is not None:
      # Outside the custom_jvp: JAX differentiates the rescale through the
      # kernels' differentiable (out, lse); sinks get their gradient here.
      out, lse = _scores.add_sinks(out, lse, sinks)
  return (out, lse) if return_lse else out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                           max_seqlen_k: int, *, seqused_k=None, causal: bool = False,
                           softmax_scale: float | None = None, return_lse: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           deterministic: bool = False, dropout_rate: float = 0.0,
                           dropout_rng: jax.Array | None = None, sinks=None,
                           implementation: str | None = None):
  """Packed variable-length sequences, FlashAttention's varlen convention.

  Args:
    q: [total_q, H, D]; k, v: [total_k, K, D]: the tokens of n sequences,
      one after the other.
    cu_seqlens_q, cu_seqlens_k: integer [n + 1], cumulative lengths starting
      at 0, non-decreasing, ending at most at total_q / total_k; sequence b is
      q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] against
      k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]. Checked when known at trace
      time (concrete arrays); traced values are trusted (offsets out of
      order give wrong sequences, never an out-of-bounds access). Rows past
      cu_seqlens[-1] (padding) see no key and are seen by no query: out 0,
      LSE -inf (with sinks, the sink).
    max_seqlen_q, max_seqlen_k: static ints, at least every sequence's length.
    seqused_k: None, or integer [n]: sequence b uses only the first
      seqused_k[b] keys of its range (0 <= seqused_k[b] <= its key length),
      as FlashAttention's seqused_k (e.g. a fixed-capacity cache per
      sequence). The keys past them are never read into a product: whatever
      they hold (also NaN) cannot reach out, LSE or dq, and their dk, dv are
      0. Checked when concrete; traced values are trusted (clamped to
      [0, key length] on the device) and change without recompiling.
    causal, window_size: per sequence, aligned bottom-right within each
      sequence (query i of a sequence with T_b queries and S_b keys sees keys
      j <= i + S_b - T_b), as FlashAttention-2's varlen. With seqused_k,
      S_b is seqused_k[b]: aligned to the end of the used keys, as
      FlashAttention aligns them.
    dropout_rate, dropout_rng: as flash_attention; the mask is a function of
      the token's position in the row it runs in (see below).
    Other arguments: as flash_attention.

  Returns:
    out [total_q, H, D]; with return_lse, (out, lse [H, total_q]).

  Runs on the packed tensors as one row [1, total, ...] with segment ids
  computed on the device from cu_seqlens (O(total) memory, no copy), so the
  kernels skip the blocks of different sequences. Exact whenever neither
  causal nor window_size is set, or when the offsets are equal: concrete
  cu_seqlens_q, cu_seqlens_k with equal values, or the same array passed
  twice (also traced). One row's diagonal cannot follow every sequence's
  bottom-right one otherwise, so causal or window with offsets that differ,
  that are traced distinct arrays, or with seqused_k copy the sequences
  into one row of slots of max(q length, k length) tokens each, queries and
  (used) keys ending at the slot's end (O(total_q + total_k) memory); where
  a right-aligned padded [n, max_seqlen] batch holds fewer elements (few
  queries against many keys per sequence, as in chunked prefill) they are
  gathered into that instead. Without causal or window, seqused_k stays on
  the packed row (the unused keys get a segment id no query has, and
  zeros).
  """
  check_bool("return_lse", return_lse)
  for name, x, expected in (("q", q, "[total_q, H, D]"), ("k", k, "[total_k, K, D]"),
                            ("v", v, "[total_k, K, D]")):
    if not hasattr(x, "ndim") or x.ndim != 3:
      raise shape_error(f"{name}.shape", getattr(x, "shape", type(x).__name__),
                        f"must be rank 3 {expected}", "flash_attention_varlen")
  for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f"flash_attention_varlen: {name} must be a static int >= 1; got {value!r}")
  _varlen.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
  _varlen.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
  if cu_seqlens_q.shape != cu_seqlens_k.shape:
    raise shape_error("cu_seqlens_q and cu_seqlens_k shapes",
                      (cu_seqlens_q.shape, cu_seqlens_k.shape), "must be equal [n + 1]",
                      "flash_attention_varlen")
  if seqused_k is not None:
    _varlen.check_seqused_k(seqused_k, cu_seqlens_k)

  def attention(q, k, v, **kwargs):
    return flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                           window_size=window_size, softcap=softcap,
                           deterministic=deterministic, dropout_rate=dropout_rate,
                           dropout_rng=dropout_rng, sinks=sinks,
                           implementation=implementation,
                           max_segment_length=int(max_seqlen_k), **kwargs)

  # Every argument is checked as flash_attention checks them, also when a side
  # has no token and no kernel runs (one row of at least one token stands in).
  row = lambda x: jax.ShapeDtypeStruct((1, max(x.shape[0], 1)) + tuple(x.shape[1:]), x.dtype)  # noqa: E731
  make_config(row(q), row(k), row(v), causal=causal, softmax_scale=softmax_scale,
              window_size=window_size, softcap=softcap, deterministic=deterministic,
              dropout_rate=dropout_rate, dropout_rng=dropout_rng,
              implementation=implementation, sinks=sinks)
  if sinks is not None and k.shape[0] == 0:
    # No key at all: every query sees no key, out 0 and LSE the sink (the
    # gathered batch would have nothing to gather from).
    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], (q.shape[1], q.shape[0]))
    return (out, lse) if return_lse else out
  unbounded = isinstance(window_size, (tuple, list)) and tuple(window_size) == (-1, -1)
  return _varlen.varlen_attention(attention, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                  int(max_seqlen_q), int(max_seqlen_k), return_lse,
                                  positional=causal is not False or not unbounded,
                                  seqused_k=seqused_k)


def _cuda_kernel_info() -> str | None:
  if _ext.cuda_ext is None:
    return None
  if _ext.cuda_ext.has_sm90():
    return "cuda-flash2-sm80 (forward and backward on cc 9.0: sm90a wgmma/TMA kernels)"
  return "cuda-flash2-sm80"


def kernel_info() -> dict[str, str | None]:
  """Which compiled kernels serve each platform in this installation."""
  return {
      "cpu": f"cpu-flash2 ({_ext.cpu_ext.isa()})",
      "cuda": _cuda_kernel_info(),
  }
