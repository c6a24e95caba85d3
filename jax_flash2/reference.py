"""Plain-JAX attention with flash_attention's signature and semantics.

It materializes the [B, H, T, S] scores, so it is for documentation, tests and
small inputs. Computation is in float32 (float64 when given float64 inputs with
x64 enabled), the output in the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flash2 import _config, _scores
from jax_flash2._config import AttentionConfig, ExtraOperands
# The score pieces, public here for tests and for users who build on them.
from jax_flash2._scores import (alibi_bias, applied_dropout_rate, dropout_keep, dropout_threshold,
                                philox4x32, visible)

__all__ = ["alibi_bias", "applied_dropout_rate", "attention", "dropout_keep", "dropout_threshold",
           "forward_from_config", "philox4x32", "visible"]


def forward_from_config(q, k, v, extras: ExtraOperands, config: AttentionConfig, sinks=None):
  """(out [B, T, H, D], lse [B, H, T]) for a checked config.

  The extra operands are read only when config says so (ExtraOperands.used).
  sinks [H] (or None) join the softmax itself here, a different computation
  from the kernels' rescale of a finished softmax (_scores.add_sinks).
  """
  compute = jnp.promote_types(q.dtype, jnp.float32)
  batch, seqlen_q, num_heads, head_dim = q.shape
  scores, _ = _scores.masked_scores(q, k, extras, config)
  if sinks is not None:  # [H] -> [1, K, G, 1, 1] against scores [B, K, G, T, S]
    sinks = jnp.asarray(sinks).astype(compute).reshape(1, k.shape[2], -1, 1, 1)
  probs, lse = _scores.normalize(scores, sinks)  # [B, K, G, T, S], [B, K, G, T]
  # After the LSE's row sum: the LSE is of the undropped softmax.
  probs = _scores.dropout_scale(probs, extras.dropout_seeds, config, seqlen_q=seqlen_q)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(compute),
                   precision=jax.lax.Precision.HIGHEST)
  out = out.reshape(batch, seqlen_q, num_heads, head_dim).astype(q.dtype)
  return out, lse.reshape(batch, num_heads, seqlen_q)


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
              return_lse: bool = False, window_size: tuple[int, int] = (-1, -1),
              softcap: float = 0.0, alibi_slopes=None, segment_ids=None,
              dropout_rate: float = 0.0, dropout_rng=None, sinks=None,
              implementation: str | None = None):
  """Same arguments and results as jax_flash2.flash_attention (see there); also
  takes float64 inputs (with x64 enabled), which makes it the tests' oracle."""
  _config.check_bool("return_lse", return_lse)
  config = _config.make_config(q, k, v, causal=causal, softmax_scale=softmax_scale,
                           window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, segment_ids=segment_ids,
                           dropout_rate=dropout_rate, dropout_rng=dropout_rng,
                           implementation=implementation, sinks=sinks,
                           dtypes=_config.SUPPORTED_DTYPES + (jnp.float64,))
  extras = _config.extra_operands(q, k, alibi_slopes, segment_ids, dropout_rng,
                                 config.dropout_rate)
  out, lse = forward_from_config(q, k, v, extras, config, sinks=sinks)
  return (out, lse) if return_lse else out
