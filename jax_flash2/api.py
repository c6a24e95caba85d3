"""Public API: argument checking into one frozen, hashable AttentionConfig.

Shape letters used throughout the package:
  B batch, T query length, S key/value length, H query heads,
  K key/value heads (H % K == 0: MHA K == H, GQA 1 < K < H, MQA K == 1),
  D head dim (a multiple of 8, at most 256).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import _ext, _varlen, _vjp, reference

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
MAX_HEAD_DIM = 256
IMPLEMENTATIONS = ("kernel", "reference")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Everything about a call that is not an array; the custom_jvp's static argument.

  The window is relative to the bottom-right-aligned diagonal: query i sees key j
  iff i + S - T - window_left <= j <= i + S - T + window_right (-1 = unbounded).
  causal is folded in as window_right = 0.

  has_alibi / has_segment_ids say whether the alibi_slopes and segment-id
  operands (always passed, see `extra_operands`) take part in the call; so does
  dropout_rate > 0 for the dropout-seed operand. dropout_rate is a float32
  value (the kernels' attribute), kept here as a Python float.
  """

  softmax_scale: float
  window_left: int = -1
  window_right: int = -1
  softcap: float = 0.0
  has_alibi: bool = False
  has_segment_ids: bool = False
  deterministic: bool = False
  dropout_rate: float = 0.0
  implementation: str = "kernel"


def _shape_error(name: str, value: Any, expected: str) -> ValueError:
  return ValueError(f"flash_attention: {name} {expected}; got {value}")


def _check_arrays(q, k, v, dtypes) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"flash_attention: {name} must be an array; got {type(x).__name__}")
    if x.ndim != 4:
      raise _shape_error(f"{name}.shape", x.shape, "must be rank 4 [B, T|S, H|K, D]")
    if x.dtype not in dtypes:
      names = ", ".join(jnp.dtype(d).name for d in dtypes)
      raise TypeError(f"flash_attention: {name}.dtype must be one of {names}; got {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(
        "flash_attention: q, k, v must share one dtype; got "
        f"q {q.dtype}, k {k.dtype}, v {v.dtype}"
    )
  if k.shape != v.shape:
    raise _shape_error("k.shape and v.shape", (k.shape, v.shape), "must be equal [B, S, K, D]")
  if q.shape[0] != k.shape[0]:
    raise _shape_error("batch sizes (q.shape[0], k.shape[0])", (q.shape[0], k.shape[0]),
                       "must be equal")
  if q.shape[3] != k.shape[3]:
    raise _shape_error("head dims (q.shape[3], k.shape[3])", (q.shape[3], k.shape[3]),
                       "must be equal")
  if q.shape[1] < 1 or k.shape[1] < 1:
    raise _shape_error("sequence lengths (T, S)", (q.shape[1], k.shape[1]), "must be >= 1")
  if k.shape[2] < 1 or q.shape[2] % k.shape[2] != 0:
    raise _shape_error("heads (H, K)", (q.shape[2], k.shape[2]),
                       "must satisfy H % K == 0 (MHA, GQA or MQA)")
  head_dim = q.shape[3]
  if head_dim % 8 != 0 or not 8 <= head_dim <= MAX_HEAD_DIM:
    raise _shape_error("head_dim D", head_dim, f"must be a multiple of 8 in [8, {MAX_HEAD_DIM}]")


def _static_number(name: str, value) -> float:
  """A static Python number as float: traced values cannot become FFI attributes."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"flash_attention: {name} must be a static Python number, not a traced value")
  try:
    return float(value)
  except (TypeError, ValueError):
    raise TypeError(f"flash_attention: {name} must be a number; got {value!r}") from None


def _check_scale(softmax_scale, head_dim: int) -> float:
  if softmax_scale is None:
    return 1.0 / math.sqrt(head_dim)
  scale = _static_number("softmax_scale", softmax_scale)
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"flash_attention: softmax_scale must be finite and > 0; got {softmax_scale!r}")
  return scale


def _check_window(window_size, causal: bool) -> tuple[int, int]:
  try:
    left, right = window_size
  except (TypeError, ValueError):
    raise ValueError(
        f"flash_attention: window_size must be a pair (left, right); got {window_size!r}"
    ) from None
  for name, value in (("left", left), ("right", right)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < -1:
      raise ValueError(
          f"flash_attention: window_size {name} must be an int >= -1 (-1 = unbounded); got {value!r}"
      )
  left, right = int(left), int(right)
  if causal:
    right = 0 if right < 0 else min(right, 0)
  return left, right


def _check_softcap(softcap) -> float:
  value = _static_number("softcap", softcap)
  if not math.isfinite(value) or value < 0:
    raise ValueError(f"flash_attention: softcap must be finite and >= 0 (0 = off); got {softcap!r}")
  return value


def _check_dropout(dropout_rate, dropout_rng) -> float:
  """The rate as the float32 value the kernels and the reference both use."""
  rate = _static_number("dropout_rate", dropout_rate)
  # The float32 rounding decides: 0.99999999 rounds to 1.0, which would drop all.
  if not math.isfinite(rate) or not 0.0 <= rate or not np.float32(rate) < 1.0:
    raise ValueError(f"flash_attention: dropout_rate must be in [0, 1) (0 = off); got "
                     f"{dropout_rate!r}")
  if dropout_rng is not None:
    if not hasattr(dropout_rng, "dtype") or not hasattr(dropout_rng, "shape"):
      raise TypeError("flash_attention: dropout_rng must be a jax PRNG key (jax.random.key) or a "
                      f"raw uint32 key (jax.random.PRNGKey); got {type(dropout_rng).__name__}")
    typed = jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
    if not (typed and dropout_rng.shape == ()) and not (
        dropout_rng.dtype == jnp.uint32 and dropout_rng.ndim == 1):
      raise ValueError("flash_attention: dropout_rng must be one jax PRNG key (jax.random.key) "
                       "or one raw uint32 key (jax.random.PRNGKey); got "
                       f"{dropout_rng.dtype}{list(dropout_rng.shape)}")
  elif rate > 0:
    raise ValueError(f"flash_attention: dropout_rate={dropout_rate} needs dropout_rng, a jax PRNG "
                     "key (jax.random.key); got None")
  return float(np.float32(rate))


def _check_alibi_slopes(alibi_slopes, batch: int, num_heads: int) -> None:
  if alibi_slopes is None:
    return
  if not hasattr(alibi_slopes, "shape") or not hasattr(alibi_slopes, "dtype"):
    raise TypeError("flash_attention: alibi_slopes must be an array (float32 [H] or [B, H]) or "
                    f"None; got {type(alibi_slopes).__name__}")
  if alibi_slopes.dtype != jnp.float32:
    raise TypeError(f"flash_attention: alibi_slopes.dtype must be float32; got {alibi_slopes.dtype}")
  if tuple(alibi_slopes.shape) not in ((num_heads,), (batch, num_heads)):
    raise _shape_error("alibi_slopes.shape", tuple(alibi_slopes.shape),
                       f"must be [H] = ({num_heads},) or [B, H] = ({batch}, {num_heads})")


def _check_segment_ids(segment_ids, batch: int, seqlen_q: int, seqlen_k: int) -> None:
  if segment_ids is None:
    return
  if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
    raise ValueError("flash_attention: segment_ids must be a pair (q_segment_ids, kv_segment_ids) "
                     f"of int32 [B, T] and [B, S] arrays, or None; got {type(segment_ids).__name__}")
  for name, ids, length, letter in (("q_segment_ids", segment_ids[0], seqlen_q, "T"),
                                    ("kv_segment_ids", segment_ids[1], seqlen_k, "S")):
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
      raise TypeError(f"flash_attention: segment_ids {name} must be an integer array; "
                      f"got {type(ids).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"flash_attention: segment_ids {name}.dtype must be an integer type "
                      f"(int32); got {ids.dtype}")
    if tuple(ids.shape) != (batch, length):
      raise _shape_error(f"segment_ids {name}.shape", tuple(ids.shape),
                         f"must be [B, {letter}] = ({batch}, {length})")


def extra_operands(q, k, alibi_slopes=None, segment_ids=None, dropout_rng=None,
                   dropout_rate=0.0):
  """The array operands beside q, k, v, always present so that the primitives
  have one signature: (slopes [B, H] float32, q_ids [B, T] int32, kv_ids
  [B, S] int32, dropout seeds [B, H, 2] uint32). Absent options become zeros
  that the kernels never read (the config's has_alibi / has_segment_ids are
  False, its dropout_rate is 0).

  The seeds are drawn from dropout_rng, one 64-bit seed per (batch, head):
  the dropout mask is a function of them and the position only, so it is the
  same on every backend, and vmap and sharding slice the seeds with B.
  """
  batch, seqlen_q, num_heads = q.shape[:3]
  seqlen_k = k.shape[1]
  if alibi_slopes is None:
    slopes = jnp.zeros((batch, num_heads), jnp.float32)
  else:
    slopes = jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (batch, num_heads))
  if segment_ids is None:
    q_ids = jnp.zeros((batch, seqlen_q), jnp.int32)
    kv_ids = jnp.zeros((batch, seqlen_k), jnp.int32)
  else:
    q_ids, kv_ids = (jnp.asarray(x).astype(jnp.int32) for x in segment_ids)
  if dropout_rate > 0:
    seeds = jax.random.bits(dropout_rng, (batch, num_heads, 2), jnp.uint32)
  else:
    seeds = jnp.zeros((batch, num_heads, 2), jnp.uint32)
  return slopes, q_ids, kv_ids, seeds


def make_config(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, segment_ids=None, deterministic=False,
                dropout_rate=0.0, dropout_rng=None, implementation=None,
                dtypes=SUPPORTED_DTYPES) -> AttentionConfig:
  """Checks the arguments of flash_attention and returns its static config."""
  _check_arrays(q, k, v, dtypes)
  _check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2])
  _check_segment_ids(segment_ids, q.shape[0], q.shape[1], k.shape[1])
  if not isinstance(causal, (bool, np.bool_)):
    raise TypeError(f"flash_attention: causal must be a bool; got {causal!r}")
  if not isinstance(deterministic, (bool, np.bool_)):
    raise TypeError(f"flash_attention: deterministic must be a bool; got {deterministic!r}")
  if implementation is None:
    implementation = "kernel"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"flash_attention: implementation must be one of {IMPLEMENTATIONS} or None; got {implementation!r}"
    )
  left, right = _check_window(window_size, bool(causal))
  return AttentionConfig(
      softmax_scale=_check_scale(softmax_scale, q.shape[3]),
      window_left=left,
      window_right=right,
      softcap=_check_softcap(softcap),
      has_alibi=alibi_slopes is not None,
      has_segment_ids=segment_ids is not None,
      deterministic=bool(deterministic),
      dropout_rate=_check_dropout(dropout_rate, dropout_rng),
      implementation=implementation,
  )


def flash_attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                    return_lse: bool = False, window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, alibi_slopes=None, segment_ids=None,
                    deterministic: bool = False, dropout_rate: float = 0.0,
                    dropout_rng: jax.Array | None = None,
                    implementation: str | None = None):
  """FlashAttention-2: softmax(q k^T * scale [masked]) v without the T x S matrix.

  Args:
    q: [B, T, H, D] float16, bfloat16 or float32.
    k, v: [B, S, K, D], same dtype; H % K == 0 (MHA, GQA, MQA: K/V heads are
      shared by H // K query heads, never copied).
    causal: query i sees keys j <= i + S - T (aligned bottom-right, as in
      FlashAttention-2, so with T < S the last query sees every key). A query
      that sees no key (T > S) returns 0 and LSE -inf.
    softmax_scale: defaults to 1 / sqrt(D).
    return_lse: also return the logsumexp of the scaled, masked scores.
    window_size: (left, right) local attention around the bottom-right-aligned
      diagonal: query i sees keys i + S - T - left <= j <= i + S - T + right;
      -1 = unbounded. Combined with causal, right is at most 0.
    softcap: if > 0, scaled scores s become softcap * tanh(s / softcap)
      (Gemma-2); 0 = off.
    alibi_slopes: None, or float32 [H] or [B, H]: adds
      -slope[b, h] * |i + S - T - j| to the score of query i and key j, after
      the softmax scale and after softcap (FlashAttention-2's order: its
      kernels cap first, then add the bias in final score units). The bias
      enters the LSE too. FlashAttention-2's causal kernels add slope * j
      instead, which gives the same output but an LSE shifted by
      slope * (i + S - T) per row; here the LSE always includes the distance
      form. The slopes are treated as constants: their cotangent is zero.
    segment_ids: None, or a pair (q_segment_ids [B, T], kv_segment_ids
      [B, S]) of integer arrays: packed sequences (other integer dtypes
      are cast to int32, so ids must fit in int32). Query i sees key j
      only if their ids are equal, in addition to causal and window_size
      (which stay positional: with packed self-attention, T == S, causal is
      causal within each segment). A query with no same-id key returns 0 and
      LSE -inf. K/V blocks with no same-id pair are skipped. Padding can be
      given its own id.
    deterministic: a backward with a fixed summation order, bit-identical run
      to run. The CPU kernels always are (dQ partials are summed in a fixed
      order), so this costs nothing there. The CUDA backward then sums dQ in
      per-CTA slices added in a fixed order instead of with free-running
      atomics: more workspace (up to 1 GiB) and a grid of about one CTA per
      multiprocessor.
    dropout_rate: static float in [0, 1), 0 = off: dropout on the attention
      weights, out = (Z o P / (1 - dropout_rate)) v with P the softmax and Z
      a keep mask, P(keep) = 1 - dropout_rate. The LSE stays that of the
      undropped softmax. The mask is never stored: it is a pure function of
      a per-(batch, head) seed drawn from dropout_rng and the position (query
      i, key j), regenerated in the backward (see src/flash_dropout.h).
      CPU kernels and reference (CUDA: not yet).
    dropout_rng: a jax PRNG key (jax.random.key, or a raw uint32 key);
      required when dropout_rate > 0. The same key gives the same mask on
      every backend; it gets no gradient.
    implementation: None or "kernel" (the compiled kernels of the platform),
      or "reference" (plain JAX, materializes the T x S scores).

  Returns:
    out [B, T, H, D] in q's dtype; with return_lse, (out, lse) with lse
    [B, H, T] float32. Both are differentiable in q, k, v.
  """
  config = make_config(q, k, v, causal=causal, softmax_scale=softmax_scale,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       segment_ids=segment_ids, deterministic=deterministic,
                       dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                       implementation=implementation)
  extras = extra_operands(q, k, alibi_slopes, segment_ids, dropout_rng, config.dropout_rate)
  if config.implementation == "reference":
    out, lse = reference.forward_from_config(q, k, v, *extras, config)
  else:
    out, lse = _vjp.attention(q, k, v, *extras, config)
  return (out, lse) if return_lse else out


def flash_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                           max_seqlen_k: int, *, causal: bool = False,
                           softmax_scale: float | None = None, return_lse: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           deterministic: bool = False, dropout_rate: float = 0.0,
                           dropout_rng: jax.Array | None = None,
                           implementation: str | None = None):
  """Packed variable-length sequences, FlashAttention's varlen convention.

  Args:
    q: [total_q, H, D]; k, v: [total_k, K, D]: the tokens of n sequences,
      one after the other.
    cu_seqlens_q, cu_seqlens_k: integer [n + 1], cumulative lengths starting
      at 0 and ending at total_q / total_k; sequence b is
      q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] against
      k, v[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]. Checked when known at trace
      time (concrete arrays); traced values are trusted.
    max_seqlen_q, max_seqlen_k: static ints, at least every sequence's length.
    causal, window_size: per sequence, aligned bottom-right within each
      sequence (query i of a sequence with T_b queries and S_b keys sees keys
      j <= i + S_b - T_b), as FlashAttention-2's varlen.
    dropout_rate, dropout_rng: as flash_attention; the mask is a function of
      the position in the padded batch (sequence b, right-aligned slot).
    Other arguments: as flash_attention.

  Returns:
    out [total_q, H, D]; with return_lse, (out, lse [H, total_q]).

  Built on segment ids over a padded [n, max_seqlen] batch (see _varlen.py),
  so it runs where segment ids do (CPU kernels, reference).
  """
  for name, x, expected in (("q", q, "[total_q, H, D]"), ("k", k, "[total_k, K, D]"),
                            ("v", v, "[total_k, K, D]")):
    if not hasattr(x, "ndim") or x.ndim != 3:
      raise _shape_error(f"{name}.shape", getattr(x, "shape", type(x).__name__),
                         f"must be rank 3 {expected}")
  for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f"flash_attention_varlen: {name} must be a static int >= 1; got {value!r}")
  _varlen.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q)
  _varlen.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)
  if cu_seqlens_q.shape != cu_seqlens_k.shape:
    raise _shape_error("cu_seqlens_q and cu_seqlens_k shapes",
                       (cu_seqlens_q.shape, cu_seqlens_k.shape), "must be equal [n + 1]")

  def attention(q, k, v, **kwargs):
    return flash_attention(q, k, v, causal=causal, softmax_scale=softmax_scale,
                           window_size=window_size, softcap=softcap,
                           deterministic=deterministic, dropout_rate=dropout_rate,
                           dropout_rng=dropout_rng, implementation=implementation, **kwargs)

  return _varlen.varlen_attention(attention, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                  int(max_seqlen_q), int(max_seqlen_k), return_lse)


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
