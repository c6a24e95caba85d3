"""Packed variable-length sequences in FlashAttention's convention, on top of
flash_attention with segment ids.

The tokens of n sequences are packed along one axis and delimited by
cu_seqlens (cumulative lengths, [n + 1], starting at 0). Three paths:

- Packed (the default): the packed tensors run as one row [1, total, ...]
  with segment ids derived on the device from cu_seqlens (token t of q gets
  the b with cu_seqlens_q[b] <= t < cu_seqlens_q[b + 1], likewise for k), so
  the kernels' segment-id block skipping does the work: O(total) memory, no
  copy. Causal and window masks are then relative to the row's diagonal,
  which is every sequence's own exactly when each sequence has as many
  queries as keys at the same offsets (cu_seqlens_q == cu_seqlens_k); without
  causal or window no mask is positional and any offsets work
  (cross-attention packing).
- Aligned: for causal or window with offsets that differ (or that are
  traced and not the same array, so cannot be compared), the sequences are
  copied into one row in slots of max(q length, k length) tokens, the
  queries and the keys of each slot ending at its end: the row's diagonal
  (T == S) is then every sequence's bottom-right one, so the row's causal
  and window masks are the sequences' own. O(total) memory: the row holds
  at most total_q + total_k slots.
- Padded: each sequence gathered into one row of a padded [n, max_seqlen,
  ...] batch, right-aligned (padding first), as in FlashAttention-2's
  varlen kernels: O(n * max_seqlen) memory, chosen instead of the aligned
  row only where it holds fewer elements (few queries per sequence against
  many keys, as in chunked prefill, where the aligned row gives every slot
  as many query slots as keys).

seqused_k ([n], optional) limits sequence b to the first seqused_k[b] keys
of its range, FlashAttention's convention, causal and window aligned
bottom-right to that used length. Every path takes it through what it
already has: the packed path gives the unused keys a segment id no query
has, the aligned and padded paths copy only the used keys (their key
lengths). Either way the unused keys never enter a product: the packed path
replaces them by zeros, the others never copy them, since a masked key in a
block that is computed still meets its zero probability in P V and dS K,
and 0 * NaN is NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

_Q_PAD_ID = -1  # padded path: padding queries and keys never share an id
_KV_PAD_ID = -2  # with each other or with real tokens (id 0)


def _check_integer_array(name: str, x) -> None:
  if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"flash_attention_varlen: {name} must be an integer array; got "
                    f"{getattr(x, 'dtype', type(x).__name__)}")


def check_cu_seqlens(name: str, cu_seqlens, total: int, max_seqlen) -> None:
  """Shape, dtype and (when the values are known at trace time) content checks."""
  _check_integer_array(name, cu_seqlens)
  if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
    raise ValueError(f"flash_attention_varlen: {name} must be 1-D [n + 1] with n >= 1; got shape "
                     f"{tuple(cu_seqlens.shape)}")
  if isinstance(cu_seqlens, jax.core.Tracer):
    return  # values unknown until run time
  values = np.asarray(cu_seqlens)
  lengths = np.diff(values)
  if values[0] != 0 or values[-1] > total or np.any(lengths < 0):
    raise ValueError(f"flash_attention_varlen: {name} must start at 0, be non-decreasing and end "
                     f"at most at the number of tokens ({total}); got {values.tolist()}")
  if lengths.max(initial=0) > max_seqlen:
    raise ValueError(f"flash_attention_varlen: a sequence of {name} has {int(lengths.max())} "
                     f"tokens, more than max_seqlen = {max_seqlen}")


def check_seqused_k(seqused_k, cu_seqlens_k) -> None:
  """Dtype, shape [n] and (when both are concrete) 0 <= seqused_k[b] <= the
  key length of sequence b."""
  _check_integer_array("seqused_k", seqused_k)
  n = cu_seqlens_k.shape[0] - 1
  if tuple(seqused_k.shape) != (n,):
    raise ValueError(f"flash_attention_varlen: seqused_k must be 1-D [n] = [{n}] (one entry per "
                     f"sequence of cu_seqlens_k); got shape {tuple(seqused_k.shape)}")
  if isinstance(seqused_k, jax.core.Tracer) or isinstance(cu_seqlens_k, jax.core.Tracer):
    return  # values unknown until run time
  used = np.asarray(seqused_k).astype(np.int64)
  lengths = np.diff(np.asarray(cu_seqlens_k).astype(np.int64))
  bad = np.flatnonzero((used < 0) | (used > lengths))
  if bad.size:
    b = int(bad[0])
    raise ValueError(f"flash_attention_varlen: seqused_k must be in [0, key length] for every "
                     f"sequence; seqused_k[{b}] = {int(used[b])}, key length {int(lengths[b])} "
                     f"(cu_seqlens_k[{b}:{b + 2}] = {np.asarray(cu_seqlens_k)[b:b + 2].tolist()})")


def same_offsets(cu_seqlens_q, cu_seqlens_k) -> bool:
  """Whether the two offsets are known at trace time to be equal: the same
  array object (also a tracer), or concrete arrays with equal values."""
  if cu_seqlens_q is cu_seqlens_k:
    return True
  if isinstance(cu_seqlens_q, jax.core.Tracer) or isinstance(cu_seqlens_k, jax.core.Tracer):
    return False
  return (cu_seqlens_q.shape == cu_seqlens_k.shape
          and bool(np.array_equal(np.asarray(cu_seqlens_q), np.asarray(cu_seqlens_k))))


class Sizes(NamedTuple):
  """The static sizes the choice between the aligned row and the padded
  batch weighs."""
  total_q: int
  total_k: int
  max_seqlen_q: int
  max_seqlen_k: int
  heads_q: int
  heads_kv: int


def all_queries_real(cu_seqlens_q, total_q: int) -> bool:
  """Whether every query token is known to lie in a sequence (concrete
  cu_seqlens_q[-1] == total_q). Otherwise the aligned row and the padded
  batch hold one more query slot that sees no key, whose out (0) and LSE
  the tokens past cu_seqlens_q[-1] take."""
  return (not isinstance(cu_seqlens_q, jax.core.Tracer)
          and int(np.asarray(cu_seqlens_q)[-1]) == total_q)


def aligned_length(cu_seqlens_q, cu_seqlens_k, sizes: Sizes) -> int:
  """The aligned row's static length: the sum of the slots (max(q length, k
  length) each) when the offsets are concrete, else a bound on it
  (total_q + total_k, or n slots of the larger max_seqlen); plus the free
  query slot unless all_queries_real."""
  extra = 0 if all_queries_real(cu_seqlens_q, sizes.total_q) else 1
  if not any(isinstance(x, jax.core.Tracer) for x in (cu_seqlens_q, cu_seqlens_k)):
    cu_q, cu_k = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
    return int(np.maximum(np.diff(cu_q), np.diff(cu_k)).sum()) + extra
  n = cu_seqlens_q.shape[0] - 1
  return min(sizes.total_q + sizes.total_k,
             n * max(sizes.max_seqlen_q, sizes.max_seqlen_k)) + extra


def choose_path(cu_seqlens_q, cu_seqlens_k, positional: bool, seqused_k=None,
                sizes: Sizes | None = None) -> str:
  """"packed" where one row with segment ids is exact, else "aligned", or
  "padded" where the padded batch holds fewer elements than the aligned row.

  positional: causal or a window, masks that depend on the positions. With
  seqused_k they align to the used keys' end, not to the row's diagonal, so
  positional calls with seqused_k are not packed. sizes: None weighs
  nothing (aligned).
  """
  if not positional:
    return "packed"
  if seqused_k is None and same_offsets(cu_seqlens_q, cu_seqlens_k):
    return "packed"
  if sizes is None:
    return "aligned"
  n = cu_seqlens_q.shape[0] - 1
  aligned = aligned_length(cu_seqlens_q, cu_seqlens_k, sizes) * (sizes.heads_q + 2 * sizes.heads_kv)
  padded = n * ((sizes.max_seqlen_q + 1) * sizes.heads_q + 2 * sizes.max_seqlen_k * sizes.heads_kv)
  return "aligned" if aligned <= padded else "padded"


# Up to this many (token, offset) comparisons the search compares each token
# with every offset (one fused op on a GPU; the CPU compiler may hold the
# [total, n + 1] comparisons, 16 MB at this bound); past it a binary search,
# a while loop of log2(n + 1) steps, each a separate launch on a GPU.
_COMPARE_ALL_MAX = 1 << 22


def _sequence_of(offsets, token):
  """int32 count of offsets <= each token (searchsorted, side="right")."""
  method = "compare_all" if offsets.shape[0] * token.shape[0] <= _COMPARE_ALL_MAX else "scan"
  return jnp.searchsorted(offsets, token, side="right", method=method).astype(jnp.int32)


def segment_ids_from_offsets(cu_seqlens, total: int, pad_id: int, used=None):
  """[total] int32: 2 b for the tokens of sequence b, pad_id outside
  [cu[0], cu[-1]); with used ([n] int32), 2 b + 1 for the tokens of
  sequence b at or past cu[b] + used[b].

  Even ids for the sequences leave an odd id between consecutive ones, for
  keys no query may see (queries only ever get even ids), so the ids stay
  non-decreasing along the row and the kernels' per-block id ranges tight.
  A length-0 sequence owns no token (the search picks the last b with
  cu[b] <= t). Contents are trusted: offsets that are not non-decreasing
  give ids that are not the sequences.
  """
  token = jnp.arange(total, dtype=jnp.int32)
  seq = _sequence_of(cu_seqlens, token) - 1
  ids = 2 * seq
  if used is not None:
    # seq is outside [0, n) only for tokens outside every sequence, which
    # get pad_id below; clip keeps their look-up in bounds.
    start = jnp.take(cu_seqlens, seq, mode="clip")
    ids = ids + (token - start >= jnp.take(used, seq, mode="clip")).astype(jnp.int32)
  inside = (token >= cu_seqlens[0]) & (token < cu_seqlens[-1])
  return jnp.where(inside, ids, jnp.int32(pad_id))


def _packed(attention, q, k, v, cu_q, cu_k, used, positional: bool):
  """out [total_q, H, D], lse [H, total_q] on one row [1, total, ...]."""
  total_q, total_k = q.shape[0], k.shape[0]
  n = cu_q.shape[0] - 1
  if positional and total_q != total_k:
    # Equal offsets but different padding rows: the row's bottom-right
    # diagonal is shifted by total_k - total_q from the sequences' own.
    # Padding the shorter side to the longer (O(total) more padding rows)
    # puts it back on i == j.
    extra_q, extra_k = max(total_k - total_q, 0), max(total_q - total_k, 0)
    q = jnp.pad(q, ((0, extra_q), (0, 0), (0, 0)))
    k, v = (jnp.pad(x, ((0, extra_k), (0, 0), (0, 0))) for x in (k, v))
  # Tokens past cu[-1] (padding rows) get ids that nothing on the other side
  # has: 2 n for queries, 2 n + 1 for keys. Both are above every real id, so
  # the ids stay non-decreasing along the row and the kernels' per-block id
  # ranges stay tight.
  q_ids = segment_ids_from_offsets(cu_q, q.shape[0], 2 * n)
  kv_ids = segment_ids_from_offsets(cu_k, k.shape[0], 2 * n + 1, used)
  if used is not None:
    # Keys with odd ids (unused, padding) are masked, but a computed block
    # that mixes them with used keys still multiplies their zero
    # probabilities with them (0 * NaN = NaN): zeros there keep whatever they
    # hold out, and the where gives them dk = dv = 0.
    seen = (kv_ids % 2 == 0)[:, None, None]
    k, v = (jnp.where(seen, x, jnp.zeros((), x.dtype)) for x in (k, v))
  out, lse = attention(q[None], k[None], v[None], segment_ids=(q_ids[None], kv_ids[None]),
                       return_lse=True)
  return out[0, :total_q], lse[0, :, :total_q]


def _take_rows(x, index, real):
  """x's rows at index (clipped into range) where real, zeros elsewhere."""
  rows = jnp.take(x, jnp.clip(index, 0, x.shape[0] - 1), axis=0)
  return jnp.where(real[..., None, None], rows, jnp.zeros((), x.dtype))


def _slot_tokens(cu_seqlens, lengths, slot, to_end):
  """Token index at each position of a layout of right-aligned slots (the
  aligned row's, or the padded batch's rows), and whether a token is there:
  the position to_end places before the end of the slot of sequence `slot`
  (to_end 1: its last) holds token lengths[slot] - to_end of the sequence,
  if that is >= 0. slot n (past the last sequence) holds none."""
  offset = jnp.take(lengths, slot, mode="clip") - to_end  # within the sequence
  real = (slot < lengths.shape[0]) & (offset >= 0)
  return jnp.take(cu_seqlens, slot, mode="clip") + offset, real


def _token_positions(cu_seqlens, slot_end, total: int, past_end: int):
  """[total] position of each packed token in a layout of right-aligned
  slots, sequence b's tokens ending just before slot_end[b] (the aligned
  row's slots, or the padded batch's rows flattened); tokens past cu[-1] get
  past_end."""
  token = jnp.arange(total, dtype=jnp.int32)
  seq = _sequence_of(cu_seqlens[1:], token)
  lengths = cu_seqlens[1:] - cu_seqlens[:-1]
  pos = (jnp.take(slot_end, seq, mode="clip") - jnp.take(lengths, seq, mode="clip")
         + token - jnp.take(cu_seqlens, seq, mode="clip"))
  return jnp.where(token < cu_seqlens[-1], pos, past_end)


def _aligned(attention, q, k, v, cu_q, cu_k, used, length: int):
  """out [total_q, H, D], lse [H, total_q] on one row of `length` slots.

  Sequence b takes a slot of w_b = max(q length, k length) positions (k
  length: used[b] with seqused_k); its queries fill the slot's last q
  length positions on the query row, its keys the last k length ones on
  the key row. With T == S the row's diagonal i == j is then each slot's
  end on both rows, every sequence's bottom-right diagonal. Segment ids 3 b
  for the tokens of sequence b, 3 b - 1 (queries) and 3 b - 2 (keys) for
  the free positions of slot b and 3 n - 1 / 3 n - 2 past the last slot:
  free positions never share an id, and the ids never decrease along the
  rows (tight per-block ranges for the kernels). Free key positions hold
  zeros (a masked key in a computed block still meets P V and dS K).
  Queries past cu_q[-1] take the output of the row's last position, a free
  query (aligned_length leaves one), which sees no key.
  """
  q_len = cu_q[1:] - cu_q[:-1]
  k_len = cu_k[1:] - cu_k[:-1] if used is None else used
  slot_end = jnp.cumsum(jnp.maximum(q_len, k_len))
  pos = jnp.arange(length, dtype=jnp.int32)
  slot = _sequence_of(slot_end, pos)  # the slot holding pos; n past the last
  to_end = jnp.take(slot_end, slot, mode="clip") - pos
  q_index, q_real = _slot_tokens(cu_q, q_len, slot, to_end)
  k_index, k_real = _slot_tokens(cu_k, k_len, slot, to_end)
  q_ids = jnp.where(q_real, 3 * slot, 3 * slot - 1).astype(jnp.int32)
  kv_ids = jnp.where(k_real, 3 * slot, 3 * slot - 2).astype(jnp.int32)
  q_row = _take_rows(q, q_index, q_real)
  k_row, v_row = (_take_rows(x, k_index, k_real) for x in (k, v))
  out, lse = attention(q_row[None], k_row[None], v_row[None],
                       segment_ids=(q_ids[None], kv_ids[None]), return_lse=True)
  where = jnp.clip(_token_positions(cu_q, slot_end, q.shape[0], length - 1), 0, length - 1)
  return jnp.take(out[0], where, axis=0), jnp.take(lse[0], where, axis=1)


def _padded(attention, q, k, v, cu_q, cu_k, used, max_seqlen_q: int, max_seqlen_k: int,
            all_real: bool):
  """out [total_q, H, D], lse [H, total_q] through a right-aligned padded batch.

  used: None, or [n] int32, the keys each sequence uses (seqused_k): only
  those are gathered, right-aligned, so the batch's bottom-right diagonal is
  the used keys' end.

  all_real: all_queries_real. Otherwise the rows get one more slot, so slot
  0 of row 0 is padding: a query that sees no key, from which the tokens
  past cu_q[-1] take their out 0 and LSE (-inf, or the sink with sinks) and
  get no gradient. (Right alignment keeps every sequence's diagonal whatever
  P.)
  """
  if not all_real:
    max_seqlen_q += 1
  n = cu_q.shape[0] - 1
  row = jnp.arange(n, dtype=jnp.int32)[:, None]
  q_index, q_real = _slot_tokens(cu_q, cu_q[1:] - cu_q[:-1], row,
                                 max_seqlen_q - jnp.arange(max_seqlen_q, dtype=jnp.int32))
  k_index, k_real = _slot_tokens(cu_k, cu_k[1:] - cu_k[:-1] if used is None else used, row,
                                 max_seqlen_k - jnp.arange(max_seqlen_k, dtype=jnp.int32))
  # [n, P, H, D]. Padding key slots hold zeros, not the clipped token they
  # index (with seqused_k an unused key, which may hold anything; see _packed).
  q_pad = _take_rows(q, q_index, q_real)
  k_pad, v_pad = (_take_rows(x, k_index, k_real) for x in (k, v))
  q_ids = jnp.where(q_real, 0, _Q_PAD_ID).astype(jnp.int32)
  kv_ids = jnp.where(k_real, 0, _KV_PAD_ID).astype(jnp.int32)
  out, lse = attention(q_pad, k_pad, v_pad, segment_ids=(q_ids, kv_ids), return_lse=True)
  # Row b of the batch is the right-aligned slot ending at (b + 1) P; tokens
  # past cu_q[-1] take slot 0, a padding slot when P exceeds every length.
  row_end = (jnp.arange(n, dtype=jnp.int32) + 1) * max_seqlen_q
  slots = _token_positions(cu_q, row_end, q.shape[0], 0)
  out = jnp.take(out.reshape((n * max_seqlen_q,) + out.shape[2:]), slots, axis=0)
  lse = jnp.take(lse.transpose(1, 0, 2).reshape(lse.shape[1], n * max_seqlen_q), slots, axis=1)
  return out, lse


def varlen_attention(attention, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     return_lse, *, positional: bool, seqused_k=None, path: str | None = None):
  """out [total_q, H, D] (and lse [H, total_q]) through `attention`
  (flash_attention with the call's options bound).

  positional: the call has causal or a window. seqused_k: None or [n]
  integer, checked by check_seqused_k. path: None chooses (see choose_path);
  "packed", "aligned" or "padded" forces one (tests compare them; "packed"
  with causal or window and seqused_k, or with offsets that differ, is not
  the convention).
  """
  if q.shape[0] == 0 or k.shape[0] == 0:
    # No query, or no key for any query: nothing to attend (jnp.take of an
    # empty axis fails). Every query sees no key: out 0, LSE -inf (and zero
    # gradients).
    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.full((q.shape[1], q.shape[0]), -jnp.inf, jnp.float32)
    return (out, lse) if return_lse else out
  sizes = Sizes(q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k, q.shape[1], k.shape[1])
  if path is None:
    path = choose_path(cu_seqlens_q, cu_seqlens_k, positional, seqused_k, sizes)
  cu_q, cu_k = cu_seqlens_q.astype(jnp.int32), cu_seqlens_k.astype(jnp.int32)
  used = None
  if seqused_k is not None:
    # Traced values are trusted; clamped to [0, key length] they can only
    # select keys of their own sequence.
    used = jnp.clip(seqused_k.astype(jnp.int32), 0, cu_k[1:] - cu_k[:-1])
  if path == "packed":
    out, lse = _packed(attention, q, k, v, cu_q, cu_k, used, positional)
  elif path == "aligned":
    out, lse = _aligned(attention, q, k, v, cu_q, cu_k, used,
                        aligned_length(cu_seqlens_q, cu_seqlens_k, sizes))
  elif path == "padded":
    out, lse = _padded(attention, q, k, v, cu_q, cu_k, used, max_seqlen_q, max_seqlen_k,
                       all_queries_real(cu_seqlens_q, q.shape[0]))
  else:
    raise ValueError("varlen_attention: path must be None, 'packed', 'aligned' or 'padded'; got "
                     f"{path!r}")
  return (out, lse) if return_lse else out
