"""Packed sequences (segment ids) on the GPU: the Hopper forward and backward
against the float64 oracle (tests/oracle.py) for packed rows of 1, 2, 7 and
64 documents, empty documents, documents shorter than a block, padding,
unsorted ids, T != S (cross attention between packed rows), GQA and windows,
with the plan asserting that the Hopper kernels serve them on cc 9.0. Runs
only on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2

from conftest import ON_GPU, device_plan, is_hopper, random_inputs
from oracle import assert_close_to_oracle, naive_same_dtype, oracle

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")



def _packed_ids(rng, batch, length, docs, *, empty=False):
  """[batch, length] int32: `docs` sorted runs of random lengths (ids 0..docs-1);
  with `empty`, one document of length 0."""
  ids = np.zeros((batch, length), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.integers(0, length + 1, docs - 1))
    if empty and docs > 2:
      cuts[1] = cuts[0]
    ids[b] = np.searchsorted(cuts, np.arange(length), side="right")
  return ids


def _short_ids(rng, batch, length):
  """Documents of 1..40 tokens: every block holds several."""
  ids = np.zeros((batch, length), np.int32)
  for b in range(batch):
    lengths = rng.integers(1, 41, length)
    ids[b] = np.repeat(np.arange(length), lengths)[:length]
  return ids


def _ids(rng, kind, batch, seqlen_q, seqlen_k, docs):
  if kind == "packed":
    q_ids = _packed_ids(rng, batch, seqlen_q, docs, empty=True)
    kv_ids = q_ids if seqlen_q == seqlen_k else _packed_ids(rng, batch, seqlen_k, docs)
  elif kind == "padded":  # documents 1..docs, then padding id 0 (MaxText's packing)
    q_ids = _packed_ids(rng, batch, seqlen_q, docs) + 1
    q_ids[:, seqlen_q * 9 // 10:] = 0
    kv_ids = q_ids
  elif kind == "uniform":  # documents of `docs` tokens each
    q_ids = np.broadcast_to(np.arange(seqlen_q, dtype=np.int32) // docs, (batch, seqlen_q))
    kv_ids = np.broadcast_to(np.arange(seqlen_k, dtype=np.int32) // docs, (batch, seqlen_k))
  elif kind == "short":
    q_ids = _short_ids(rng, batch, seqlen_q)
    kv_ids = q_ids if seqlen_q == seqlen_k else _short_ids(rng, batch, seqlen_k)
  elif kind == "missing":  # the kv side holds only the even documents
    q_ids = _packed_ids(rng, batch, seqlen_q, docs)
    kv_ids = _packed_ids(rng, batch, seqlen_k, docs) // 2 * 2
  elif kind == "random":  # unsorted; queries with id 3 see no key
    q_ids = rng.integers(0, 4, (batch, seqlen_q)).astype(np.int32)
    kv_ids = rng.integers(0, 3, (batch, seqlen_k)).astype(np.int32)
  else:
    raise ValueError(kind)
  return jnp.asarray(q_ids), jnp.asarray(kv_ids)


# (B, T, S, H, K, D, causal, window, ids kind, documents, dtype). Grids large
# enough that the plan does not split keys (the Hopper forward does not).
CASES = [
    (1, 2048, 2048, 16, 16, 128, True, None, "packed", 1, jnp.bfloat16),
    (1, 2048, 2048, 16, 4, 64, True, None, "packed", 2, jnp.float16),
    (1, 2048, 2048, 16, 4, 128, True, None, "packed", 7, jnp.bfloat16),
    (1, 4096, 4096, 16, 16, 64, True, None, "packed", 64, jnp.bfloat16),
    (1, 2000, 2000, 16, 16, 64, False, None, "packed", 7, jnp.bfloat16),
    (1, 4096, 4096, 16, 8, 128, False, None, "packed", 64, jnp.bfloat16),
    (1, 2048, 2048, 8, 2, 256, True, None, "packed", 7, jnp.bfloat16),
    (1, 2000, 2000, 16, 16, 64, True, None, "short", 0, jnp.bfloat16),
    (1, 2048, 2048, 16, 16, 128, True, None, "padded", 5, jnp.float16),
    (2, 1500, 1500, 16, 4, 128, False, None, "random", 0, jnp.bfloat16),
    (2, 1500, 3000, 16, 4, 128, False, None, "packed", 7, jnp.bfloat16),  # T != S
    (1, 3000, 1200, 16, 8, 64, False, None, "missing", 6, jnp.float16),
    (1, 2048, 2048, 16, 16, 128, False, (256, 0), "packed", 7, jnp.bfloat16),
]


def _case_id(c):
  batch, t, s, h, kh, d, causal, window, kind, docs, dtype = c
  w = f"-w{window[0]}_{window[1]}" if window else ""
  return (f"B{batch}T{t}S{s}H{h}K{kh}D{d}{'-causal' if causal else ''}{w}-{kind}{docs}-"
          f"{jnp.dtype(dtype).name}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_packed(rng, case):
  _check_packed(rng, case)


# max_segment_length, a tile hint: true bounds (the D 64 forward takes the
# short-sequence tile at <= 256 keys) and wrong ones (documents longer than
# the bound), which must change nothing but the speed.
BOUND_CASES = [
    ((1, 4096, 4096, 16, 4, 64, True, None, "uniform", 256, jnp.bfloat16), 256),
    ((1, 2000, 2000, 16, 16, 64, True, None, "short", 0, jnp.float16), 40),
    ((1, 2048, 2048, 16, 16, 64, True, None, "packed", 7, jnp.bfloat16), 100),
    ((2, 1500, 3000, 16, 4, 64, False, None, "packed", 7, jnp.bfloat16), 64),  # T != S
    ((1, 2048, 2048, 16, 16, 128, True, None, "packed", 7, jnp.bfloat16), 64),
]


@pytest.mark.parametrize("case,bound", BOUND_CASES,
                         ids=[f"{_case_id(c)}-bound{b}" for c, b in BOUND_CASES])
def test_packed_with_length_bound(rng, case, bound):
  _check_packed(rng, case, max_segment_length=bound)


@pytest.mark.skipif(jax_flash2._ext.cuda_ext is None, reason="needs the CUDA extension")
def test_length_bound_reaches_the_forward_plan():
  """The bound is lowered as the forward's segment_keys attribute, and it
  picks the D 64 forward's tile (whose segment scratch differs in size)."""
  ids = jnp.zeros((1, 16384), jnp.int32)
  q = jnp.ones((1, 16384, 16, 64), jnp.bfloat16)
  fn = jax.jit(lambda q: jax_flash2.flash_attention(q, q, q, causal=True, segment_ids=(ids, ids),
                                                    max_segment_length=256))
  ir = fn.trace(q).lower(lowering_platforms=("cuda",)).as_text()
  assert "segment_keys = 256" in ir, ir[:2000]
  sizes = [jax_flash2._ext.cuda_ext.workspace_bytes(
      False, 1, 16384, 16384, 16, 16, 64, -1, 0, 132, False, 9, has_segment_ids=True,
      segment_keys=bound) for bound in (0, 2048, 256)]
  assert sizes[0] == sizes[1] != sizes[2], sizes


def _check_packed(rng, case, **bound):
  batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, kind, docs, dtype = case
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)
  segment_ids = _ids(rng, kind, batch, seqlen_q, seqlen_k, docs)
  options = dict(causal=causal, segment_ids=segment_ids, **bound)
  if window is not None:
    options["window_size"] = window
  plan = device_plan(q, k, v, **options)
  if is_hopper():
    assert plan["forward"].kernel == "sm90", plan["forward"]
    assert plan["backward"].kernel == "sm90", plan["backward"]

  d_out = jnp.asarray(rng.standard_normal((batch, seqlen_q, heads_q, head_dim)), dtype)
  d_lse = jnp.asarray(rng.standard_normal((batch, heads_q, seqlen_q)), jnp.float32)

  def run(q, k, v, d_out, d_lse):
    (out, lse), vjp = jax.vjp(
        lambda q, k, v: jax_flash2.flash_attention(q, k, v, return_lse=True, **options), q, k, v)
    return out, lse, vjp((d_out, d_lse))

  out, lse, grads = jax.jit(run)(q, k, v, d_out, d_lse)
  oracle_opts = dict(causal=causal, segment_ids=segment_ids)
  naive_opts = dict(causal=causal, segment_ids=segment_ids)
  if window is not None:
    oracle_opts["window_size"] = naive_opts["window_size"] = window
  (ref_out, ref_lse), ref_grads = oracle(q, k, v, d_out, d_lse, **oracle_opts)
  (base_out, base_lse), naive_vjp = jax.vjp(
      lambda q, k, v: naive_same_dtype(q, k, v, **naive_opts), q, k, v)
  base_grads = naive_vjp((d_out, d_lse.astype(dtype)))
  # Rows that see no key: out 0, LSE -inf, no gradient through them.
  empty_rows = ~np.isfinite(np.asarray(ref_lse))
  if empty_rows.any():
    assert np.all(np.asarray(lse)[empty_rows] == -np.inf)
  assert_close_to_oracle("out", out, ref_out, base_out, dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, dtype)
  for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
    assert_close_to_oracle(name, g, r, bg, dtype)


def test_nan_propagates_with_segments(rng):
  """A NaN in q reaches out and the LSE of its row only; a row that sees no
  key stays 0 / -inf."""
  batch, seqlen, heads, head_dim = 1, 2048, 16, 128
  q, k, v = random_inputs(rng, batch, seqlen, seqlen, heads, heads, head_dim, jnp.bfloat16)
  q = q.at[0, 700, 3, 5].set(jnp.nan)
  q_ids = np.repeat(np.arange(4, dtype=np.int32), seqlen // 4)[None]
  kv_ids = q_ids.copy()
  kv_ids[0, : seqlen // 4] = 9  # document 0's queries see no key
  out, lse = jax.jit(lambda q, k, v: jax_flash2.flash_attention(
      q, k, v, causal=True, segment_ids=(jnp.asarray(q_ids), jnp.asarray(kv_ids)),
      return_lse=True))(q, k, v)
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  assert np.isnan(out[0, 700, 3]).all() and np.isnan(lse[0, 3, 700])
  assert np.isfinite(np.delete(out[0, :, 3], 700, axis=0)).all()
  assert (out[0, : seqlen // 4] == 0).all() and (lse[0, :, : seqlen // 4] == -np.inf).all()


def test_varlen_long_row(rng):
  """flash_attention_varlen over ~260k tokens of short sequences: one row of
  more than 1,024 chunks a side in both directions, where the segment
  pre-pass searches its group summaries. Every sequence against the float64
  oracle, on the same sequences as a padded batch."""
  max_len, heads, kv_heads, dim, dtype = 160, 2, 1, 64, jnp.bfloat16
  lengths = rng.integers(1, max_len + 1, 3400)
  lengths[rng.choice(lengths.size, 25, replace=False)] = 0
  lengths = lengths[: np.searchsorted(np.cumsum(lengths), 260_000) + 1]
  total, n = int(lengths.sum()), lengths.size
  starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  q = jnp.asarray(rng.standard_normal((total, heads, dim)), dtype)
  k = jnp.asarray(rng.standard_normal((total, kv_heads, dim)), dtype)
  v = jnp.asarray(rng.standard_normal((total, kv_heads, dim)), dtype)
  d_out = jnp.asarray(rng.standard_normal((total, heads, dim)), dtype)
  assert jax_flash2._varlen.choose_path(cu, cu, True) == "packed"
  if is_hopper():
    row_ids = jax.ShapeDtypeStruct((1, total), jnp.int32)
    plan = device_plan(q[None], k[None], v[None], causal=True, segment_ids=(row_ids, row_ids))
    assert plan["forward"].kernel == "sm90" and plan["backward"].kernel == "sm90", plan

  def varlen(q, k, v):
    return jax_flash2.flash_attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=True,
                                             return_lse=True)

  (out, lse), vjp = jax.vjp(jax.jit(varlen), q, k, v)
  grads = vjp((d_out, jnp.zeros_like(lse)))

  # The same sequences as a [n, max_len] batch: padding queries and keys get
  # ids of their own, so they see nothing and are seen by nothing.
  pos = np.arange(max_len)
  valid = pos[None, :] < lengths[:, None]
  index = np.where(valid, starts[:, None] + pos[None, :], 0)
  q_ids, kv_ids = np.where(valid, 0, 1).astype(np.int32), np.where(valid, 0, 2).astype(np.int32)

  def as_batch(x):  # [total, ...] -> [n, max_len, ...], 0 at padding
    x = np.asarray(x, np.float64)[index]
    return np.where(valid.reshape(valid.shape + (1,) * (x.ndim - 2)), x, 0)

  ours = [as_batch(out), np.where(valid[:, None], np.asarray(lse)[:, index].transpose(1, 0, 2),
                                  -np.inf)] + [as_batch(g) for g in grads]
  qb, kb, vb, dob = (jnp.asarray(as_batch(x), dtype) for x in (q, k, v, d_out))
  ids = (jnp.asarray(q_ids), jnp.asarray(kv_ids))
  (base_out, base_lse), naive_vjp = jax.vjp(
      lambda q, k, v: naive_same_dtype(q, k, v, causal=True, segment_ids=ids), qb, kb, vb)
  base = [base_out, base_lse] + list(naive_vjp((dob, jnp.zeros_like(base_lse))))
  refs = [[] for _ in base]
  for s in range(0, n, 256):  # the float64 oracle in slices of sequences, to bound memory
    part = slice(s, s + 256)
    (o, l), g = oracle(qb[part], kb[part], vb[part], dob[part],
                       np.zeros((min(256, n - s), heads, max_len)), causal=True,
                       segment_ids=(q_ids[part], kv_ids[part]))
    for r, x in zip(refs, [o, l, *g]):
      r.append(x)
  for name, o, r, b in zip(("out", "lse", "dq", "dk", "dv"), ours, refs, base):
    assert_close_to_oracle(name, o, np.concatenate(r), b, dtype)
