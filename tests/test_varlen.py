"""flash_attention_varlen against the float64 oracle applied sequence by sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from conftest import supports
from oracle import max_err, oracle

# (q lengths, k lengths, H, K, D, options)
CASES = [
    ([5, 17, 1, 30], [7, 17, 3, 30], 4, 2, 32, {"causal": True}),
    ([64, 3, 70], [64, 90, 2], 2, 1, 16, {}),
    ([33, 40], [33, 40], 2, 2, 64, {"causal": True, "window_size": (8, -1)}),
    ([9, 12, 1], [20, 5, 8], 2, 2, 16, {"causal": True, "softcap": 3.0}),
]


def _cu(lengths):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-h{c[2]}k{c[3]}-d{c[4]}-{c[5]}")
def test_varlen_matches_per_sequence_oracle(backend, case, dtype, rng):
  if not supports(backend, dtype):
    pytest.skip(f"{backend} does not serve {jnp.dtype(dtype).name} here")
  q_lens, k_lens, h, hk, d, options = case
  q = jnp.asarray(rng.standard_normal((sum(q_lens), h, d)), dtype)
  k = jnp.asarray(rng.standard_normal((sum(k_lens), hk, d)), dtype)
  v = jnp.asarray(rng.standard_normal((sum(k_lens), hk, d)), dtype)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  cu_q, cu_k = _cu(q_lens), _cu(k_lens)

  def f(q, k, v):
    return jax_flash2.flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens) + 3, max(k_lens),
                                             return_lse=True, implementation=backend, **options)

  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
  grads = vjp((d_out, jnp.zeros_like(lse)))
  assert out.shape == q.shape and lse.shape == (h, q.shape[0])

  tol = 2e-5 if dtype == jnp.float32 else 6e-2
  for b in range(len(q_lens)):
    qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
    (ref_out, ref_lse), ref_grads = oracle(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                                           d_out[None, qs:qe], np.zeros((1, h, qe - qs)),
                                           **options)
    assert max_err(out[qs:qe], ref_out[0]) <= tol
    assert max_err(lse[:, qs:qe], ref_lse[0]) <= tol * 10
    for g, r, (s, e) in zip(grads, ref_grads, ((qs, qe), (ks, ke), (ks, ke))):
      scale = max(1.0, float(np.max(np.abs(r))))
      assert max_err(g[s:e], r[0]) <= tol * 4 * scale


def test_varlen_bad_arguments():
  q = jnp.ones((10, 2, 16))
  k = jnp.ones((12, 2, 16))
  cu_q = jnp.asarray([0, 4, 10], jnp.int32)
  cu_k = jnp.asarray([0, 5, 12], jnp.int32)
  f = jax_flash2.flash_attention_varlen
  with pytest.raises(ValueError, match="must start at 0, be non-decreasing"):
    f(q, k, k, jnp.asarray([0, 6, 4, 10], jnp.int32), jnp.asarray([0, 5, 6, 12], jnp.int32), 8, 8)
  with pytest.raises(ValueError, match="end at the number of tokens"):
    f(q, k, k, jnp.asarray([0, 4, 9], jnp.int32), cu_k, 8, 8)
  with pytest.raises(ValueError, match="more than max_seqlen"):
    f(q, k, k, cu_q, cu_k, 5, 8)
  with pytest.raises(TypeError, match="cu_seqlens_q must be an integer array"):
    f(q, k, k, cu_q.astype(jnp.float32), cu_k, 8, 8)
  with pytest.raises(ValueError, match="rank 3"):
    f(q[None], k, k, cu_q, cu_k, 8, 8)
  with pytest.raises(ValueError, match="max_seqlen_k must be a static int"):
    f(q, k, k, cu_q, cu_k, 8, 0)
  with pytest.raises(ValueError, match="shapes"):
    f(q, k, k, cu_q, jnp.asarray([0, 12], jnp.int32), 8, 12)
