"""Float64 oracle and the 'plain same-dtype attention' that sets the tolerance.

The tolerance of the standards: for fp16/bf16, our error against the float64
oracle must be within 2x (plus a small absolute slack) of the error of a plain
attention computed in that dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import reference

ABS_SLACK = {jnp.dtype(jnp.float16): 2e-3, jnp.dtype(jnp.bfloat16): 1e-2,
             jnp.dtype(jnp.float32): 2e-5}


def _window(seqlen_q, seqlen_k, causal, window_size):
  left, right = window_size
  if causal:
    right = 0 if right < 0 else min(right, 0)
  return np.asarray(reference.visible(seqlen_q, seqlen_k, left, right))


def _alibi(slopes, batch, num_heads, seqlen_q, seqlen_k):
  """[B, H, T, S] float64: -slope * |i + S - T - j|, for slopes [H] or [B, H]."""
  slopes = np.broadcast_to(np.asarray(slopes, np.float64), (batch, num_heads))
  i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
  j = np.arange(seqlen_k)[None, :]
  return -slopes[:, :, None, None] * np.abs(i - j)


def oracle(q, k, v, d_out, d_lse, *, causal=False, softmax_scale=None, window_size=(-1, -1),
           softcap=0.0, alibi_slopes=None, segment_ids=None, dropout_keep=None,
           dropout_rate=0.0, sinks=None):
  """out, lse and (dq, dk, dv) of loss = <out, d_out> + <lse, d_lse>, in float64 numpy.

  Written directly from the definition (softmax of the masked, scaled scores and
  its textbook derivative), independent of the kernels' blocking. Dropout takes
  the keep mask as given ([B, H, T, S] bool): out = (Z o P / (1 - rate)) v.
  sinks [H]: exp(sinks[h]) joins each row's denominator (no value); the
  gradients are then (dq, dk, dv, dsinks).
  """
  q, k, v, d_out, d_lse = (np.asarray(x, np.float64) for x in (q, k, v, d_out, d_lse))
  batch, seqlen_q, num_heads, head_dim = q.shape
  seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
  qh = q.transpose(0, 2, 1, 3)                                   # [B, H, T, D]
  kh = np.repeat(k.transpose(0, 2, 1, 3), group, axis=1)         # [B, H, S, D]
  vh = np.repeat(v.transpose(0, 2, 1, 3), group, axis=1)
  mask = _window(seqlen_q, seqlen_k, causal, window_size)
  if segment_ids is not None:
    q_ids, kv_ids = (np.asarray(x) for x in segment_ids)
    mask = mask & (q_ids[:, None, :, None] == kv_ids[:, None, None, :])  # [B, 1, T, S]
  scores = scale * (qh @ kh.transpose(0, 1, 3, 2))
  slope = 1.0
  if softcap:
    capped = np.tanh(scores / softcap)
    slope = 1.0 - capped**2  # d(softcap * tanh(s / softcap)) / ds
    scores = softcap * capped
  if alibi_slopes is not None:  # after the cap; a constant, so no effect on ds
    scores = scores + _alibi(alibi_slopes, batch, num_heads, seqlen_q, seqlen_k)
  scores = np.where(mask, scores, -np.inf)
  row_max = scores.max(-1, keepdims=True)
  if sinks is not None:
    sink = np.asarray(sinks, np.float64)[None, :, None, None]     # [1, H, 1, 1]
    row_max = np.maximum(row_max, sink)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  weights = np.exp(scores - row_max)
  row_sum = weights.sum(-1, keepdims=True)
  if sinks is not None:
    sink_weight = np.exp(sink - row_max)                         # [B, H, T, 1]
    row_sum = row_sum + sink_weight
  with np.errstate(divide="ignore"):
    lse = (row_max + np.log(row_sum))[..., 0]                    # [B, H, T]; -inf if empty
  probs = weights / np.where(row_sum > 0, row_sum, 1.0)
  # dropped = Z o P / (1 - rate): what multiplies v; d dropped / d P = Z / (1 - rate),
  # at the rate the mask applies (a multiple of 1/256).
  keep_scale = 1.0
  if dropout_keep is not None:
    rate = reference.applied_dropout_rate(dropout_rate)
    keep_scale = np.asarray(dropout_keep, np.float64) / (1.0 - rate)
  dropped = probs * keep_scale
  out = dropped @ vh                                             # [B, H, T, D]
  do = d_out.transpose(0, 2, 1, 3)
  dl = np.where(np.isfinite(lse), d_lse, 0.0)
  dv = dropped.transpose(0, 1, 3, 2) @ do
  dp = (do @ vh.transpose(0, 1, 3, 2)) * keep_scale
  ds = probs * (dp - (do * out).sum(-1, keepdims=True) + dl[..., None]) * slope
  dq = scale * ds @ kh
  dk = scale * ds.transpose(0, 1, 3, 2) @ qh

  def per_kv_head(x):  # [B, H, S, D] -> [B, S, K, D], summed over each group
    return x.reshape(batch, num_kv_heads, group, seqlen_k, head_dim).sum(2).transpose(0, 2, 1, 3)

  grads = (dq.transpose(0, 2, 1, 3), per_kv_head(dk), per_kv_head(dv))
  if sinks is not None:
    # lse = log(exp(sink) + sum_j exp(s_ij)), out_i = sum_j P_ij v_j with
    # P_ij = exp(s_ij - lse_i): d lse_i / d sink = P_sink_i, d out_i / d lse_i = -out_i.
    p_sink = (sink_weight / row_sum)[..., 0]                     # [B, H, T]
    grads += ((p_sink * (dl - (do * out).sum(-1))).sum((0, 2)),)
  return (out.transpose(0, 2, 1, 3), lse), grads


@functools.partial(jax.jit, static_argnames=("causal", "softmax_scale", "window_size", "softcap",
                                             "dropout_rate"))
def naive_same_dtype(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                     softcap=0.0, alibi_slopes=None, segment_ids=None, dropout_keep=None,
                     dropout_rate=0.0, sinks=None):
  """(out, lse) computed entirely in the inputs' dtype, as a plain implementation would
  (sinks [H]: one more logit per row, as gpt-oss's reference concatenates it)."""
  dtype = q.dtype
  batch, seqlen_q, num_heads, head_dim = q.shape
  seqlen_k, num_kv_heads = k.shape[1], k.shape[2]
  group = num_heads // num_kv_heads
  scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
  left, right = window_size
  if causal:
    right = 0 if right < 0 else min(right, 0)
  kr = jnp.repeat(k, group, axis=2)
  vr = jnp.repeat(v, group, axis=2)
  scores = jnp.einsum("bthd,bshd->bhts", q, kr, preferred_element_type=dtype) * jnp.asarray(scale, dtype)
  if softcap:
    scores = jnp.asarray(softcap, dtype) * jnp.tanh(scores / jnp.asarray(softcap, dtype))
  if alibi_slopes is not None:
    # The bias computed in float32 and rounded once, as a plain implementation
    # adding a precomputed bias would.
    slopes = jnp.broadcast_to(alibi_slopes, (batch, num_heads)).astype(jnp.float32)
    scores = scores + reference.alibi_bias(slopes, seqlen_q, seqlen_k).astype(dtype)
  mask = reference.visible(seqlen_q, seqlen_k, left, right)
  if segment_ids is not None:
    mask = mask & (segment_ids[0][:, None, :, None] == segment_ids[1][:, None, None, :])
  scores = jnp.where(mask, scores, jnp.asarray(-jnp.inf, dtype))
  lse = jax.nn.logsumexp(scores, axis=-1)
  if sinks is not None:
    lse = jnp.logaddexp(lse, sinks.astype(dtype)[None, :, None])
  probs = jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0)[..., None])
  if dropout_keep is not None:
    rate = reference.applied_dropout_rate(dropout_rate)
    probs = jnp.where(dropout_keep, probs * jnp.asarray(1 / (1 - rate), dtype), 0)
  out = jnp.einsum("bhts,bshd->bthd", probs.astype(dtype), vr, preferred_element_type=dtype)
  return out, lse


def max_err(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
  with np.errstate(invalid="ignore"):
    diff = np.where(both_inf, 0.0, np.abs(a - b))
  return float(np.max(diff)) if diff.size else 0.0


def assert_close_to_oracle(name, ours, expected, baseline, dtype):
  """|ours - expected| <= 2 |baseline - expected| + slack, elementwise max norms."""
  ours = np.asarray(ours, np.float64)
  assert np.all(np.isfinite(ours) | np.isinf(np.asarray(expected))), f"{name}: non-finite values"
  err = max_err(ours, expected)
  base = max_err(baseline, expected)
  scale = max(1.0, float(np.max(np.abs(np.where(np.isfinite(expected), expected, 0)))))
  bound = 2.0 * base + ABS_SLACK[jnp.dtype(dtype)] * scale
  assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} (plain {jnp.dtype(dtype).name}: {base:.3g})"
