"""Which CUDA forward kernel serves a call: the Hopper (sm90a) kernel on cc 9.0
for the shapes it supports, the sm80 kernels otherwise. Runs only on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from jax_flash2 import _ext

from conftest import ON_GPU, random_inputs
from oracle import assert_close_to_oracle, naive_same_dtype, oracle

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def _is_hopper() -> bool:
  return getattr(jax.devices()[0], "compute_capability", "") == "9.0"


def _forward_calls_during(fn) -> dict[str, int]:
  before = _ext.cuda_ext.forward_call_counts()
  jax.block_until_ready(fn())
  after = _ext.cuda_ext.forward_call_counts()
  return {path: after[path] - before[path] for path in before}


# (B, T, S, H, K, D, causal, expected path on cc 9.0). The Hopper kernel takes
# grids that fill the GPU; small ones go to the sm80 split-KV path.
PATH_CASES = [
    (8, 1000, 1000, 16, 16, 128, True, "sm90"),
    (8, 1025, 1500, 16, 4, 64, False, "sm90"),  # GQA by index, T != S
    (8, 1000, 1000, 16, 16, 96, False, "sm80"),  # no Hopper tile for D = 96
    (2, 300, 300, 4, 4, 128, False, "sm80"),  # a small grid: split-KV
    (1, 1, 4096, 8, 2, 128, False, "sm80"),  # decode: split-KV and GQA packing
]


@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: f"B{c[0]}T{c[1]}S{c[2]}D{c[5]}-{c[7]}")
def test_forward_path(rng, case):
  batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, expected = case
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
  fn = jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=causal,
                                                          return_lse=True))
  fn.lower(q, k, v).compile()  # compile outside the counted window
  calls = _forward_calls_during(lambda: fn(q, k, v))
  path = expected if _is_hopper() else "sm80"
  assert calls[path] == 1 and sum(calls.values()) == 1, calls
  out, lse = fn(q, k, v)
  (ref_out, ref_lse), _ = oracle(q, k, v, np.ones(q.shape), np.zeros(lse.shape), causal=causal)
  base_out, base_lse = naive_same_dtype(q, k, v, causal=causal)
  assert_close_to_oracle("out", out, ref_out, base_out, q.dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, q.dtype)


def test_hopper_forward_is_built():
  if not _is_hopper():
    pytest.skip("not a cc 9.0 GPU")
  assert _ext.cuda_ext.has_sm90()
  assert "sm90a" in jax_flash2.kernel_info()["cuda"]
