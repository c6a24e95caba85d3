"""Softcap and ALiBi on the GPU: the package against the float64 oracle
(forward, LSE, gradients), alone and together, with causal, windows, GQA and
every head-dim bucket; on cc 9.0 the Hopper kernels are asserted to serve them.
Runs only on a GPU."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2

from conftest import ON_GPU, device_plan, is_hopper, random_inputs
from oracle import assert_close_to_oracle, naive_same_dtype, oracle

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")



def _slopes(rng, batch, heads, per_batch):
  shape = (batch, heads) if per_batch else (heads,)
  return jnp.asarray(rng.uniform(0.01, 0.3, shape), jnp.float32)


def _options(rng, option, batch, heads, softcap, per_batch):
  """Keyword arguments of one option set: 'softcap', 'alibi' or 'both'."""
  kwargs = {}
  if option in ("softcap", "both"):
    kwargs["softcap"] = softcap
  if option in ("alibi", "both"):
    kwargs["alibi_slopes"] = _slopes(rng, batch, heads, per_batch)
  return kwargs


# (option, B, T, S, H, K, D, causal, window, softmax_scale, softcap, per-batch
# slopes, dtype). Grids of 200+ sm80 blocks, so that on cc 9.0 the Hopper
# forward serves them (smaller ones go to the sm80 split-KV path). Scale 0.5 or
# 1 in some softcap cases: scores of a few tens, which the cap bends.
FWD_CASES = [
    ("softcap", 2, 1000, 1000, 16, 4, 128, True, (-1, -1), None, 5.0, False, jnp.bfloat16),
    ("softcap", 2, 1000, 1000, 16, 16, 128, False, (-1, -1), 1.0, 30.0, False, jnp.float16),
    ("alibi", 2, 1025, 1500, 16, 4, 64, False, (-1, -1), None, 0.0, True, jnp.bfloat16),
    ("alibi", 2, 1000, 1000, 16, 4, 40, True, (-1, -1), None, 0.0, False, jnp.float16),
    ("both", 4, 1000, 1111, 8, 2, 256, True, (-1, -1), 0.5, 20.0, True, jnp.bfloat16),
    ("both", 2, 1000, 1000, 16, 16, 96, False, (256, 16), 0.5, 15.0, False, jnp.bfloat16),
    ("both", 2, 1024, 9000, 16, 16, 128, True, (-1, -1), None, 10.0, False, jnp.bfloat16),
    ("both", 3, 700, 900, 24, 8, 128, False, (-1, -1), 1.0, 50.0, True, jnp.float16),
    ("softcap", 4, 777, 700, 8, 8, 200, False, (-1, -1), 1.0, 30.0, False, jnp.bfloat16),
    # Gemma 2's cap at D 64, scores of tens: the forward's constant max
    # (bf16, caps up to about 54); a cap of 100 keeps the running max.
    ("softcap", 2, 1100, 1300, 16, 2, 64, False, (-1, -1), 1.0, 50.0, False, jnp.bfloat16),
    ("softcap", 2, 1000, 1000, 16, 4, 64, True, (-1, -1), 1.0, 100.0, False, jnp.float16),
    # Logits of a few units under a cap of 50 or 30: against the constant max
    # every term is tiny (2^-40 and below), which bf16 holds and fp16 would
    # flush (fp16 keeps the running max).
    ("softcap", 2, 1000, 1000, 16, 4, 128, False, (-1, -1), None, 50.0, False, jnp.bfloat16),
    ("softcap", 2, 1000, 1000, 16, 4, 64, False, (-1, -1), None, 50.0, False, jnp.float16),
    ("softcap", 2, 1100, 1000, 16, 16, 128, True, (-1, -1), None, 30.0, False, jnp.float16),
]


def _case_id(c):
  return f"{c[0]}-B{c[1]}T{c[2]}S{c[3]}H{c[4]}K{c[5]}D{c[6]}{'-causal' if c[7] else ''}" + (
      f"-w{c[8][0]}_{c[8][1]}" if c[8] != (-1, -1) else "") + f"-{jnp.dtype(c[12]).name}"


@pytest.mark.parametrize("case", FWD_CASES, ids=_case_id)
def test_forward_and_lse(rng, case):
  (option, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, scale,
   softcap, per_batch, dtype) = case
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)
  opts = _options(rng, option, batch, heads_q, softcap, per_batch)
  slopes = opts.pop("alibi_slopes", None)
  kwargs = dict(causal=causal, window_size=window, softmax_scale=scale, **opts)
  fn = jax.jit(lambda q, k, v, s: jax_flash2.flash_attention(
      q, k, v, alibi_slopes=s, return_lse=True, **kwargs))
  plan = device_plan(q, k, v, alibi_slopes=slopes, **kwargs)["forward"]
  assert plan.kernel == ("sm90" if is_hopper() else "sm80-prefill"), plan
  out, lse = fn(q, k, v, slopes)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  (ref_out, ref_lse), _ = oracle(q, k, v, np.ones(q.shape), np.zeros(lse.shape),
                                 alibi_slopes=slopes, **kwargs)
  base_out, base_lse = naive_same_dtype(q, k, v, alibi_slopes=slopes, **kwargs)
  assert_close_to_oracle("out", out, ref_out, base_out, dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, dtype)


# (option, T, S, H, K, D, causal, window, softmax_scale, softcap, per-batch
# slopes, dtype); B = 2. Every backward kernel: D 64 and 128 (persistent and
# stream-K grids unmasked), D 256 (the D-split kernel) and the head dims run
# by their buckets.
BWD_CASES = [
    ("softcap", 300, 300, 4, 4, 128, True, (-1, -1), 0.5, 20.0, False, jnp.bfloat16),
    ("alibi", 257, 1000, 8, 2, 128, False, (-1, -1), None, 0.0, True, jnp.bfloat16),
    ("both", 257, 1000, 8, 2, 64, True, (-1, -1), 1.0, 30.0, False, jnp.bfloat16),
    ("both", 300, 257, 4, 2, 256, True, (-1, -1), 0.5, 10.0, True, jnp.float16),
    ("softcap", 300, 1000, 9, 9, 64, False, (-1, -1), None, 5.0, False, jnp.float16),
    ("alibi", 1000, 257, 4, 4, 96, False, (128, 16), None, 0.0, False, jnp.bfloat16),
    ("both", 200, 1100, 16, 8, 128, False, (-1, -1), 1.0, 50.0, True, jnp.bfloat16),
    ("both", 257, 700, 8, 8, 200, False, (300, 0), 0.5, 15.0, False, jnp.bfloat16),
    ("softcap", 257, 1000, 8, 2, 40, True, (-1, -1), 1.0, 30.0, False, jnp.float16),
    # Caps far below the scores: tanh saturates, and its derivative goes to 0.
    ("softcap", 300, 1000, 8, 8, 64, False, (-1, -1), None, 1e-30, False, jnp.bfloat16),
    ("both", 257, 700, 8, 4, 128, True, (-1, -1), None, 0.05, False, jnp.float16),
]


def _bwd_case_id(c):
  return f"{c[0]}-T{c[1]}S{c[2]}H{c[3]}K{c[4]}D{c[5]}{'-causal' if c[6] else ''}" + (
      f"-w{c[7][0]}_{c[7][1]}" if c[7] != (-1, -1) else "") + f"-{jnp.dtype(c[11]).name}"


@pytest.mark.parametrize("case", BWD_CASES, ids=_bwd_case_id)
def test_gradients(rng, case):
  (option, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, window, scale, softcap,
   per_batch, dtype) = case
  batch = 2
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  d_lse = jnp.asarray(rng.standard_normal((batch, heads_q, seqlen_q)), jnp.float32)
  opts = _options(rng, option, batch, heads_q, softcap, per_batch)
  slopes = opts.pop("alibi_slopes", None)
  kwargs = dict(causal=causal, window_size=window, softmax_scale=scale, **opts)

  def grads(q, k, v, s, d_out, d_lse):
    (out, lse), vjp = jax.vjp(lambda q, k, v: jax_flash2.flash_attention(
        q, k, v, alibi_slopes=s, return_lse=True, **kwargs), q, k, v)
    return (out, lse), vjp((d_out, d_lse))

  fn = jax.jit(grads)
  plan = device_plan(q, k, v, alibi_slopes=slopes, **kwargs)["backward"]
  hopper_backward = is_hopper() and os.environ.get("JAX_FLASH2_SM90_BACKWARD", "1") != "0"
  assert plan.kernel == ("sm90" if hopper_backward else "sm80"), plan
  (out, lse), got = fn(q, k, v, slopes, d_out, d_lse)
  (ref_out, ref_lse), ref_grads = oracle(q, k, v, d_out, d_lse, alibi_slopes=slopes, **kwargs)
  (base_out, base_lse), naive_vjp = jax.vjp(
      lambda q, k, v: naive_same_dtype(q, k, v, alibi_slopes=slopes, **kwargs), q, k, v)
  base_grads = naive_vjp((d_out, d_lse.astype(base_lse.dtype)))
  assert_close_to_oracle("out", out, ref_out, base_out, dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, dtype)
  for name, g, r, bg in zip(("dq", "dk", "dv"), got, ref_grads, base_grads):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert_close_to_oracle(name, g, r, bg, dtype)


@pytest.mark.parametrize("alibi", [True, False])
def test_nan_in_nan_out_with_options(rng, alibi):
  """A NaN in q reaches the outputs of its row through the option paths
  (softcap alone: the forward's constant max)."""
  q, k, v = random_inputs(rng, 2, 1000, 1000, 16, 4, 128, jnp.bfloat16)
  q = q.at[1, 17, 3, 5].set(jnp.nan)
  slopes = _slopes(rng, 2, 16, False) if alibi else None
  out = jax.jit(lambda q, k, v, s: jax_flash2.flash_attention(
      q, k, v, causal=True, softcap=20.0, alibi_slopes=s))(q, k, v, slopes)
  out = np.asarray(out, np.float32)
  assert np.all(np.isnan(out[1, 17, 3])), "the NaN row"
  rest = np.ones(out.shape[:3], bool)
  rest[1, 17, 3] = False  # a query is no key: every other row stays finite
  assert np.all(np.isfinite(out[rest]))


@pytest.mark.parametrize("head_dim", [64, 128])
def test_softcap_with_every_score_at_minus_the_cap(rng, head_dim):
  """Every score far below -cap (tanh saturated at -1): with the forward's
  constant max the terms are at their smallest (2^-125 at cap 50), and the
  rows must still see their keys: out and LSE against the oracle."""
  b, t, h, dtype = 2, 1000, 16, jnp.bfloat16
  q = jnp.asarray(rng.uniform(2.0, 3.0, (b, t, h, head_dim)), dtype)
  k = jnp.asarray(-rng.uniform(2.0, 3.0, (b, t, h, head_dim)), dtype)
  v = jnp.asarray(rng.standard_normal((b, t, h, head_dim)), dtype)
  kwargs = dict(causal=False, softcap=50.0, softmax_scale=1.0)
  assert device_plan(q, k, v, **kwargs)["forward"].kernel == (
      "sm90" if is_hopper() else "sm80-prefill")
  out, lse = jax.jit(lambda q, k, v: jax_flash2.flash_attention(
      q, k, v, return_lse=True, **kwargs))(q, k, v)
  (ref_out, ref_lse), _ = oracle(q, k, v, np.ones(q.shape), np.zeros(lse.shape), **kwargs)
  base_out, base_lse = naive_same_dtype(q, k, v, **kwargs)
  assert_close_to_oracle("out", out, ref_out, base_out, dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, dtype)
