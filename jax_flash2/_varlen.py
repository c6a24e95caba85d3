"""Packed variable-length sequences in FlashAttention's convention, on top of
flash_attention with segment ids.

The tokens of n sequences are packed along one axis and delimited by
cu_seqlens (cumulative lengths, [n + 1], starting at 0). Each sequence is
gathered into one row of a padded [n, max_seqlen, ...] batch, *right-aligned*
(padding first), and padding gets segment ids that match nothing. Right
alignment makes the padded problem's bottom-right diagonal coincide with every
sequence's own bottom-right diagonal, so causal and window masks follow each
sequence, as in FlashAttention-2's varlen kernels. The kernels skip the key
blocks that hold only padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_Q_PAD_ID = -1  # padding queries and keys never share an id with each other
_KV_PAD_ID = -2  # or with real tokens (id 0)


def check_cu_seqlens(name: str, cu_seqlens, total: int, max_seqlen) -> None:
  """Shape, dtype and (when the values are known at trace time) content checks."""
  if not hasattr(cu_seqlens, "dtype") or not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
    raise TypeError(f"flash_attention_varlen: {name} must be an integer array; got "
                    f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)}")
  if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
    raise ValueError(f"flash_attention_varlen: {name} must be 1-D [n + 1] with n >= 1; got shape "
                     f"{tuple(cu_seqlens.shape)}")
  if isinstance(cu_seqlens, jax.core.Tracer):
    return  # values unknown until run time
  values = np.asarray(cu_seqlens)
  lengths = np.diff(values)
  if values[0] != 0 or values[-1] != total or np.any(lengths < 0):
    raise ValueError(f"flash_attention_varlen: {name} must start at 0, be non-decreasing and end "
                     f"at the number of tokens ({total}); got {values.tolist()}")
  if lengths.max(initial=0) > max_seqlen:
    raise ValueError(f"flash_attention_varlen: a sequence of {name} has {int(lengths.max())} "
                     f"tokens, more than max_seqlen = {max_seqlen}")


def _padded_index(cu_seqlens, max_seqlen: int):
  """[n, P] token index of each padded slot (clipped) and whether it is real."""
  lengths = cu_seqlens[1:] - cu_seqlens[:-1]
  slot = jnp.arange(max_seqlen)[None, :]
  first_real = max_seqlen - lengths[:, None]  # right-aligned: padding first
  index = cu_seqlens[:-1, None] + slot - first_real
  return index, slot >= first_real


def _slot_of_token(cu_seqlens, max_seqlen: int, total: int):
  """Flat index into [n * P] of each packed token."""
  token = jnp.arange(total)
  seq = jnp.searchsorted(cu_seqlens[1:], token, side="right")
  lengths = cu_seqlens[1:] - cu_seqlens[:-1]
  return seq * max_seqlen + (max_seqlen - lengths[seq]) + (token - cu_seqlens[seq])


def varlen_attention(attention, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     return_lse, **options):
  """out [total_q, H, D] (and lse [H, total_q]) through `attention` on a padded batch."""
  if q.shape[0] == 0 or k.shape[0] == 0:
    # No query, or no key for any query: nothing to gather from (jnp.take
    # of an empty axis fails). Every query sees no key: out 0, LSE -inf (and
    # zero gradients).
    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.full((q.shape[1], q.shape[0]), -jnp.inf, jnp.float32)
    return (out, lse) if return_lse else out
  cu_q = cu_seqlens_q.astype(jnp.int32)
  cu_k = cu_seqlens_k.astype(jnp.int32)
  q_index, q_real = _padded_index(cu_q, max_seqlen_q)
  k_index, k_real = _padded_index(cu_k, max_seqlen_k)
  q_pad = jnp.take(q, jnp.clip(q_index, 0, q.shape[0] - 1), axis=0)   # [n, P, H, D]
  k_pad = jnp.take(k, jnp.clip(k_index, 0, k.shape[0] - 1), axis=0)
  v_pad = jnp.take(v, jnp.clip(k_index, 0, k.shape[0] - 1), axis=0)
  q_ids = jnp.where(q_real, 0, _Q_PAD_ID).astype(jnp.int32)
  kv_ids = jnp.where(k_real, 0, _KV_PAD_ID).astype(jnp.int32)
  out, lse = attention(q_pad, k_pad, v_pad, segment_ids=(q_ids, kv_ids), return_lse=True,
                       **options)
  slots = _slot_of_token(cu_q, max_seqlen_q, q.shape[0])
  n = cu_q.shape[0] - 1
  out = jnp.take(out.reshape((n * max_seqlen_q,) + out.shape[2:]), slots, axis=0)
  lse = jnp.take(lse.transpose(1, 0, 2).reshape(lse.shape[1], n * max_seqlen_q), slots, axis=1)
  return (out, lse) if return_lse else out
