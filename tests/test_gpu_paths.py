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


# (T, S, H, K, D, causal, expected path on cc 9.0)
PATH_CASES = [
    (300, 300, 4, 4, 128, True, "sm90"),
    (257, 1000, 4, 2, 64, False, "sm90"),  # GQA by index, T != S
    (300, 300, 4, 4, 96, False, "sm80"),  # no Hopper tile for D = 96
    (1, 4096, 8, 2, 128, False, "sm80"),  # decode: split-KV and GQA packing
]


@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: f"T{c[0]}S{c[1]}D{c[4]}-{c[6]}")
def test_forward_path(rng, case):
  seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, expected = case
  q, k, v = random_inputs(rng, 2, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
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
