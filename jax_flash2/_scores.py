"""Score math shared by the reference, the blockwise float32 path and the
forward-mode tangents: scale, softcap, ALiBi bias, the window and segment
masks, the softmax normalization, the dropout keep mask, and the attention
sinks joined to a finished (out, lse).

Every function takes query rows `rows` (default all T) so that blockwise
callers compute one block of query rows at a time with the same code.
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


def masked_scores(q, k, extras, config, *, seqlen_q: int | None = None, rows=None,
                  precision=jax.lax.Precision.HIGHEST):
  """The scores the forward normalizes, in q's compute dtype, and their slope.

  q [B, R, H, D] holds query rows `rows` (default: all T = R rows) of a query
  sequence of length seqlen_q; extras (ExtraOperands) has the slopes [B, H],
  those rows' q_segment_ids [B, R] and kv_segment_ids [B, S]. precision is
  that of the q k^T product (HIGHEST by default: a float32 reference must not
  silently run in TF32 on GPUs).
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
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(compute),
                      precision=precision) * config.softmax_scale
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
    slopes = jax.lax.stop_gradient(extras.alibi_slopes).astype(compute)
    bias = alibi_bias(slopes, seqlen_q, seqlen_k, rows)  # [B, H, R, S]
    scores = scores + bias.reshape(batch, num_kv_heads, group, num_rows, seqlen_k)
  mask = visible(seqlen_q, seqlen_k, config.window_left, config.window_right, rows)
  if config.has_segment_ids:
    same = extras.q_segment_ids[:, :, None] == extras.kv_segment_ids[:, None, :]  # [B, R, S]
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


def applied_dropout_rate(rate: float) -> float:
  """The rate the mask applies: rate rounded to a multiple of 1/256 in
  [1/256, 255/256] (0 stays 0). One byte of Philox output decides a key."""
  if rate <= 0:
    return 0.0
  return min(max(int(np.rint(rate * 256)), 1), 255) / 256


def dropout_threshold(rate: float) -> int:
  """The applied rate in 256ths: a Philox byte >= this is kept."""
  return int(applied_dropout_rate(rate) * 256)


# Key k (0..15) of a Philox call is byte _KEY_BYTE[k] of word _KEY_WORD[k]
# (src/flash_dropout.h: word w holds keys 2w, 2w+1, 2w+8, 2w+9).
_KEY_WORD = np.array([(k % 8) // 2 for k in range(16)])
_KEY_BYTE = np.array([k % 2 + 2 * (k // 8) for k in range(16)])


def dropout_keep(seeds, seqlen_q: int, seqlen_k: int, rate: float, rows=None):
  """[B, H, T, S] bool (or [B, H, R, S] for query rows `rows`), the kernels'
  keep mask for seeds [B, H, 2] uint32:
  keep(b, h, i, j) = byte (j % 16) of Philox4x32-10(key = seeds[b, h],
  counter = (j // 16, i, 0, 0)) >= dropout_threshold(rate)."""
  groups = -(-seqlen_k // 16)
  j16 = jnp.arange(groups, dtype=jnp.uint32)[None, None, None, :]
  if rows is None:
    rows = jnp.arange(seqlen_q)
  i = rows.astype(jnp.uint32)[None, None, :, None]
  zero = jnp.zeros((), jnp.uint32)
  key = (seeds[:, :, None, None, 0], seeds[:, :, None, None, 1])
  words = jnp.stack(philox4x32((j16, i, zero, zero), key), axis=-1)  # [B, H, T, S/16, 4]
  keys = (words[..., _KEY_WORD] >> jnp.asarray(8 * _KEY_BYTE, jnp.uint32)) & jnp.uint32(0xFF)
  keys = keys.reshape(keys.shape[:3] + (16 * groups,))[..., :seqlen_k]
  return keys >= jnp.uint32(dropout_threshold(rate))


def normalize(scores, sinks=None):
  """(probs, lse [..., R]) of masked scores [..., R, S] (-inf where not visible).

  sinks, if given, broadcasts against [..., R, 1]: one logit per row that
  joins the denominator without a value (attention sinks), so the probs of a
  row sum to 1 - exp(sink - lse) and the LSE includes it.

  The softmax and the LSE do not depend on the shift, so the row max needs no
  gradient. Rows that see no key: probs 0, LSE -inf (the sink, with sinks).
  A NaN score is visible (it is not -inf): its row gets NaN probs and a NaN
  LSE, as in the kernels, so that a diverging run shows NaN instead of a
  silent 0; so does a NaN sink for its rows.
  """
  visible_ = scores != -jnp.inf
  row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  if sinks is not None:
    row_max = jnp.maximum(row_max, jax.lax.stop_gradient(sinks).astype(row_max.dtype))
  safe_max = jnp.where(row_max == -jnp.inf, 0.0, row_max)
  # exp only of visible scores, selected on both sides: no -inf enters exp or
  # its derivative. (With exp(scores - max) over the -inf entries, XLA's GPU
  # backend gave NaN dq in float32 at D = 256 causal T = 257; this form
  # passes that test there.)
  weights = jnp.where(visible_, jnp.exp(jnp.where(visible_, scores - safe_max, 0.0)), 0.0)
  row_sum = jnp.sum(weights, axis=-1, keepdims=True)
  if sinks is not None:
    row_sum = row_sum + jnp.exp(sinks.astype(row_sum.dtype) - safe_max)
  seen = row_sum != 0  # NaN sums (NaN rows) count as seen
  probs = weights / jnp.where(seen, row_sum, 1.0)
  # -inf for empty rows, set by a select rather than log(0) so that their LSE
  # tangent is 0, not 0 / 0.
  lse = jnp.where(seen, safe_max + jnp.log(jnp.where(seen, row_sum, 1.0)), -jnp.inf)[..., 0]
  return probs, lse


def add_sinks(out, lse, sinks):
  """(out, lse) of attention with sinks from (out, lse) computed without them.

  out [..., T, H, D], lse [..., H, T] float32, sinks [H]. A sink only adds
  exp(sink) to each row's denominator, so the probabilities of every key
  shrink by one factor per row, c = exp(lse) / (exp(lse) + exp(sink)) =
  sigmoid(lse - sink), and out' = c * out, lse' = logaddexp(lse, sink)
  exactly (with dropout too: the keep mask multiplies P elementwise). One
  elementwise pass over out, outside the kernels: their differentiable
  (out, lse) carry the gradients, and d sink = sum_rows P_sink (dlse' -
  rowsum(dO * out')) comes from this plain JAX. In float32, cast back to
  out's dtype.
  """
  sink = jnp.asarray(sinks, jnp.float32)[:, None]  # [H, 1] against lse [..., H, T]
  # A row that sees no key (lse -inf): c = 0, lse' = sink. A sink of -inf
  # (traced; concrete ones are refused) is no sink: c = 1 and lse' = lse, the
  # unselected logaddexp fed a finite stand-in so that no NaN reaches the
  # gradient of a row that sees no key either. NaN in lse or sink: NaN.
  no_sink = sink == -jnp.inf
  factor = jax.nn.sigmoid(jnp.where(no_sink, jnp.inf, lse - sink))
  new_lse = jnp.where(no_sink, lse, jnp.logaddexp(lse, jnp.where(no_sink, 0.0, sink)))
  scaled = out.astype(jnp.float32) * jnp.swapaxes(factor, -1, -2)[..., None]
  return scaled.astype(out.dtype), new_lse


def dropout_scale(probs, seeds, config, *, seqlen_q: int, rows=None):
  """Z o probs / (1 - rate) for probs [B, K, G, R, S]: the weights that
  multiply v. The scale is the kernels' float32 1 / (1 - rate)."""
  if config.dropout_rate <= 0:
    return probs
  batch, num_kv_heads, group, num_rows, seqlen_k = probs.shape
  keep = dropout_keep(seeds, seqlen_q, seqlen_k, config.dropout_rate, rows)
  scale = np.float32(1) / (np.float32(1) - np.float32(config.dropout_rate))
  keep = keep.reshape(batch, num_kv_heads, group, num_rows, seqlen_k)
  return jnp.where(keep, probs * scale.astype(probs.dtype), 0.0)
