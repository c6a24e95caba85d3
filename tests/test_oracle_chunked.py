"""The chunked oracle of the large GPU tests equals tests/oracle.py's oracle
(runs everywhere: it checks test code, not a backend)."""

from __future__ import annotations

import numpy as np
import pytest

from oracle import oracle
from oracle_chunked import groups_oracle

# (B, T, S, H, K, D, causal, window_size, chunk_rows): chunks smaller than T
# and not dividing it; T > S causal (leading rows see no key, some chunks see
# none at all); T < S; windows that bound both sides; GQA and MQA.
CASES = [
    (2, 37, 37, 4, 4, 16, False, (-1, -1), 5),
    (2, 37, 37, 4, 2, 16, True, (-1, -1), 8),
    (1, 61, 23, 8, 1, 8, True, (-1, -1), 7),
    (2, 9, 70, 6, 2, 24, True, (-1, -1), 4),
    (1, 50, 50, 2, 1, 16, False, (6, 3), 9),
    (1, 40, 55, 4, 2, 16, True, (10, -1), 6),
    (1, 1, 70, 4, 1, 32, False, (-1, -1), None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-t{}-s{}-h{}k{}-d{}-c{}-w{}-r{}".format(*c))
def test_chunked_oracle_equals_oracle(case, rng):
  batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, chunk_rows = case
  q = rng.standard_normal((batch, seqlen_q, heads_q, head_dim))
  k, v = rng.standard_normal((2, batch, seqlen_k, heads_kv, head_dim))
  d_out = rng.standard_normal(q.shape)
  d_lse = rng.standard_normal((batch, heads_q, seqlen_q))
  options = {"causal": causal, "window_size": window, "softmax_scale": 0.3}
  (out, lse), (dq, dk, dv) = oracle(q, k, v, d_out, d_lse, **options)
  group = heads_q // heads_kv
  groups = [(b, kv) for b in range(batch) for kv in range(heads_kv)]
  results = groups_oracle(q, k, v, d_out, d_lse, groups, chunk_rows=chunk_rows, **options)
  for (b, kv), ((c_out, c_lse), (c_dq, c_dk, c_dv)) in zip(groups, results):
    heads = slice(kv * group, (kv + 1) * group)
    np.testing.assert_allclose(c_out, out[b, :, heads], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(c_lse), np.isneginf(lse[b, heads]))
    np.testing.assert_allclose(c_lse, lse[b, heads], rtol=0, atol=1e-12)
    np.testing.assert_allclose(c_dq, dq[b, :, heads], rtol=0, atol=1e-12)
    np.testing.assert_allclose(c_dk, dk[b, :, kv], rtol=0, atol=1e-12)
    np.testing.assert_allclose(c_dv, dv[b, :, kv], rtol=0, atol=1e-12)
  # Without d_out: the forward alone, the same values.
  (f_out, f_lse), f_grads = groups_oracle(q, k, v, None, None, groups[-1:], **options)[0]
  b, kv = groups[-1]
  assert f_grads is None
  np.testing.assert_allclose(f_out, out[b, :, kv * group:(kv + 1) * group], rtol=0, atol=1e-12)
  np.testing.assert_allclose(f_lse, lse[b, kv * group:(kv + 1) * group], rtol=0, atol=1e-12)

