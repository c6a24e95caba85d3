"""The flash MultiHeadAttention for flax.linen."""

from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from jax_flash2.flax import _check_dropout_rate, _check_heads
from jax_flash2.flax._attention_fn import attend, dot_product_attention

__all__ = ["MultiHeadAttention", "dot_product_attention"]


class MultiHeadAttention(nn.Module):
  """Multi-head attention (flax.linen) computed by the flash kernels.

  The Linen twin of jax_flash2.flax.MultiHeadAttention (see there for the
  arguments; the dropout key comes from the 'dropout' rng collection).
  Parameters are named as in flax.linen.MultiHeadDotProductAttention
  (query, key, value, out; kernel, bias) with key and value projecting to
  `num_kv_heads` heads only; with use_sinks, a parameter `sinks` [num_heads].
  """

  num_heads: int
  num_kv_heads: int | None = None
  qkv_features: int | None = None
  out_features: int | None = None
  causal: bool = False
  softmax_scale: float | None = None
  window_size: tuple[int, int] = (-1, -1)
  softcap: float = 0.0
  use_sinks: bool = False
  sinks_init: Callable = nn.initializers.zeros_init()
  dropout_rate: float = 0.0
  deterministic: bool | None = None
  deterministic_backward: bool = False
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()
  use_bias: bool = True

  @nn.compact
  def __call__(self, inputs_q, inputs_kv=None, deterministic: bool | None = None,
               segment_ids=None, max_segment_length: int | None = None):
    """inputs_q [..., T, F] -> [..., T, out_features]; cross-attention on
    inputs_kv [..., S, F_kv] when given. deterministic (here or as a field)
    is needed when dropout_rate > 0. segment_ids and max_segment_length:
    packed documents, as in jax_flash2.flax.MultiHeadAttention."""
    inputs_kv = inputs_q if inputs_kv is None else inputs_kv
    _check_dropout_rate(self.dropout_rate)
    dropout_rate, dropout_rng = 0.0, None
    if self.dropout_rate > 0 and not nn.merge_param("deterministic", self.deterministic,
                                                    deterministic):
      dropout_rate, dropout_rng = self.dropout_rate, self.make_rng("dropout")
    num_kv_heads = self.num_heads if self.num_kv_heads is None else self.num_kv_heads
    qkv_features = self.qkv_features or inputs_q.shape[-1]
    out_features = self.out_features or inputs_q.shape[-1]
    _check_heads(self.num_heads, num_kv_heads, qkv_features)
    head_dim = qkv_features // self.num_heads
    sinks = (self.param("sinks", self.sinks_init, (self.num_heads,), self.param_dtype)
             if self.use_sinks else None)

    def dense(features, name, axis=-1):
      return nn.DenseGeneral(
          features, axis=axis, dtype=self.dtype, param_dtype=self.param_dtype,
          kernel_init=self.kernel_init, bias_init=self.bias_init,
          use_bias=self.use_bias, name=name)

    x = attend(
        dense((self.num_heads, head_dim), "query")(inputs_q),
        dense((num_kv_heads, head_dim), "key")(inputs_kv),
        dense((num_kv_heads, head_dim), "value")(inputs_kv),
        causal=self.causal, softmax_scale=self.softmax_scale, window_size=self.window_size,
        softcap=self.softcap, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        deterministic_backward=self.deterministic_backward, sinks=sinks,
        segment_ids=segment_ids, max_segment_length=max_segment_length)
    return dense(out_features, "out", axis=(-2, -1))(x)
