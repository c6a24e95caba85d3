"""The attention call shared by the Flax modules, and the attention_fn drop-in.

Flax lays attention out as [..., T, H, D] with any number of batch axes (or
none); the kernels take exactly one, so the batch axes are merged into B here.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jax_flash2 import api


def attend(query, key, value, *, causal: bool, softmax_scale=None, dtype=None,
           window_size=(-1, -1), softcap: float = 0.0, dropout_rate: float = 0.0,
           dropout_rng=None, deterministic_backward: bool = False,
           causal_top_left: bool = False, sinks=None, segment_ids=None,
           max_segment_length: int | None = None):
  """flash_attention on Flax's layout: query [..., T, H, D], key, value [..., S, K, D].

  dtype, when given, is the computation dtype (as in Flax); otherwise the three
  are promoted to a common dtype. dropout_rate > 0 drops attention weights with
  masks drawn from dropout_rng (see flash_attention). deterministic_backward is
  flash_attention's `deterministic` (a bit-identical backward). sinks: None
  or [H], flash_attention's attention sinks (taken as float32).

  segment_ids: packed documents. None; integer ids [..., T] for
  self-attention (the same ids for queries and keys, T == S); or a pair
  (q_segment_ids [..., T], kv_segment_ids [..., S]). Query i sees key j only
  when their ids are equal (flash_attention's segment_ids; the kernels skip
  the blocks of different documents). causal stays positional: on a row of
  packed documents (T == S) it is causal within each document.
  max_segment_length: flash_attention's speed hint, the longest document's
  key count; ignored without segment_ids.

  causal is bottom-right aligned (query i sees keys j <= i + S - T), unless
  causal_top_left: then query i sees keys j <= i, as Flax's and jax.nn's
  is_causal (jnp.tril(ones(T, S))). On the bottom-right diagonal that is a
  right window of T - S: for T > S the window (-1, T - S) without causal; for
  T < S the keys past T are seen by no query, so they are dropped and the
  rest is causal on T x T (their gradients are zero).
  """
  dtype = jnp.dtype(dtype) if dtype is not None else jnp.result_type(query, key, value)
  query, key, value = (x.astype(dtype) for x in (query, key, value))
  for name, x in (("query", query), ("key", key), ("value", value)):
    if x.ndim < 3:
      raise ValueError(f"dot_product_attention: {name} must be [..., T|S, H|K, D] (rank >= 3); "
                       f"got shape {x.shape}")
  batch = query.shape[:-3]
  if key.shape[:-3] != batch or value.shape[:-3] != batch:
    raise ValueError(
        "dot_product_attention: query, key and value must share their batch axes "
        f"[..., T|S, H|K, D]; got shapes {query.shape}, {key.shape}, {value.shape}")

  def merged(x):
    return x.reshape((math.prod(batch),) + x.shape[-3:])

  seqlen_q, seqlen_k = query.shape[-3], key.shape[-3]
  q_ids, kv_ids = _segment_id_pair(segment_ids, batch, seqlen_q, seqlen_k)
  if causal and causal_top_left and seqlen_q != seqlen_k:
    if tuple(window_size) != (-1, -1):
      raise ValueError("dot_product_attention: top-left causal takes no window_size; got "
                       f"{window_size}")
    if seqlen_q > seqlen_k:
      causal, window_size = False, (-1, seqlen_q - seqlen_k)
    else:
      key, value = key[..., :seqlen_q, :, :], value[..., :seqlen_q, :, :]
      kv_ids = None if kv_ids is None else kv_ids[..., :seqlen_q]
  ids = None if q_ids is None else (q_ids.reshape(-1, q_ids.shape[-1]),
                                    kv_ids.reshape(-1, kv_ids.shape[-1]))
  out = api.flash_attention(
      merged(query), merged(key), merged(value), causal=causal, softmax_scale=softmax_scale,
      window_size=window_size, softcap=softcap, dropout_rate=dropout_rate,
      dropout_rng=dropout_rng, deterministic=deterministic_backward, segment_ids=ids,
      max_segment_length=None if ids is None else max_segment_length,
      sinks=None if sinks is None else jnp.asarray(sinks).astype(jnp.float32))
  return out.reshape(batch + out.shape[1:])


def _segment_id_pair(segment_ids, batch: tuple, seqlen_q: int, seqlen_k: int):
  """(q ids [..., T], kv ids [..., S]) from attend's segment_ids, or (None, None)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be ids [..., T] or a pair (q_segment_ids [..., T], "
                       f"kv_segment_ids [..., S]); got a sequence of {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
  else:
    if seqlen_q != seqlen_k:
      raise ValueError(f"segment_ids: one array serves self-attention (T == S); with T = "
                       f"{seqlen_q} queries and S = {seqlen_k} keys pass a pair "
                       "(q_segment_ids [..., T], kv_segment_ids [..., S])")
    q_ids = kv_ids = segment_ids
  for name, ids, length, letter in (("q_segment_ids", q_ids, seqlen_q, "T"),
                                    ("kv_segment_ids", kv_ids, seqlen_k, "S")):
    if not hasattr(ids, "shape") or tuple(ids.shape) != batch + (length,):
      raise ValueError(f"segment_ids: {name} must have the batch axes and {letter} of the "
                       f"inputs, {batch + (length,)}; got "
                       f"{getattr(ids, 'shape', type(ids).__name__)}")
  return jnp.asarray(q_ids), jnp.asarray(kv_ids)


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    *,
    deterministic_backward: bool = False,
    segment_ids=None,
):
  """A drop-in `attention_fn` for `flax.nnx.MultiHeadAttention` and
  `flax.linen.MultiHeadDotProductAttention`, running the flash kernels.

  Takes their layout (query [..., T, H, D], key and value [..., S, K, D], K
  dividing H) and their keyword arguments. It serves the calls the kernels can:
  no `bias`, no `mask` (causal masking through `is_causal`, or the `causal`
  flag of jax_flash2.flax.MultiHeadAttention), no sown weights; any other call
  raises a ValueError that names the argument.
  Dropout (`dropout_rate` > 0 and not `deterministic`) runs in the kernels,
  with masks drawn from `dropout_rng`. They are independent per batch entry
  and head whatever `broadcast_dropout` says (Flax's default True shares one
  mask across them): each weight is still kept with probability
  1 - dropout_rate, but the masks are not Flax's.
  `is_causal` means what it means there: query i sees keys j <= i, aligned
  top-left (Flax builds jnp.tril(ones(T, S))), also when T != S. (The
  `causal` of flash_attention and of jax_flash2.flax.MultiHeadAttention is
  aligned bottom-right, as FlashAttention-2's; the two agree when T == S.)
  `deterministic` is Flax's: no dropout. `deterministic_backward` (a keyword
  of this function only, e.g. through functools.partial) asks the kernels for
  a bit-identical backward, flash_attention's `deterministic`.
  `segment_ids` (a keyword of this function only): packed documents, ids
  [..., T] or a pair ([..., T], [..., S]) as in jax_flash2.flax.MultiHeadAttention.
  Flax's own modules hand an attention_fn a `mask` only, which cannot be
  served; to train on packed rows, pass segment_ids to the call of
  jax_flash2.flax.MultiHeadAttention (or its Linen twin), or call this
  function with them.
  `precision` is accepted and ignored: the kernels multiply in the input dtype
  and accumulate in float32. `force_fp32_for_softmax` holds by construction.
  """
  del broadcast_dropout, precision, promote_dtype, force_fp32_for_softmax
  if bias is not None:
    raise ValueError(
        "jax_flash2.flax.dot_product_attention: bias is not supported (the kernels "
        "never form the [T, S] logits); use flax's own dot_product_attention or "
        "jax.nn.dot_product_attention for attention with a bias")
  if mask is not None:
    raise ValueError(
        "jax_flash2.flax.dot_product_attention: mask is not supported; for causal "
        "attention pass is_causal=True (flax.nnx) or use "
        "jax_flash2.flax.MultiHeadAttention(causal=True) / "
        "jax_flash2.flax.linen.MultiHeadAttention(causal=True), for packed documents "
        "their segment_ids argument (or segment_ids= here), and for other masks "
        "use flax's own dot_product_attention")
  if deterministic:
    dropout_rate = 0.0
  elif dropout_rate > 0.0 and dropout_rng is None:
    raise ValueError(
        f"jax_flash2.flax.dot_product_attention: dropout_rate={dropout_rate} with "
        "deterministic=False needs dropout_rng (Flax passes it from the 'dropout' "
        "rng stream); got None")
  if module is not None:
    raise ValueError(
        "jax_flash2.flax.dot_product_attention: module (sow_weights=True) is not "
        "supported, the attention weights are never materialized; call with "
        "sow_weights=False or use flax's own dot_product_attention")
  return attend(query, key, value, causal=is_causal, dtype=dtype, dropout_rate=dropout_rate,
                dropout_rng=dropout_rng, deterministic_backward=deterministic_backward,
                causal_top_left=True, segment_ids=segment_ids)
