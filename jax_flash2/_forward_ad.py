"""Forward-mode tangents of attention, as a linear primitive whose transpose is
the backward kernel.

flash_jvp_p: (q, k, v, out, lse, tq, tk, tv, alibi_slopes, q_segment_ids,
              kv_segment_ids, dropout_seeds) -> (t_out, t_lse)
is linear in the tangents (tq, tk, tv); the rest are the forward's operands
and results. Operands lead with batch axes [*L] as in _sharding: [*L, T, H, D]
for q, out, tq; [*L, S, K, D] for k, v, tk, tv; [*L, H, T] for lse;
[*L, H], [*L, T], [*L, S], [*L, H, 2] for the slopes, segment ids and
dropout seeds. Tangents with dropout are not implemented (the transpose, the
backward kernel, serves dropout: reverse mode works).

With P = exp(s - lse) the forward's probabilities (recomputed from the saved
LSE, as the backward does) and t_s the tangent of the final scores s:
  t_s   = scale (tq k^T + q tk^T), times the softcap's 1 - tanh^2
  t_lse = rowsum(P * t_s)
  t_out = P tv + (P * (t_s - t_lse)) v
ALiBi slopes are constants and the mask does not move, so neither has a
tangent. This is plain JAX, run over blocks of query rows with lax.map so that
at most [B, H, rows, S] scores exist at once, never [B, H, T, S]; it lowers on
every platform. Cost: five T x S matmuls (the scores, two for t_s, two for
t_out) against the forward's two, in float32.

Reverse mode: jax.grad linearizes the custom_jvp (in _vjp) into this
primitive and transposes it. The transpose of a map (tq, tk, tv) -> (t_out,
t_lse) is the map from cotangents (d_out, d_lse) to (dq, dk, dv), which is
exactly the backward kernel; so jax.grad still runs one forward and one
backward kernel, with residuals q, k, v, out, lse.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from jax_flash2 import _sharding, reference

# Query rows per block: at most this many score elements ([B, H, rows, S])
# per float32 temporary, within [_MIN_ROWS, _MAX_ROWS] rows.
_SCORE_BUDGET = 1 << 25
_MIN_ROWS, _MAX_ROWS = 16, 512


def jvp(q, k, v, out, lse, tq, tk, tv, alibi_slopes, q_segment_ids, kv_segment_ids,
        dropout_seeds, config):
  """(t_out, t_lse): the tangents of (out, lse) for tangents (tq, tk, tv)."""
  args = (q, k, v, out, lse, tq, tk, tv, alibi_slopes, q_segment_ids, kv_segment_ids,
          dropout_seeds)
  # Inside shard_map every operand must vary like q (the slopes, ids and
  # instantiated zero tangents may be replicated), as in _sharding.forward.
  args = [_sharding._vary_like(x, q) for x in args]
  return tuple(flash_jvp_p.bind(*args, config=config))


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


def _tangent_block(q, tq, lse, q_segment_ids, rows, k, v, tk, tv, alibi_slopes,
                   kv_segment_ids, config, seqlen_q):
  """(t_out [B, R, H, D], t_lse [B, H, R]) for query rows `rows` (q, tq
  [B, R, H, D], lse [B, H, R], q_segment_ids [B, R]) of a length-seqlen_q
  query sequence."""
  compute = jnp.promote_types(q.dtype, jnp.float32)
  batch, num_rows, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  scores, cap_slope = reference.masked_scores(q, k, alibi_slopes, q_segment_ids, kv_segment_ids,
                                              config, seqlen_q=seqlen_q, rows=rows)
  # P = exp(s - lse) from the forward's LSE. Rows that see no key (LSE -inf,
  # and the padded tail) have P = 0: their tangents are 0, not NaN.
  lse = lse.reshape(batch, num_kv_heads, group, num_rows)[..., None]
  seen = jnp.isfinite(lse)
  probs = jnp.where(seen, jnp.exp(scores - jnp.where(seen, lse, 0.0)), 0.0)

  def grouped(x):  # [B, R, H, D] -> [B, R, K, G, D]
    return x.astype(compute).reshape(batch, num_rows, num_kv_heads, group, head_dim)

  def scores_of(a, b):  # [B, R, K, G, D] x [B, S, K, D] -> [B, K, G, R, S]
    return jnp.einsum("btkgd,bskd->bkgts", a, b.astype(compute),
                      precision=jax.lax.Precision.HIGHEST)

  def rows_of(p, b):  # [B, K, G, R, S] x [B, S, K, D] -> [B, R, K, G, D]
    return jnp.einsum("bkgts,bskd->btkgd", p, b.astype(compute),
                      precision=jax.lax.Precision.HIGHEST)

  # t_s = scale (tq k^T + q tk^T) [* (1 - tanh^2)]; its value where P = 0 is
  # finite and multiplied by 0.
  t_scores = (scores_of(grouped(tq), k) + scores_of(grouped(q), tk)) * config.softmax_scale
  if cap_slope is not None:
    t_scores = t_scores * cap_slope
  t_lse = jnp.sum(probs * t_scores, axis=-1)  # [B, K, G, R]
  t_out = rows_of(probs, tv) + rows_of(probs * (t_scores - t_lse[..., None]), v)
  return (t_out.reshape(batch, num_rows, num_heads, head_dim).astype(q.dtype),
          t_lse.reshape(batch, num_heads, num_rows))


def tangents(q, k, v, lse, tq, tk, tv, alibi_slopes, q_segment_ids, kv_segment_ids, config):
  """(t_out [B, T, H, D], t_lse [B, H, T]) for one batch axis, in query blocks."""
  batch, seqlen_q, num_heads, _ = q.shape
  # A symbolic batch size (jax.export) cannot pick a block size: budget for
  # one batch entry then.
  rows, count = block_rows(batch if isinstance(batch, int) else 1, num_heads, seqlen_q,
                           k.shape[1])
  block = functools.partial(_tangent_block, k=k, v=v, tk=tk, tv=tv, alibi_slopes=alibi_slopes,
                            kv_segment_ids=kv_segment_ids, config=config, seqlen_q=seqlen_q)
  if count == 1:
    return block(q, tq, lse, q_segment_ids, jnp.arange(seqlen_q))
  # Pad T to count * rows (padded rows get LSE -inf, so P = 0 there), split it
  # into [count, rows] and put the block axis first for lax.map.
  pad = count * rows - seqlen_q

  def blocks(x, axis, fill=0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    x = jnp.pad(x, widths, constant_values=fill)
    x = x.reshape(x.shape[:axis] + (count, rows) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)

  xs = (blocks(q, 1), blocks(tq, 1), blocks(lse, 2, -jnp.inf), blocks(q_segment_ids, 1),
        jnp.arange(count * rows).reshape(count, rows))
  t_out, t_lse = jax.lax.map(lambda x: block(*x), xs)  # [n, B, R, H, D], [n, B, H, R]
  t_out = jnp.moveaxis(t_out, 0, 1).reshape((batch, count * rows) + t_out.shape[3:])
  t_lse = jnp.moveaxis(t_lse, 0, 2).reshape(batch, num_heads, count * rows)
  return t_out[:, :seqlen_q], t_lse[..., :seqlen_q]


def _impl(q, k, v, out, lse, tq, tk, tv, alibi_slopes, q_segment_ids, kv_segment_ids,
          dropout_seeds, *, config):
  """flash_jvp_p on [*L] leading axes: merge them into B, compute, split them."""
  del out, dropout_seeds  # only the transpose (the backward kernel) reads them
  # Raised here, where tangents are computed, not in the custom_jvp rule:
  # jax.grad traces that rule too and never evaluates this.
  if config.dropout_rate > 0:
    raise NotImplementedError(
        "flash_attention: forward-mode AD (jax.jvp, jax.jacfwd, jax.hessian) with "
        f"dropout_rate > 0 is not implemented (got dropout_rate={config.dropout_rate}); "
        "reverse mode (jax.grad) is, or use implementation=\"reference\"")
  lead = q.shape[:-3]
  args = (q, k, v, lse, tq, tk, tv, alibi_slopes, q_segment_ids, kv_segment_ids)
  t_out, t_lse = tangents(*(x.reshape((-1,) + x.shape[len(lead):]) for x in args), config)
  return [t_out.reshape(lead + t_out.shape[1:]), t_lse.reshape(lead + t_lse.shape[1:])]


def _abstract_eval(q, k, v, out, lse, *rest, config):
  del out, rest, config
  outs = [jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(lse.shape, jnp.float32)]
  # Same mesh typing as the forward's (out, lse): sharding in types, and the
  # shard_map axes the operands vary over.
  return _sharding._result_types(outs, (q, k, v, lse), backward=False)


def _batch(args, dims, *, config):
  # The vmapped axis becomes one more leading batch axis, as in _sharding.
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
  return flash_jvp_p.bind(*args, config=config), [0, 0]


def _jvp(primals, tangents_in, *, config):
  # The primitive is nonlinear in q, k, v and lse (for second-order forward
  # mode): differentiate its plain-JAX definition.
  tangents_in = tuple(ad.instantiate_zeros(t) for t in tangents_in)
  return jax.jvp(functools.partial(_impl, config=config), tuple(primals), tangents_in)


def _transpose(cotangents, q, k, v, out, lse, tq, tk, tv, alibi_slopes, q_segment_ids,
               kv_segment_ids, dropout_seeds, *, config):
  """(d_out, d_lse) -> (dq, dk, dv) on the tangent operands: the backward."""
  d_out, d_lse = cotangents
  none = [None] * 12  # no cotangent for the operands other than tq, tk, tv
  if type(d_out) is ad.Zero and type(d_lse) is ad.Zero:
    return none
  d_out, d_lse = (_sharding._vary_like(ad.instantiate_zeros(c), q) for c in (d_out, d_lse))
  grads = _backward(q, k, v, out, lse, d_out.astype(out.dtype), d_lse, alibi_slopes,
                    q_segment_ids, kv_segment_ids, dropout_seeds, config)
  for i, (operand, grad) in enumerate(zip((tq, tk, tv), grads)):
    if ad.is_undefined_primal(operand):
      none[5 + i] = grad
  return none


@functools.partial(jax.custom_jvp, nondiff_argnums=(11,))
def _backward(q, k, v, out, lse, d_out, d_lse, alibi_slopes, q_segment_ids, kv_segment_ids,
              dropout_seeds, config):
  """The backward kernel, differentiable once more in forward mode (for
  jax.hessian, jvp-of-grad)."""
  return _sharding.backward(q, k, v, out, lse, d_out, d_lse, alibi_slopes, q_segment_ids,
                            kv_segment_ids, dropout_seeds, config)


@_backward.defjvp
def _backward_jvp(config, primals, tangents_in):
  # The backward is the transpose of `_impl` in (tq, tk, tv); differentiate
  # that plain-JAX transpose. The tangent of `out` is not needed: the plain
  # backward reads P v where the kernel reads out, equal as functions of q, k, v.
  q, k, v, out, lse, d_out, d_lse, *extras = primals

  def plain(q, k, v, lse, d_out, d_lse, *extras):
    linear = functools.partial(_impl, q, k, v, out, lse, config=config)
    transpose = jax.linear_transpose(
        lambda tq, tk, tv: linear(tq, tk, tv, *extras), q, k, v)
    return transpose([d_out, d_lse])

  tangents_in = [ad.instantiate_zeros(t) for t in tangents_in]
  del tangents_in[3]  # out
  return jax.jvp(plain, (q, k, v, lse, d_out, d_lse, *extras), tuple(tangents_in))


flash_jvp_p = Primitive("jax_flash2_jvp")
flash_jvp_p.multiple_results = True
flash_jvp_p.def_impl(lambda *args, config: jax.jit(functools.partial(_impl, config=config))(*args))
flash_jvp_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[flash_jvp_p] = _batch
ad.primitive_jvps[flash_jvp_p] = _jvp
ad.primitive_transposes[flash_jvp_p] = _transpose
mlir.register_lowering(flash_jvp_p, mlir.lower_fun(_impl, multiple_results=True))
