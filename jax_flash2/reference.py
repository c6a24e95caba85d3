"""Plain-JAX attention with flash_attention's signature and semantics.

It materializes the [B, H, T, S] scores, so it is for documentation, tests and
small inputs. Computation is in float32 (float64 when given float64 inputs with
x64 enabled), the output in the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _distance(seqlen_q: int, seqlen_k: int, rows=None):
  """[R, S] int: i + S - T - j for query rows i (default: all T) and keys j,
  the offset from the bottom-right-aligned diagonal."""
  if rows is None:
    rows = jnp.arange(seqlen_q)
  return rows[:, None] + (seqlen_k - seqlen_q) - jnp.arange(seqlen_k)[None, :]


def visible(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, rows=None):
  """[T, S] bool (or [R, S] for query rows `rows`): query i sees key j (window
  around the bottom-right diagonal)."""
  distance = _distance(seqlen_q, seqlen_k, rows)
  ok = jnp.ones(distance.shape, bool)
  if window_left >= 0:
    ok &= distance <= window_left  # j >= i + S - T - left
  if window_right >= 0:
    ok &= distance >= -window_right  # j <= i + S - T + right
  return ok


def alibi_bias(slopes, seqlen_q: int, seqlen_k: int, rows=None):
  """[B, H, T, S] (or [B, H, R, S]): -slope * |i + S - T - j| for slopes [B, H]."""
  distance = jnp.abs(_distance(seqlen_q, seqlen_k, rows)).astype(slopes.dtype)
  return -slopes[:, :, None, None] * distance


def masked_scores(q, k, alibi_slopes, q_segment_ids, kv_segment_ids, config, *,
                  seqlen_q: int | None = None, rows=None):
  """The scores the forward normalizes, in q's compute dtype, and their slope.

  q [B, R, H, D] holds query rows `rows` (default: all T = R rows) of a query
  sequence of length seqlen_q; q_segment_ids [B, R] are those rows' ids.
  Returns (scores [B, K, G, R, S] with -inf where a key is not visible,
  cap_slope): cap_slope is d scores / d (scale q k^T), the softcap's
  1 - tanh^2 as [B, K, G, R, S], or None when softcap is off (slope 1).
  The ALiBi bias is a constant and the mask does not move with q and k, so
  neither enters the slope.
  """
  compute = jnp.promote_types(q.dtype, jnp.float32)
  batch, num_rows, num_heads, head_dim = q.shape
  seqlen_q = num_rows if seqlen_q is None else seqlen_q
  seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  qg = q.astype(compute).reshape(batch, num_rows, num_kv_heads, group, head_dim)
  # scores: [B, K, G, R, S]
  # HIGHEST: a float32 reference must not silently run in TF32 on GPUs.
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(compute),
                      precision=jax.lax.Precision.HIGHEST) * config.softmax_scale
  cap_slope = None
  if config.softcap > 0:
    capped = jnp.tanh(scores / config.softcap)
    cap_slope = 1.0 - capped * capped
    scores = config.softcap * capped
  if config.has_alibi:
    # After the cap, as FlashAttention-2 does (flash_fwd_kernel.h calls
    # apply_softcap, then mask.apply_mask, which adds slope / scale_softmax with
    # scale_softmax = softcap, i.e. the slope in final score units). The slopes
    # are constants: the kernels give them no gradient, so neither does this.
    slopes = jax.lax.stop_gradient(alibi_slopes).astype(compute)
    bias = alibi_bias(slopes, seqlen_q, seqlen_k, rows)  # [B, H, R, S]
    scores = scores + bias.reshape(batch, num_kv_heads, group, num_rows, seqlen_k)
  mask = visible(seqlen_q, seqlen_k, config.window_left, config.window_right, rows)
  if config.has_segment_ids:
    same = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]  # [B, R, S]
    mask = mask & same[:, None, None]
  return jnp.where(mask, scores, -jnp.inf), cap_slope


# Philox4x32 constants (Salmon et al., SC'11), as in src/flash_dropout.h.
_PHILOX_MUL = (np.uint32(0xD2511F53), np.uint32(0xCD9E8D57))
_PHILOX_WEYL = (np.uint32(0x9E3779B9), np.uint32(0xBB67AE85))


def _mulhilo32(a, b):
  """(high, low) 32-bit words of the 64-bit product a * b, in uint32 ops only
  (jax has no uint64 without x64): 16-bit limbs whose partial products fit."""
  mask = np.uint32(0xFFFF)
  a_lo, a_hi = a & mask, a >> 16
  b_lo, b_hi = b & mask, b >> 16
  lo_lo, hi_lo, lo_hi, hi_hi = a_lo * b_lo, a_hi * b_lo, a_lo * b_hi, a_hi * b_hi
  middle = (lo_lo >> 16) + (hi_lo & mask) + (lo_hi & mask)  # < 3 * 2^16: no carry lost
  high = hi_hi + (hi_lo >> 16) + (lo_hi >> 16) + (middle >> 16)
  return high, a * b  # uint32 multiplication wraps: the low word


def philox4x32(counter, key):
  """Philox4x32-10 of counter (4 uint32 arrays) and key (2), broadcast together:
  the four output words. The same function as src/flash_dropout.h."""
  c0, c1, c2, c3 = (jnp.asarray(c, jnp.uint32) for c in counter)
  k0, k1 = (jnp.asarray(k, jnp.uint32) for k in key)
  for _ in range(10):
    hi0, lo0 = _mulhilo32(c0, _PHILOX_MUL[0])
    hi1, lo1 = _mulhilo32(c2, _PHILOX_MUL[1])
    c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    k0, k1 = k0 + _PHILOX_WEYL[0], k1 + _PHILOX_WEYL[1]
  return c0, c1, c2, c3


def dropout_threshold(rate: float) -> int:
  """floor(rate * 2^32) for the float32 rate: a Philox word >= this is kept."""
  return int(float(np.float32(rate)) * 2.0**32)


def dropout_keep(seeds, seqlen_q: int, seqlen_k: int, rate: float):
  """[B, H, T, S] bool, the kernels' keep mask for seeds [B, H, 2] uint32:
  keep(b, h, i, j) = Philox4x32-10(key = seeds[b, h], counter = (j // 4, i, 0, 0))[j % 4]
  >= dropout_threshold(rate)."""
  groups = -(-seqlen_k // 4)
  j4 = jnp.arange(groups, dtype=jnp.uint32)[None, None, None, :]
  i = jnp.arange(seqlen_q, dtype=jnp.uint32)[None, None, :, None]
  zero = jnp.zeros((), jnp.uint32)
  key = (seeds[:, :, None, None, 0], seeds[:, :, None, None, 1])
  words = jnp.stack(philox4x32((j4, i, zero, zero), key), axis=-1)  # [B, H, T, S/4, 4]
  words = words.reshape(words.shape[:3] + (4 * groups,))[..., :seqlen_k]
  return words >= jnp.uint32(dropout_threshold(rate))


def forward_from_config(q, k, v, alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds,
                        config):
  """(out [B, T, H, D], lse [B, H, T]) for an api.AttentionConfig.

  alibi_slopes [B, H], the segment ids [B, T], [B, S] and dropout_seeds
  [B, H, 2] are read only when config.has_alibi / config.has_segment_ids /
  config.dropout_rate > 0 say so (api.extra_operands).
  """
  compute = jnp.promote_types(q.dtype, jnp.float32)
  batch, seqlen_q, num_heads, head_dim = q.shape
  scores, _ = masked_scores(q, k, alibi_slopes, q_segment_ids, kv_segment_ids, config)
  visible = scores > -jnp.inf
  # The softmax and the LSE do not depend on the shift, so the row max needs
  # no gradient. Rows that see no key: shift 0, LSE -inf.
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  # exp only of visible scores, selected on both sides: no -inf enters exp or
  # its derivative. (With exp(scores - max) over the -inf entries, XLA's GPU
  # backend gave NaN dq in float32 at D = 256 causal T = 257; this form
  # passes that test there.)
  weights = jnp.where(visible, jnp.exp(jnp.where(visible, scores - safe_max, 0.0)), 0.0)
  row_sum = jnp.sum(weights, axis=-1, keepdims=True)
  seen = row_sum > 0
  probs = weights / jnp.where(seen, row_sum, 1.0)
  if config.dropout_rate > 0:
    # After the LSE's row sum: the LSE is of the undropped softmax. The scale
    # is the kernels' float32 1 / (1 - rate).
    seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
    keep = dropout_keep(dropout_seeds, seqlen_q, seqlen_k, config.dropout_rate)
    scale = np.float32(1) / (np.float32(1) - np.float32(config.dropout_rate))
    keep = keep.reshape(batch, num_kv_heads, num_heads // num_kv_heads, seqlen_q, seqlen_k)
    probs = jnp.where(keep, probs * scale.astype(compute), 0.0)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(compute),
                   precision=jax.lax.Precision.HIGHEST)
  # [B, K, G, T]; -inf for empty rows, set by a select rather than log(0) so
  # that their LSE tangent is 0, not 0 / 0.
  lse = jnp.where(seen, safe_max + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)[..., 0]
  out = out.reshape(batch, seqlen_q, num_heads, head_dim).astype(q.dtype)
  return out, lse.reshape(batch, num_heads, seqlen_q)


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, alibi_slopes=None, segment_ids=None,
              dropout_rate: float = 0.0, dropout_rng=None,
              implementation: str | None = None):
  """Same arguments and results as jax_flash2.flash_attention (see there); also
  takes float64 inputs (with x64 enabled), which makes it the tests' oracle."""
  from jax_flash2 import api  # the argument checks live in the API layer

  config = api.make_config(q, k, v, causal=causal, softmax_scale=softmax_scale,
                           window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, segment_ids=segment_ids,
                           dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                           implementation=implementation,
                           dtypes=api.SUPPORTED_DTYPES + (jnp.float64,))
  extras = api.extra_operands(q, k, alibi_slopes, segment_ids, dropout_rng, config.dropout_rate)
  out, lse = forward_from_config(q, k, v, *extras, config)
  return (out, lse) if return_lse else out
