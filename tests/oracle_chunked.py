"""A memory-bounded float64 oracle for the large cases (tests/test_large.py).

tests/oracle.py materializes [B, H, T, S] float64 scores: 4 GiB for one head
at T = S = 8192 before any temporaries. Here the same math (the softmax of the
masked, scaled scores, the window aligned bottom-right, GQA by index, and the
textbook derivative of loss = <out, d_out> + <lse, d_lse>) runs for one KV head
and its group of query heads at a time, over chunks of query rows, and only
over the keys that some row of the chunk can see. Every row of the group is
computed, so dK and dV (sums over all rows and all heads of the group) are
exact; what the large tests sample is which (batch, KV head) groups they check.
"""

from __future__ import annotations

import numpy as np

# Elements of one [G * rows, keys] float64 temporary: 8 MiB, so that numpy
# reuses freed buffers instead of mapping fresh pages for every chunk (64 MiB
# temporaries made the gradient pass 4x slower).
CHUNK_ELEMENTS = 1 << 20


def visible_key_bounds(rows, seqlen_q, seqlen_k, causal, window_size):
  """Per query row, the visible keys [lo, hi): i + S - T - left <= j <= i + S - T + right."""
  left, right = window_size
  if causal:
    right = 0 if right < 0 else min(right, 0)
  diagonal = rows + (seqlen_k - seqlen_q)
  lo = np.clip(diagonal - left, 0, seqlen_k) if left >= 0 else np.zeros_like(rows)
  hi = np.clip(diagonal + right + 1, 0, seqlen_k) if right >= 0 else np.full_like(rows, seqlen_k)
  return lo, np.maximum(hi, lo)


def group_oracle(q, k, v, d_out=None, d_lse=None, *, causal=False, softmax_scale=None,
                 window_size=(-1, -1), chunk_rows=None):
  """out, lse and, given d_out, (dq, dk, dv) for one KV head and its query heads.

  q: [T, G, D] (the G query heads that share this KV head), k, v: [S, D],
  d_out: [T, G, D], d_lse: [G, T] (None: zero). Returns ((out [T, G, D],
  lse [G, T]), grads) in float64, grads = (dq [T, G, D], dk [S, D], dv [S, D])
  or None without d_out. Rows that see no key get out 0, lse -inf and zero
  gradients. chunk_rows (default: what fits CHUNK_ELEMENTS) sets the query
  rows per step.
  """
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  seqlen_q, group, head_dim = q.shape
  seqlen_k = k.shape[0]
  scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
  with_grads = d_out is not None
  qg = q.transpose(1, 0, 2)                                      # [G, T, D]
  out = np.zeros((group, seqlen_q, head_dim))
  lse = np.full((group, seqlen_q), -np.inf)
  if with_grads:
    do = np.asarray(d_out, np.float64).transpose(1, 0, 2)        # [G, T, D]
    dl = np.zeros((group, seqlen_q)) if d_lse is None else np.asarray(d_lse, np.float64)
    dq = np.zeros((group, seqlen_q, head_dim))
    dk = np.zeros((seqlen_k, head_dim))
    dv = np.zeros((seqlen_k, head_dim))
  if chunk_rows is None:
    chunk_rows = max(1, CHUNK_ELEMENTS // (group * max(seqlen_k, 1)))
  for r0 in range(0, seqlen_q, chunk_rows):
    rows = np.arange(r0, min(r0 + chunk_rows, seqlen_q))
    lo, hi = visible_key_bounds(rows, seqlen_q, seqlen_k, causal, window_size)
    k0, k1 = int(lo.min()), int(hi.max())
    if k1 <= k0:
      continue  # no row of this chunk sees a key: the zeros and -inf above
    keys = np.arange(k0, k1)
    mask = (keys[None, :] >= lo[:, None]) & (keys[None, :] < hi[:, None])  # [rows, keys]
    n = len(rows)

    def flat(x):  # [G, T, D] -> [G * rows, D] for this chunk: one GEMM for the group
      return x[:, rows[0]:rows[-1] + 1].reshape(group * n, head_dim)

    # S = scale Q K^T, masked
    scores = scale * (flat(qg) @ k[k0:k1].T)                     # [G * rows, keys]
    scores = np.where(np.tile(mask, (group, 1)), scores, -np.inf)
    row_max = scores.max(-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    weights = np.exp(scores - row_max)
    row_sum = weights.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
      chunk_lse = (row_max + np.log(row_sum))[:, 0]              # -inf where no key
    probs = weights / np.where(row_sum > 0, row_sum, 1.0)
    chunk_out = probs @ v[k0:k1]                                 # [G * rows, D]
    out[:, rows[0]:rows[-1] + 1] = chunk_out.reshape(group, n, head_dim)
    lse[:, rows[0]:rows[-1] + 1] = chunk_lse.reshape(group, n)
    if not with_grads:
      continue
    chunk_do = flat(do)
    chunk_dl = dl[:, rows[0]:rows[-1] + 1].reshape(group * n)
    chunk_dl = np.where(np.isfinite(chunk_lse), chunk_dl, 0.0)
    # dS = P o (dO V^T - rowsum(dO o O) + dLSE)
    dp = chunk_do @ v[k0:k1].T
    ds = probs * (dp - (chunk_do * chunk_out).sum(-1, keepdims=True) + chunk_dl[:, None])
    dq[:, rows[0]:rows[-1] + 1] = (scale * ds @ k[k0:k1]).reshape(group, n, head_dim)
    dk[k0:k1] += scale * ds.T @ flat(qg)
    dv[k0:k1] += probs.T @ chunk_do
  result = (out.transpose(1, 0, 2), lse)
  if not with_grads:
    return result, None
  return result, (dq.transpose(1, 0, 2), dk, dv)


def groups_oracle(q, k, v, d_out, d_lse, groups, **options):
  """group_oracle for each (b, kv_head) in `groups`, from full arrays.

  q: [B, T, H, D], k, v: [B, S, K, D], d_out: [B, T, H, D] or None,
  d_lse: [B, H, T] or None (numpy or jax arrays of any float dtype). Returns a
  list, one (out, lse), grads per group, in group_oracle's layout; the group's
  query heads are kv_head * G ... (kv_head + 1) * G - 1, G = H // K.
  """
  group = q.shape[2] // k.shape[2]
  results = []
  for b, kv in groups:
    heads = slice(kv * group, (kv + 1) * group)
    results.append(group_oracle(
        q[b, :, heads], k[b, :, kv], v[b, :, kv],
        None if d_out is None else d_out[b, :, heads],
        None if d_lse is None else d_lse[b, heads], **options))
  return results
