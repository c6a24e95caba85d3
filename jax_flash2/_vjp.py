"""attention as a custom_jvp whose tangent map transposes into the backward kernel.

Forward mode (jax.jvp, jax.jacfwd): the forward kernel gives (out, lse), and
_forward_ad.jvp gives their tangents in plain JAX, blockwise over query rows
(not with dropout: NotImplementedError).

Reverse mode (jax.grad, jax.vjp): JAX linearizes the jvp rule and transposes
the tangent primitive, whose transpose is the backward kernel. The residuals
are q, k, v, out and lse only (nothing T x S), plus the small
non-differentiated operands (ALiBi slopes, segment ids, dropout seeds), and
the backward recomputes P from the LSE, as FlashAttention-2 does. The LSE
output is differentiable too: its cotangent enters the backward's preprocess
as D = rowsum(dO * O) - dLSE. The ALiBi slopes, segment ids and dropout seeds
get no tangent and no cotangent: the slopes are treated as constants, the ids
and seeds are integers. The dropout mask is regenerated from the seeds in the
backward, never saved.
"""

from __future__ import annotations

import functools

import jax

from jax_flash2 import _forward_ad, _sharding


@functools.partial(jax.custom_jvp, nondiff_argnums=(7,))
def attention(q, k, v, alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds, config):
  """(out [B, T, H, D], lse [B, H, T] float32) for the kernels of the platform.

  alibi_slopes [B, H] float32, q_segment_ids [B, T], kv_segment_ids [B, S]
  int32 and dropout_seeds [B, H, 2] uint32 are always passed
  (api.extra_operands); config says which are used.
  """
  return _sharding.forward(q, k, v, alibi_slopes, q_segment_ids, kv_segment_ids, dropout_seeds,
                           config)


@attention.defjvp
def _attention_jvp(config, primals, tangents):
  q, k, v, *extras = primals
  tq, tk, tv = tangents[:3]
  # Calling attention itself (not the kernel) keeps the primal differentiable
  # by an outer jvp: nested forward mode sees this custom_jvp again.
  out, lse = attention(*primals, config)
  t_out, t_lse = _forward_ad.jvp(q, k, v, out, lse, tq, tk, tv, *extras, config)
  return (out, lse), (t_out, t_lse)
