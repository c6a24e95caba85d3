"""Attention in plain JAX over blocks of query rows: never a [B, H, T, S] tensor.

`tangents` is the forward-mode tangent map of (out, lse) (the custom_jvp's
tangent primitive in _autodiff lowers to it on every platform). `forward` and
`backward` compute what the forward and backward kernels compute; _lowering
lowers float32 calls on CUDA to them (the CUDA kernels take 16-bit inputs).
Operands are q [B, T, H, D], k, v [B, S, K, D], lse [B, H, T] and the
ExtraOperands.

The blocks run under lax.map, so at most [B, H, rows, S] scores exist at once;
`block_rows` picks the rows from a budget of score elements.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import _scores
from jax_flash2._config import ExtraOperands

# Query rows per block: at most this many score elements ([B, H, rows, S])
# per float32 temporary, within [_MIN_ROWS, _MAX_ROWS] rows.
_SCORE_BUDGET = 1 << 25
_MIN_ROWS, _MAX_ROWS = 16, 512


def block_rows(batch: int, num_heads: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
  """(rows per block, number of blocks) covering seqlen_q rows; the blocks are
  as even as the multiple-of-8 row count allows, to pad the tail little."""
  most = _SCORE_BUDGET // max(1, batch * num_heads * seqlen_k)
  most = max(_MIN_ROWS, min(_MAX_ROWS, most // 8 * 8))
  if seqlen_q <= most:
    return seqlen_q, 1
  count = -(-seqlen_q // most)
  rows = -(-seqlen_q // count)
  return -(-rows // 8) * 8, count


def _block_plan(q, k):
  batch, seqlen_q, num_heads, _ = q.shape
  # A symbolic batch size (jax.export) cannot pick a block size: budget for
  # one batch entry then.
  return block_rows(batch if isinstance(batch, int) else 1, num_heads, seqlen_q, k.shape[1])


def _to_blocks(x, axis: int, count: int, rows: int, fill=0):
  """x with its query axis padded to count * rows, split into [count, rows],
  the block axis moved first (for lax.map)."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, count * rows - x.shape[axis])
  x = jnp.pad(x, widths, constant_values=fill)
  x = x.reshape(x.shape[:axis] + (count, rows) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _from_blocks(x, axis: int, length: int):
  """The inverse of _to_blocks for a mapped result [count, ..., rows, ...]
  whose query axis is `axis` (counted without the block axis)."""
  x = jnp.moveaxis(x, 0, axis)
  x = x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])
  return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def _grouped(x, num_kv_heads: int):  # [B, R, H, D] -> [B, R, K, G, D]
  batch, rows, num_heads, head_dim = x.shape
  return x.reshape(batch, rows, num_kv_heads, num_heads // num_kv_heads, head_dim)


def _tangent_block(q, tq, lse, q_segment_ids, rows, k, v, tk, tv, extras, config, seqlen_q):
  """(t_out [B, R, H, D], t_lse [B, H, R]) for query rows `rows` (q, tq
  [B, R, H, D], lse [B, H, R], q_segment_ids [B, R]) of a length-seqlen_q
  query sequence.

  With P = exp(s - lse) the forward's probabilities (recomputed from the saved
  LSE, as the backward does) and t_s the tangent of the final scores s:
    t_s   = scale (tq k^T + q tk^T), times the softcap's 1 - tanh^2
    t_lse = rowsum(P * t_s)
    t_out = P tv + (P * (t_s - t_lse)) v
  ALiBi slopes are constants and the mask does not move, so neither has a
  tangent.
  """
  compute = jnp.promote_types(q.dtype, jnp.float32)
  batch, num_rows, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  extras = extras._replace(q_segment_ids=q_segment_ids)
  scores, cap_slope = _scores.masked_scores(q, k, extras, config, seqlen_q=seqlen_q, rows=rows)
  # P = exp(s - lse) from the forward's LSE. Rows that see no key (LSE -inf,
  # and the padded tail) have P = 0: their tangents are 0, not NaN. A NaN LSE
  # (a NaN score) gives NaN tangents.
  lse = lse.reshape(batch, num_kv_heads, group, num_rows)[..., None]
  seen = lse != -jnp.inf
  probs = jnp.where(seen, jnp.exp(scores - jnp.where(seen, lse, 0.0)), 0.0)

  def scores_of(a, b):  # [B, R, K, G, D] x [B, S, K, D] -> [B, K, G, R, S]
    return jnp.einsum("btkgd,bskd->bkgts", a.astype(compute), b.astype(compute),
                      precision=jax.lax.Precision.HIGHEST)

  def rows_of(p, b):  # [B, K, G, R, S] x [B, S, K, D] -> [B, R, K, G, D]
    return jnp.einsum("bkgts,bskd->btkgd", p, b.astype(compute),
                      precision=jax.lax.Precision.HIGHEST)

  # t_s = scale (tq k^T + q tk^T) [* (1 - tanh^2)]; its value where P = 0 is
  # finite and multiplied by 0.
  t_scores = (scores_of(_grouped(tq, num_kv_heads), k)
              + scores_of(_grouped(q, num_kv_heads), tk)) * config.softmax_scale
  if cap_slope is not None:
    t_scores = t_scores * cap_slope
  t_lse = jnp.sum(probs * t_scores, axis=-1)  # [B, K, G, R]
  t_out = rows_of(probs, tv) + rows_of(probs * (t_scores - t_lse[..., None]), v)
  return (t_out.reshape(batch, num_rows, num_heads, head_dim).astype(q.dtype),
          t_lse.reshape(batch, num_heads, num_rows))


def tangents(q, k, v, lse, tq, tk, tv, extras: ExtraOperands, config):
  """(t_out [B, T, H, D], t_lse [B, H, T]) for one batch axis, in query blocks.
  Five T x S matmuls (the scores, two for t_s, two for t_out), in float32."""
  seqlen_q = q.shape[1]
  rows, count = _block_plan(q, k)
  block = functools.partial(_tangent_block, k=k, v=v, tk=tk, tv=tv, extras=extras,
                            config=config, seqlen_q=seqlen_q)
  if count == 1:
    return block(q, tq, lse, extras.q_segment_ids, jnp.arange(seqlen_q))
  # Padded rows get LSE -inf, so P = 0 there.
  xs = (_to_blocks(q, 1, count, rows), _to_blocks(tq, 1, count, rows),
        _to_blocks(lse, 2, count, rows, -jnp.inf),
        _to_blocks(extras.q_segment_ids, 1, count, rows),
        jnp.arange(count * rows).reshape(count, rows))
  t_out, t_lse = jax.lax.map(lambda x: block(*x), xs)  # [n, B, R, H, D], [n, B, H, R]
  return _from_blocks(t_out, 1, seqlen_q), _from_blocks(t_lse, 2, seqlen_q)


def _rows_of(p, x, precision):  # [B, K, G, R, S] x [B, S, K, D] -> [B, R, K, G, D]
  return jnp.einsum("bkgts,bskd->btkgd", p, x, precision=precision)


def forward(q, k, v, extras: ExtraOperands, config, precision=None):
  """(out [B, T, H, D], lse [B, H, T] float32), the forward kernel's results.

  precision is that of the two matmuls (None: jax.default_matmul_precision,
  so TF32 tensor cores for float32 on recent GPUs unless 'highest' is asked
  for); the softmax is in float32 either way.
  """
  compute = jnp.promote_types(q.dtype, jnp.float32)
  batch, seqlen_q, num_heads, head_dim = q.shape
  v = v.astype(compute)

  def block(q_rows, q_segment_ids, rows):
    num_rows = q_rows.shape[1]
    block_extras = extras._replace(q_segment_ids=q_segment_ids)
    scores, _ = _scores.masked_scores(q_rows, k, block_extras, config, seqlen_q=seqlen_q,
                                      rows=rows, precision=precision)
    probs, lse = _scores.normalize(scores)
    probs = _scores.dropout_scale(probs, extras.dropout_seeds, config, seqlen_q=seqlen_q,
                                  rows=rows)
    out = _rows_of(probs, v, precision)
    return (out.reshape(batch, num_rows, num_heads, head_dim).astype(q.dtype),
            lse.reshape(batch, num_heads, num_rows))

  rows, count = _block_plan(q, k)
  if count == 1:
    return block(q, extras.q_segment_ids, jnp.arange(seqlen_q))
  xs = (_to_blocks(q, 1, count, rows), _to_blocks(extras.q_segment_ids, 1, count, rows),
        jnp.arange(count * rows).reshape(count, rows))
  out, lse = jax.lax.map(lambda x: block(*x), xs)  # [n, B, R, H, D], [n, B, H, R]
  return _from_blocks(out, 1, seqlen_q), _from_blocks(lse, 2, seqlen_q)


def backward(q, k, v, out, lse, d_out, d_lse, extras: ExtraOperands, config, precision=None):
  """(dq, dk, dv), the backward kernel's results, FlashAttention-2's backward
  over query blocks (dK, dV accumulated in float32 across them):
    P  = exp(s - lse)                    (recomputed from the forward's LSE)
    D  = rowsum(dO o O) - dLSE
    dP = dO V^T  (times Z / (1 - rate) with dropout)
    dS = P o (dP - D)  (times the softcap's 1 - tanh^2)
    dQ = scale dS K,  dK = scale dS^T Q,  dV = (Z o P / (1 - rate))^T dO
  """
  compute = jnp.promote_types(q.dtype, jnp.float32)
  batch, seqlen_q, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  k32, v32 = k.astype(compute), v.astype(compute)

  def block(carry, x):
    dk, dv = carry
    q_rows, o_rows, do_rows, lse_rows, dlse_rows, q_segment_ids, rows = x
    num_rows = q_rows.shape[1]
    block_extras = extras._replace(q_segment_ids=q_segment_ids)
    scores, cap_slope = _scores.masked_scores(q_rows, k, block_extras, config,
                                              seqlen_q=seqlen_q, rows=rows, precision=precision)
    lse_rows = lse_rows.reshape(batch, num_kv_heads, group, num_rows)[..., None]
    # Rows that saw no key (LSE -inf, and the padded tail) have P = 0; a NaN
    # LSE (a NaN score in the forward) gives NaN P, so the gradients carry it.
    empty = lse_rows == -jnp.inf
    probs = jnp.where(empty, 0.0, jnp.exp(scores - jnp.where(empty, 0.0, lse_rows)))
    do_g = _grouped(do_rows, num_kv_heads).astype(compute)            # [B, R, K, G, D]
    delta = jnp.sum(do_g * _grouped(o_rows, num_kv_heads).astype(compute), axis=-1)
    delta = jnp.moveaxis(delta, 1, -1)                                 # [B, K, G, R]
    delta = delta - dlse_rows.reshape(batch, num_kv_heads, group, num_rows)
    d_probs = jnp.einsum("btkgd,bskd->bkgts", do_g, v32, precision=precision)
    dropped = probs
    if config.dropout_rate > 0:
      keep = _scores.dropout_keep(extras.dropout_seeds, seqlen_q, k.shape[1],
                                  config.dropout_rate, rows)
      keep = keep.reshape(probs.shape)
      keep_scale = (np.float32(1) / (np.float32(1) - np.float32(config.dropout_rate)))
      d_probs = jnp.where(keep, d_probs * keep_scale, 0.0)
      dropped = jnp.where(keep, probs * keep_scale, 0.0)
    d_scores = probs * (d_probs - delta[..., None])
    if cap_slope is not None:
      d_scores = d_scores * cap_slope
    d_scores = d_scores * config.softmax_scale
    dq = _rows_of(d_scores, k32, precision)                            # [B, R, K, G, D]
    q_g = _grouped(q_rows, num_kv_heads).astype(compute)
    dk = dk + jnp.einsum("bkgts,btkgd->bskd", d_scores, q_g, precision=precision)
    dv = dv + jnp.einsum("bkgts,btkgd->bskd", dropped, do_g, precision=precision)
    return (dk, dv), dq.reshape(batch, num_rows, num_heads, head_dim).astype(q.dtype)

  rows, count = _block_plan(q, k)
  zeros = jnp.zeros(k.shape, compute)
  xs = (q, out, d_out, lse, d_lse, extras.q_segment_ids)
  axes = (1, 1, 1, 2, 2, 1)
  if count == 1:
    (dk, dv), dq = block((zeros, zeros), xs + (jnp.arange(seqlen_q),))
  else:
    fills = (0, 0, 0, -jnp.inf, 0, 0)  # padded rows: LSE -inf, so P = 0
    blocks = tuple(_to_blocks(x, a, count, rows, f) for x, a, f in zip(xs, axes, fills))
    blocks += (jnp.arange(count * rows).reshape(count, rows),)
    (dk, dv), dq = jax.lax.scan(block, (zeros, zeros), blocks)
    dq = _from_blocks(dq, 1, seqlen_q)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype)
