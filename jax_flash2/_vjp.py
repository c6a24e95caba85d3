"""The custom_vjp: residuals are q, k, v, out and lse only (nothing T x S).

The backward recomputes P from the LSE, as FlashAttention-2 does. The LSE output
is differentiable too: its cotangent enters the backward's preprocess as
D = rowsum(dO * O) - dLSE.
"""

from __future__ import annotations

import functools

import jax

from jax_flash2 import _sharding


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def attention(q, k, v, config):
  """(out [B, T, H, D], lse [B, H, T] float32) for the kernels of the platform."""
  return _sharding.forward(q, k, v, config)


def _attention_fwd(q, k, v, config):
  out, lse = _sharding.forward(q, k, v, config)
  return (out, lse), (q, k, v, out, lse)


def _attention_bwd(config, residuals, cotangents):
  q, k, v, out, lse = residuals
  d_out, d_lse = cotangents
  return _sharding.backward(q, k, v, out, lse, d_out.astype(out.dtype), d_lse, config)


attention.defvjp(_attention_fwd, _attention_bwd)
