"""Flax layers on the flash kernels (flax.nnx here, flax.linen in `.linen`).

Flax is an optional dependency: `import jax_flash2` never imports it, this
package does.

  MultiHeadAttention     flax.nnx multi-head attention with MHA, GQA and MQA
  dot_product_attention  drop-in `attention_fn` for flax.nnx.MultiHeadAttention
                         and flax.linen.MultiHeadDotProductAttention
"""

from __future__ import annotations

try:
  from flax import nnx
except ImportError as e:  # pragma: no cover - depends on the environment
  raise ImportError(
      "jax_flash2.flax needs flax (pip install flax); jax_flash2.flash_attention "
      "works without it") from e

import jax.numpy as jnp

from jax_flash2 import _config
from jax_flash2.flax._attention_fn import attend, dot_product_attention

__all__ = ["MultiHeadAttention", "dot_product_attention"]


class MultiHeadAttention(nnx.Module):
  """Multi-head attention (flax.nnx) computed by the flash kernels.

  The query projection has `num_heads` heads; key and value projections have
  only `num_kv_heads` (the memory saving of GQA and MQA lives in these smaller
  projections, and the kernels read each kv head for its whole group).
  Submodules and parameters are named as in flax.nnx.MultiHeadAttention
  (query, key, value, out; kernel, bias), so weights move between the two with
  nnx.state / nnx.update.

  Args:
    num_heads: query heads H.
    in_features: features of the query input.
    num_kv_heads: key/value heads K, a divisor of num_heads: num_heads (MHA,
      the default), 1 (MQA) or in between (GQA).
    qkv_features: total query features H * D (default in_features).
    out_features: output features (default in_features).
    in_kv_features: features of the key/value input for cross-attention
      (default in_features).
    causal: mask key j > query i (bottom-right aligned when S != T).
    softmax_scale: logit scale (default 1 / sqrt(D)).
    window_size: (left, right) local attention, as in flash_attention.
    softcap: Gemma-2 score capping, as in flash_attention (0 = off).
    use_sinks: attention sinks (gpt-oss): a learnable parameter `sinks`
      [num_heads] (param_dtype, used as float32), one logit per query head
      joining every row's softmax denominator (flash_attention's sinks).
    sinks_init: its initializer; zeros by default (each sink starts as one
      extra key of score 0 with a zero value).
    dropout_rate: dropout on the attention weights, as in flash_attention
      (0 = off), active unless `deterministic`; the masks come from the
      `dropout` stream of the rngs passed to the call.
    deterministic: default for the call's `deterministic`, Flax's meaning:
      no dropout (needed when dropout_rate > 0: one of the two must be given).
    deterministic_backward: a bit-identical backward (flash_attention's
      `deterministic`; named apart from Flax's `deterministic`).
    dtype: computation dtype (default: inferred from inputs and params).
    param_dtype: parameter dtype.
    kernel_init, bias_init, use_bias: as in flax.nnx.LinearGeneral.
    rngs: the nnx.Rngs for the initializers.
  """

  def __init__(
      self,
      num_heads: int,
      in_features: int,
      *,
      num_kv_heads: int | None = None,
      qkv_features: int | None = None,
      out_features: int | None = None,
      in_kv_features: int | None = None,
      causal: bool = False,
      softmax_scale: float | None = None,
      window_size: tuple[int, int] = (-1, -1),
      softcap: float = 0.0,
      use_sinks: bool = False,
      sinks_init=nnx.initializers.zeros_init(),
      dropout_rate: float = 0.0,
      deterministic: bool | None = None,
      deterministic_backward: bool = False,
      dtype=None,
      param_dtype=jnp.float32,
      kernel_init=nnx.initializers.lecun_normal(),
      bias_init=nnx.initializers.zeros_init(),
      use_bias: bool = True,
      rngs: nnx.Rngs,
  ):
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    qkv_features = in_features if qkv_features is None else qkv_features
    out_features = in_features if out_features is None else out_features
    in_kv_features = in_features if in_kv_features is None else in_kv_features
    _check_heads(num_heads, num_kv_heads, qkv_features)
    _check_dropout_rate(dropout_rate)
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = qkv_features // num_heads
    self.causal = causal
    self.softmax_scale = softmax_scale
    # Anything else than a pair is left for flash_attention to name.
    self.window_size = tuple(window_size) if isinstance(window_size, (tuple, list)) else window_size
    self.softcap = softcap
    self.dropout_rate = dropout_rate
    self.deterministic = deterministic
    self.deterministic_backward = deterministic_backward
    self.dtype = dtype

    def linear(in_features, out_features, **kw):
      return nnx.LinearGeneral(
          in_features, out_features, dtype=dtype, param_dtype=param_dtype,
          kernel_init=kernel_init, bias_init=bias_init, use_bias=use_bias, rngs=rngs, **kw)

    self.query = linear(in_features, (num_heads, self.head_dim))
    self.key = linear(in_kv_features, (num_kv_heads, self.head_dim))
    self.value = linear(in_kv_features, (num_kv_heads, self.head_dim))
    self.out = linear((num_heads, self.head_dim), out_features, axis=(-2, -1))
    self.sinks = (nnx.Param(sinks_init(rngs.params(), (num_heads,), param_dtype))
                  if use_sinks else None)

  def __call__(self, inputs_q, inputs_kv=None, *, segment_ids=None,
               max_segment_length: int | None = None, deterministic: bool | None = None,
               rngs: nnx.Rngs | None = None):
    """inputs_q [..., T, in_features] -> [..., T, out_features].

    Self-attention when inputs_kv is None, else cross-attention on inputs_kv
    [..., S, in_kv_features]. segment_ids: packed documents, integer ids
    [..., T] (self-attention) or a pair ([..., T], [..., S]): a query sees
    only the keys of its own id (causal stays positional, so with T == S it
    is causal within each document). max_segment_length: the longest
    document's key count, a speed hint (see flash_attention); ignored
    without segment_ids. With dropout_rate > 0 and deterministic False,
    rngs (an nnx.Rngs with a `dropout` stream, or an nnx.RngStream) gives the
    dropout key.
    """
    inputs_kv = inputs_q if inputs_kv is None else inputs_kv
    dropout_rate, dropout_rng = 0.0, None
    if self.dropout_rate > 0:
      deterministic = self.deterministic if deterministic is None else deterministic
      if deterministic is None:
        raise ValueError("MultiHeadAttention: dropout_rate > 0 needs deterministic, as a "
                         "constructor or call argument; got None for both")
      if not deterministic:
        if rngs is None:
          raise ValueError("MultiHeadAttention: dropout (dropout_rate > 0, deterministic=False) "
                           "needs rngs with a 'dropout' stream in the call; got None")
        dropout_rate = self.dropout_rate
        dropout_rng = rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs()
    x = attend(
        self.query(inputs_q), self.key(inputs_kv), self.value(inputs_kv),
        causal=self.causal, softmax_scale=self.softmax_scale, window_size=self.window_size,
        softcap=self.softcap, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        deterministic_backward=self.deterministic_backward,
        sinks=None if self.sinks is None else self.sinks[...], segment_ids=segment_ids,
        max_segment_length=max_segment_length)
    return self.out(x)


def _check_heads(num_heads: int, num_kv_heads: int, qkv_features: int) -> None:
  if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(
        f"MultiHeadAttention: num_kv_heads ({num_kv_heads}) must divide num_heads "
        f"({num_heads}): num_heads for MHA, 1 for MQA, a divisor for GQA")
  if qkv_features < 1 or qkv_features % num_heads:
    raise ValueError(
        f"MultiHeadAttention: qkv_features ({qkv_features}) must be a positive multiple of "
        f"num_heads ({num_heads})")


def _check_dropout_rate(dropout_rate) -> None:
  """The module's dropout_rate, checked also when a call is deterministic (a
  negative or NaN rate would otherwise silently mean no dropout)."""
  _config.check_dropout_rate(dropout_rate, "MultiHeadAttention")
