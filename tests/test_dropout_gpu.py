"""Dropout on the GPU: on cc 9.0 the Hopper kernels are asserted to serve it
(forward at every head dim, backward up to D 128; the D-split backward at
D > 128 leaves it to sm80, with its reason), and the outputs and gradients
equal the reference backend's under the same key (the same Philox mask) and
the float64 oracle's given that mask, within a plain same-dtype attention's
error. Alone and with causal, windows, GQA, softcap, ALiBi and segment ids.
Runs only on a GPU."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2

from conftest import ON_GPU, device_plan, is_hopper, keep_mask, materialize_options, random_inputs
from oracle import ABS_SLACK, assert_close_to_oracle, max_err, naive_same_dtype, oracle

needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")



# (T, S, H, K, D, rate, options, dtype); B = 2. Grids of 200+ sm80 blocks, so
# that on cc 9.0 the Hopper forward serves them. Every Hopper forward tile
# (D 64 up to 256 keys and beyond, D 128 at 128 and 176 keys and masked
# above 8192 keys, D 256) and both D <= 128 backward tiles, persistent and
# stream-K grids among them.
CASES = [
    (1000, 1000, 16, 4, 128, 0.1, {"causal": True}, jnp.bfloat16),
    (1000, 5000, 16, 16, 128, 0.2, {}, jnp.bfloat16),
    (1025, 1500, 16, 4, 64, 0.3, {}, jnp.float16),
    (1000, 1000, 16, 16, 64, 0.1, {"causal": True, "softcap": 20.0}, jnp.bfloat16),
    (200, 200, 64, 16, 64, 0.1, {"causal": True, "softcap": 20.0, "alibi": True,
                                 "segments": True}, jnp.bfloat16),
    (1024, 9000, 16, 16, 128, 0.1, {"window_size": (700, 0)}, jnp.float16),
    (1000, 1000, 16, 8, 96, 0.2, {"alibi": True, "softcap": 15.0, "softmax_scale": 0.5},
     jnp.bfloat16),
    (1000, 1000, 16, 16, 128, 0.1, {"causal": True, "segments": True}, jnp.bfloat16),
    (1000, 1111, 8, 2, 256, 0.1, {"causal": True}, jnp.bfloat16),
    (1000, 700, 16, 8, 200, 0.2, {"alibi": True}, jnp.float16),
]


def _case_id(c):
  t, s, h, hk, d, rate, options, dtype = c
  return f"T{t}S{s}H{h}K{hk}D{d}-p{rate}-" + "-".join(sorted(options) or ["plain"]) + (
      f"-{jnp.dtype(dtype).name}")


def _plans(case, rng, cc, sm_count):
  t, s, h, hk, d, rate, options, dtype = case
  options = materialize_options(options, rng, 2, t, h)
  q, k, v = (jax.ShapeDtypeStruct(shape, dtype) for shape in
             ((2, t, h, d), (2, s, hk, d), (2, s, hk, d)))
  return jax_flash2.plan(q, k, v, compute_capability=cc, sm_count=sm_count, dropout_rate=rate,
                         **options)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_cases_take_the_hopper_kernels(rng, case):
  """On an H200 (cc 9.0, 132 SMs) every case runs the Hopper forward (no
  split-KV grid), and the Hopper backward up to D 128: checked on CPU, so
  that the GPU test below asserts what it means to."""
  plans = _plans(case, rng, (9, 0), 132)
  assert plans["forward"].kernel == "sm90", plans
  assert plans["backward"].kernel == ("sm90" if case[4] <= 128 else "sm80"), plans


@needs_gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dropout_matches_reference_and_oracle(rng, case):
  t, s, h, hk, d, rate, options, dtype = case
  b = 2
  options = materialize_options(options, rng, b, t, h)
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, dtype)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  d_lse = jnp.asarray(rng.standard_normal((b, h, t)), jnp.float32)
  key = jax.random.key(int(rng.integers(1 << 30)))

  plans = device_plan(q, k, v, dropout_rate=rate, **options)
  hopper_backward = is_hopper() and os.environ.get("JAX_FLASH2_SM90_BACKWARD", "1") != "0"
  assert plans["forward"].kernel == ("sm90" if is_hopper() else "sm80-prefill"), plans
  if hopper_backward and d > 128:
    assert plans["backward"].kernel == "sm80", plans
    assert plans["backward"].reason == (
        "dropout at D > 128: the Hopper backward does not serve it"), plans
  else:
    assert plans["backward"].kernel == ("sm90" if hopper_backward else "sm80"), plans

  def run(implementation):
    f = jax.jit(lambda q, k, v, key: jax_flash2.flash_attention(
        q, k, v, return_lse=True, dropout_rate=rate, dropout_rng=key,
        implementation=implementation, **options))
    (out, lse), vjp = jax.vjp(lambda q, k, v: f(q, k, v, key), q, k, v)
    return (out, lse) + tuple(vjp((d_out, d_lse)))

  got = run("kernel")
  ref = run("reference")
  keep = keep_mask(key, b, h, t, s, rate)
  (ref_out, ref_lse), ref_grads = oracle(q, k, v, d_out, d_lse, dropout_keep=keep,
                                         dropout_rate=rate, **options)
  naive = lambda q, k, v: naive_same_dtype(q, k, v, dropout_keep=keep, dropout_rate=rate,
                                           **options)
  (base_out, base_lse), base_vjp = jax.vjp(naive, q, k, v)
  base = (base_out, base_lse) + tuple(base_vjp((d_out, d_lse.astype(dtype))))
  exact = (ref_out, ref_lse) + tuple(ref_grads)
  for name, g, r, e, bg in zip(("out", "lse", "dq", "dk", "dv"), got, ref, exact, base):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), name
    assert_close_to_oracle(name, g, e, bg, dtype)
    # The reference backend (same key, same mask): within the same bound plus
    # the reference's own error; a different mask would move elements by
    # about P / (1 - rate), far more.
    scale = max(1.0, float(np.max(np.abs(np.where(np.isfinite(e), e, 0)))))
    bound = 2 * max_err(bg, e) + max_err(r, e) + ABS_SLACK[jnp.dtype(dtype)] * scale
    assert max_err(g, r) <= bound, f"{name} vs reference: {max_err(g, r):.3g} > {bound:.3g}"


@needs_gpu
@pytest.mark.parametrize("d, s", [(256, 256), (64, 448), (128, 640), (128, 4400)])
def test_dropout_mask_on_hopper_is_the_reference_mask(d, s):
  """The mask read off the kernel's output (q = 0: P = 1 / S; v one-hot over
  d of the keys per call) is the reference's bit for bit, on every Hopper
  forward tile: D 64 (bits packed, then transposed), both D 128 ones and D
  256 (words transposed, then compared)."""
  b, t, h, rate = 2, 1000, 16, 0.3
  key = jax.random.key(3)
  q = jnp.zeros((b, t, h, d), jnp.float16)
  k = jnp.zeros((b, s, h, d), jnp.float16)
  plan = device_plan(q, k, k, dropout_rate=rate)["forward"]
  assert plan.kernel == ("sm90" if is_hopper() else "sm80-prefill"), plan

  @jax.jit
  def keys_of_chunk(j):
    one_hot = (jnp.arange(s)[:, None] == j * d + jnp.arange(d)[None, :]).astype(jnp.float16)
    v = jnp.broadcast_to(one_hot[None, :, None, :], k.shape)
    return jax_flash2.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=key)

  out = jnp.concatenate([keys_of_chunk(j) for j in range(-(-s // d))], axis=-1)[..., :s]
  scaled = np.asarray(out, np.float32).transpose(0, 2, 1, 3) * s * (1 - rate)
  assert np.all((np.abs(scaled) < 1e-5) | (np.abs(scaled - 1) < 2e-3)), "entries not 0 or 1"
  np.testing.assert_array_equal(scaled > 0.5, keep_mask(key, b, h, t, s, rate))
