"""The custom_vjp: residuals are q, k, v, out and lse only (nothing T x S),
plus the small non-differentiated operands (ALiBi slopes, segment ids,
dropout seeds).

The backward recomputes P from the LSE, as FlashAttention-2 does. The LSE output
is differentiable too: its cotangent enters the backward's preprocess as
D = rowsum(dO * O) - dLSE. The ALiBi slopes, segment ids and dropout seeds
get no cotangent (None: zero): the slopes are treated as constants, the ids
and seeds are integers. The dropout mask is regenerated from the seeds in the
backward, never saved.
"""

from __future__ import annotations

import functools

import jax

from jax_flash2 import _sharding


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def attention(q, k, v, alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds, config):
  """(out [B, T, H, D], lse [B, H, T] float32) for the kernels of the platform.

  alibi_slopes [B, H] float32, q_segment_ids [B, T], kv_segment_ids [B, S]
  int32 and dropout_seeds [B, H, 2] uint32 are always passed
  (api.extra_operands); config says which are used.
  """
  return _sharding.forward(q, k, v, alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds,
                           config)


def _attention_fwd(q, k, v, alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds, config):
  extras = (alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds)
  out, lse = _sharding.forward(q, k, v, *extras, config)
  return (out, lse), (q, k, v, out, lse, extras)


def _attention_bwd(config, residuals, cotangents):
  q, k, v, out, lse, extras = residuals
  d_out, d_lse = cotangents
  dq, dk, dv = _sharding.backward(q, k, v, out, lse, d_out.astype(out.dtype), d_lse, *extras,
                                  config)
  return dq, dk, dv, None, None, None, None


attention.defvjp(_attention_fwd, _attention_bwd)
