"""Dropout on the attention weights: the keep mask (Philox4x32-10 of a
per-(batch, head) seed and the position), its statistics, kernel == reference
with the same key, forward and gradients against the float64 oracle with the
same mask, transforms, and argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from conftest import (ON_GPU, attention_fn, keep_mask, materialize_options, random_inputs,
                      run_host_test, supports)
from jax_flash2 import _ext, reference
from oracle import assert_close_to_oracle, naive_same_dtype, oracle

# The kernels' dtype here: the CUDA kernels take 16-bit inputs only. Tests that
# run a backend on it loosen their float32 tolerances by TOL_16 where it is
# 16-bit (every such tolerance stays far below what a wrong mask changes).
DTYPE = jnp.float16 if ON_GPU else jnp.float32


def _tol(f32_tol, dtype=DTYPE):
  return f32_tol if jnp.dtype(dtype) == jnp.float32 else 2e-3


def kernel_mask(key, batch, heads, seqlen_q, seqlen_k, rate, backend="kernel"):
  """The mask a backend actually applied, read off its output: with q = 0 every
  visible key gets P = 1 / S, and v one-hot over the keys (D = S) makes
  out[b, i, h, j] = Z[b, h, i, j] / (S (1 - rate)), rate the applied one."""
  dtype = DTYPE if backend == "kernel" else jnp.float32
  q = jnp.zeros((batch, seqlen_q, heads, seqlen_k), dtype)
  k = jnp.zeros((batch, seqlen_k, 1, seqlen_k), dtype)
  v = jnp.broadcast_to(jnp.eye(seqlen_k, dtype=dtype)[None, :, None, :], k.shape)
  out = jax_flash2.flash_attention(q, k, v, dropout_rate=rate, dropout_rng=key,
                                   implementation=backend)
  # [B, H, T, S]; a 16-bit output rounds 1 / (S (1 - rate)) to 2^-11 relative.
  applied = reference.applied_dropout_rate(rate)
  scaled = np.asarray(out, np.float32).transpose(0, 2, 1, 3) * seqlen_k * (1 - applied)
  tol = 1e-4 if dtype == jnp.float32 else 2e-3
  assert np.all((np.abs(scaled) < 1e-5) | (np.abs(scaled - 1) < tol)), "entries not 0 or 1"
  return scaled > 0.5


def test_philox_known_answers():
  """The reference's Philox4x32-10 against Random123's known-answer vectors
  (kat_vectors: philox4x32_10); the kernels agree with the reference below."""
  def run(counter, key):
    return [int(x) for x in reference.philox4x32(
        [np.uint32(c) for c in counter], [np.uint32(k) for k in key])]

  assert run((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
  assert run((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6,
                                                      0x6D5451FD]
  assert run((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) == [
      0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_kernel_mask_is_the_reference_mask_and_keeps_one_minus_rate(rate):
  key = jax.random.key(11)
  batch, heads, seqlen_q, seqlen_k = 2, 3, 77, 200
  ours = kernel_mask(key, batch, heads, seqlen_q, seqlen_k, rate)
  expected = keep_mask(key, batch, heads, seqlen_q, seqlen_k, rate)
  np.testing.assert_array_equal(ours, expected)
  rate = reference.applied_dropout_rate(rate)  # the statistics below are of this rate
  np.testing.assert_array_equal(kernel_mask(key, batch, heads, seqlen_q, seqlen_k, rate,
                                            "reference"), expected)
  # Keep rate within 5 standard deviations of a Bernoulli(1 - rate) mean.
  n = ours.size
  sigma = np.sqrt(rate * (1 - rate) / n)
  assert abs(ours.mean() - (1 - rate)) < 5 * sigma, (ours.mean(), 1 - rate, sigma)
  # Words of one Philox call (adjacent keys), neighbouring rows and different
  # heads are independent: P(both kept) = (1 - rate)^2.
  for a, b in ((ours[..., 0::4], ours[..., 1::4]), (ours[..., :-1, :], ours[..., 1:, :]),
               (ours[:, 0], ours[:, 1])):
    both = (a & b).mean()
    assert abs(both - (1 - rate)**2) < 5 * np.sqrt((1 - rate)**2 / a.size), (both, rate)


def test_mask_statistics_large():
  """Keep rate per (batch, head) and per key column on a larger mask."""
  rate = 0.3
  mask = keep_mask(jax.random.key(5), 4, 8, 512, 512, rate)
  rate = reference.applied_dropout_rate(rate)  # 77 / 256
  per_head = mask.mean(axis=(2, 3))
  sigma = np.sqrt(rate * (1 - rate) / (512 * 512))
  assert np.all(np.abs(per_head - (1 - rate)) < 5 * sigma), per_head
  per_column = mask.mean(axis=(0, 1, 2))  # 16k draws each
  sigma = np.sqrt(rate * (1 - rate) / (4 * 8 * 512))
  assert np.all(np.abs(per_column - (1 - rate)) < 5.5 * sigma)
  # Different batch entries and heads get different masks.
  assert not np.array_equal(mask[0, 0], mask[0, 1]) and not np.array_equal(mask[0, 0], mask[1, 0])


# (batch, T, S, H, K, D, options): odd lengths, T != S both ways, GQA, MQA,
# causal, window, and dropout combined with softcap, ALiBi and segment ids.
CASES = [
    (2, 37, 70, 4, 2, 32, {"causal": True}),
    (1, 130, 65, 2, 1, 64, {"causal": True}),
    (2, 65, 63, 4, 4, 40, {}),
    (1, 100, 150, 4, 2, 32, {"window_size": (20, 5)}),
    (2, 97, 97, 4, 2, 64, {"causal": True, "softcap": 3.0, "alibi": True, "segments": True}),
]


def _case_id(case):
  b, t, s, h, k, d, options = case
  return f"b{b}-t{t}-s{s}-h{h}k{k}-d{d}-" + "-".join(sorted(options)) if options else (
      f"b{b}-t{t}-s{s}-h{h}k{k}-d{d}")


def _materialize(case, rng):
  b, t, _, h, _, _, options = case
  return materialize_options(options, rng, b, t, h)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.skipif(ON_GPU, reason="float32 kernels only (CPU); the GPU's 16-bit kernels are "
                    "checked against the oracle in test_against_oracle")
def test_kernel_equals_reference(case, rng):
  """Same key: the kernel's forward, LSE and gradients equal jax.grad of the
  reference (float32, to float32 rounding)."""
  b, t, s, h, hk, d, _ = case
  options = _materialize(case, rng)
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, jnp.float32)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  d_lse = jnp.asarray(rng.standard_normal((b, h, t)), jnp.float32)
  key = jax.random.key(int(rng.integers(1 << 30)))

  def run(backend):
    f = jax.jit(lambda q, k, v, key: attention_fn(backend)(
        q, k, v, return_lse=True, dropout_rate=0.25, dropout_rng=key, **options))
    (out, lse), vjp = jax.vjp(lambda q, k, v: f(q, k, v, key), q, k, v)
    return (out, lse) + tuple(vjp((d_out, d_lse)))

  for name, a, r in zip(("out", "lse", "dq", "dk", "dv"), run("kernel"), run("reference")):
    scale = max(1.0, float(np.max(np.abs(np.where(np.isfinite(r), r, 0)))))
    np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=2e-5 * scale, rtol=0,
                               err_msg=name)


@pytest.mark.parametrize("dtype", (jnp.float16, jnp.bfloat16, jnp.float32),
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES[:2] + CASES[4:], ids=_case_id)
def test_against_oracle(backend, case, dtype, rng):
  """Forward, LSE and gradients against the float64 oracle given the same
  mask, with the tolerance of a plain same-dtype attention."""
  if not supports(backend, dtype):
    pytest.skip(f"{backend} does not serve {jnp.dtype(dtype).name} here")
  b, t, s, h, hk, d, _ = case
  rate = 0.2
  options = _materialize(case, rng)
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, dtype)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  d_lse = jnp.asarray(rng.standard_normal((b, h, t)), jnp.float32)
  key = jax.random.key(int(rng.integers(1 << 30)))
  f = jax.jit(lambda q, k, v: attention_fn(backend)(
      q, k, v, return_lse=True, dropout_rate=rate, dropout_rng=key, **options))
  (out, lse), vjp = jax.vjp(f, q, k, v)
  grads = vjp((d_out, d_lse))
  keep = keep_mask(key, b, h, t, s, rate)
  (ref_out, ref_lse), ref_grads = oracle(q, k, v, d_out, d_lse, dropout_keep=keep,
                                         dropout_rate=rate, **options)
  naive = lambda q, k, v: naive_same_dtype(q, k, v, dropout_keep=keep, dropout_rate=rate,
                                           **options)
  (base_out, base_lse), base_vjp = jax.vjp(naive, q, k, v)
  base_grads = base_vjp((d_out, d_lse.astype(dtype)))
  assert_close_to_oracle("out", out, ref_out, base_out, dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, dtype)
  for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
    assert_close_to_oracle(name, g, r, bg, dtype)


def test_oracle_matches_autodiff_of_reference(rng):
  """The oracle's dropout gradients equal jax.grad of the float64 reference."""
  q, k, v = random_inputs(rng, 2, 19, 23, 4, 2, 16, jnp.float32)
  d_out = rng.standard_normal(q.shape)
  d_lse = rng.standard_normal((2, 4, 19))
  key = jax.random.key(7)
  rate = 0.4
  options = {"causal": True, "window_size": (9, -1)}
  keep = keep_mask(key, 2, 4, 19, 23, rate)
  assert 0 < keep.mean() < 1
  (out, lse), grads = oracle(q, k, v, d_out, d_lse, dropout_keep=keep,
                             dropout_rate=float(np.float32(rate)), **options)
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
    f = lambda q, k, v: reference.attention(q, k, v, return_lse=True, dropout_rate=rate,
                                            dropout_rng=key, **options)
    (ref_out, ref_lse), vjp = jax.vjp(f, *args)
    ref_grads = vjp((jnp.asarray(d_out), jnp.asarray(d_lse)))
  # The reference's 1 / (1 - rate) is the kernels' float32 value.
  np.testing.assert_allclose(out, ref_out, atol=1e-7)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-12)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-7)


def test_same_key_same_result_different_key_different(backend, rng):
  q, k, v = random_inputs(rng, 2, 50, 60, 4, 2, 32, DTYPE)
  f = jax.jit(lambda key: attention_fn(backend)(q, k, v, causal=True, dropout_rate=0.3,
                                                dropout_rng=key))
  a, b = f(jax.random.key(1)), f(jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  c = f(jax.random.key(2))
  assert np.mean(np.asarray(a) != np.asarray(c)) > 0.5
  # A raw uint32 key works the same as the typed key it wraps.
  raw = jax_flash2.flash_attention(q, k, v, causal=True, dropout_rate=0.3,
                                   dropout_rng=jax.random.PRNGKey(1), implementation=backend)
  typed = jax_flash2.flash_attention(q, k, v, causal=True, dropout_rate=0.3,
                                     dropout_rng=jax.random.wrap_key_data(jax.random.PRNGKey(1)),
                                     implementation=backend)
  np.testing.assert_array_equal(np.asarray(raw), np.asarray(typed))


def test_rate_zero_is_no_dropout_exactly(backend, rng):
  q, k, v = random_inputs(rng, 1, 40, 33, 2, 1, 32, DTYPE)

  # Deterministic: the CUDA backward's dQ atomics would differ run to run.
  def loss(q, k, v, **kw):
    out = attention_fn(backend)(q, k, v, causal=True, deterministic=True, **kw)
    return jnp.sum(out.astype(jnp.float32) ** 2)

  plain = jax.value_and_grad(loss, (0, 1, 2))(q, k, v)
  zero = jax.value_and_grad(lambda *a: loss(*a, dropout_rate=0.0,
                                            dropout_rng=jax.random.key(3)), (0, 1, 2))(q, k, v)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(zero)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dropout_changes_the_output_as_expected(rng):
  """E[out] over masks is the undropped output: averaging many keys converges."""
  q, k, v = random_inputs(rng, 1, 9, 40, 2, 2, 16, DTYPE)
  keys = jax.random.split(jax.random.key(0), 400)
  outs = np.asarray(jax.vmap(lambda key: jax_flash2.flash_attention(
      q, k, v, dropout_rate=0.5, dropout_rng=key))(keys), np.float32)
  plain = np.asarray(jax_flash2.flash_attention(q, k, v), np.float32)
  # The 288 means share each (row, head)'s 400 masks, so their largest
  # deviation passed 4 sigma in 12 of 460 input draws and once passed 5 (CI);
  # 6 sigma keeps chance out; a missing 1 / (1 - rate) rescale is off by
  # half the output (the keep rate itself: test_mask_statistics_large).
  spread = outs.std(axis=0) / np.sqrt(len(keys))
  assert np.all(np.abs(outs.mean(axis=0) - plain) < 6 * spread + _tol(1e-6))


def test_vmap_over_keys_and_inputs(backend, rng):
  q, k, v = random_inputs(rng, 2, 21, 30, 4, 2, 16, DTYPE)
  keys = jax.random.split(jax.random.key(4), 3)

  def f(q, k, v, key):
    out = attention_fn(backend)(q, k, v, causal=True, dropout_rate=0.3, dropout_rng=key)
    return out.astype(jnp.float32)

  batched = jax.jit(jax.vmap(f, in_axes=(None, None, None, 0)))(q, k, v, keys)
  for n in range(3):
    np.testing.assert_allclose(np.asarray(batched[n]), np.asarray(f(q, k, v, keys[n])),
                               atol=_tol(1e-6))
  # vmap over the inputs with one shared key: each example gets the same masks.
  qs = jnp.stack([q, 2 * q])
  batched = jax.vmap(f, in_axes=(0, None, None, None))(qs, k, v, keys[0])
  for n in range(2):
    np.testing.assert_allclose(np.asarray(batched[n]), np.asarray(f(qs[n], k, v, keys[0])),
                               atol=_tol(1e-6))
  # Gradients under vmap over keys.
  loss = lambda q, key: jnp.sum(f(q, k, v, key) ** 2)
  grads = jax.vmap(jax.grad(loss), in_axes=(None, 0))(q, keys)
  for n in range(3):
    np.testing.assert_allclose(np.asarray(grads[n], np.float32),
                               np.asarray(jax.grad(loss)(q, keys[n]), np.float32),
                               atol=_tol(1e-5) * 5)


def test_checkpoint_regenerates_the_same_mask(rng):
  q, k, v = random_inputs(rng, 1, 33, 33, 2, 1, 32, DTYPE)
  key = jax.random.key(9)
  # Deterministic: the CUDA backward's dQ atomics would differ run to run.
  loss = lambda q: jnp.sum(jax_flash2.flash_attention(
      q, k, v, causal=True, dropout_rate=0.3, dropout_rng=key,
      deterministic=True).astype(jnp.float32) ** 2)
  np.testing.assert_array_equal(np.asarray(jax.grad(jax.checkpoint(loss))(q)),
                                np.asarray(jax.grad(loss)(q)))


def test_varlen(backend, rng):
  cu = jnp.asarray([0, 5, 30, 47], jnp.int32)
  q, k, v = (x[0] for x in random_inputs(rng, 1, 47, 47, 4, 2, 16, DTYPE))
  key = jax.random.key(2)
  out = {name: jax_flash2.flash_attention_varlen(
      q, k, v, cu, cu, 25, 25, causal=True, dropout_rate=0.2, dropout_rng=key,
      implementation=name) for name in ("kernel", "reference")}
  np.testing.assert_allclose(np.asarray(out["kernel"], np.float32),
                             np.asarray(out["reference"], np.float32), atol=_tol(2e-6))
  plain = jax_flash2.flash_attention_varlen(q, k, v, cu, cu, 25, 25, causal=True,
                                            implementation=backend)
  assert not np.allclose(np.asarray(out[backend], np.float32), np.asarray(plain, np.float32),
                         atol=1e-2)


def test_errors():
  q = jnp.zeros((1, 8, 2, 16))
  key = jax.random.key(0)
  for rate in (-0.1, 1.0, 1.5, 0.99999999, float("nan"), float("inf")):
    with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
      jax_flash2.flash_attention(q, q, q, dropout_rate=rate, dropout_rng=key)
  with pytest.raises(TypeError, match="dropout_rate must be a number"):
    jax_flash2.flash_attention(q, q, q, dropout_rate=None, dropout_rng=key)
  with pytest.raises(TypeError, match="dropout_rate must be a static Python number"):
    jax.jit(lambda r: jax_flash2.flash_attention(q, q, q, dropout_rate=r, dropout_rng=key))(0.1)
  with pytest.raises(ValueError, match="dropout_rate=0.1 needs dropout_rng"):
    jax_flash2.flash_attention(q, q, q, dropout_rate=0.1)
  with pytest.raises(ValueError, match="dropout_rng must be one jax PRNG key"):
    jax_flash2.flash_attention(q, q, q, dropout_rate=0.1, dropout_rng=jnp.zeros(2))
  with pytest.raises(ValueError, match="dropout_rng must be one jax PRNG key"):
    jax_flash2.flash_attention(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.split(key, 2))
  with pytest.raises(TypeError, match="dropout_rng must be a jax PRNG key"):
    jax_flash2.flash_attention(q, q, q, dropout_rate=0.1, dropout_rng=3)
  with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
    reference.attention(q, q, q, dropout_rate=1.0, dropout_rng=key)


def test_scalar_mask_function_matches_the_reference():
  """The scalar Philox and DropoutMask::Keep16 of src/flash_dropout.h (what the
  CUDA kernels call; the CPU kernels run a vectorized copy of the rounds)
  against the known answers and the reference mask."""
  philox = _ext.cpu_ext.philox4x32
  assert philox(0, 0, 0, 0, 0, 0) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
  assert philox(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0) == (
      0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)
  seeds = np.asarray([[[0x12345678, 0x9ABCDEF0]]], np.uint32)
  for rate in (0.1, 0.75, 1 / 256, 255 / 256):
    applied = reference.applied_dropout_rate(rate)
    mask = np.asarray(reference.dropout_keep(jnp.asarray(seeds), 37, 64, rate))[0, 0]
    got = np.array([[(_ext.cpu_ext.dropout_keep16(0x12345678, 0x9ABCDEF0, applied, i, j // 16)
                      >> (j % 16)) & 1 for j in range(64)] for i in range(37)], bool)
    np.testing.assert_array_equal(got, mask)
    # Key 16 g + k is byte k of the call's 16 (word (k % 8) / 2, byte k % 2 + 2 (k / 8)).
    words = [reference.philox4x32((np.uint32(g), np.uint32(i), np.uint32(0), np.uint32(0)),
                                  (np.uint32(0x12345678), np.uint32(0x9ABCDEF0)))
             for i in range(3) for g in range(4)]
    threshold = round(applied * 256)
    by_hand = np.array([[(int(words[4 * i + j // 16][(j % 8) // 2]) >> (8 * (j % 2 + 2 * (
        (j % 16) // 8)))) & 0xFF for j in range(64)] for i in range(3)]) >= threshold
    np.testing.assert_array_equal(mask[:3], by_hand)


def test_bytewise_threshold_compare_exhaustive():
  """KeepBytes, the SWAR compare the CUDA kernels use: every byte value
  against every threshold, in each byte position."""
  compare = _ext.cpu_ext.dropout_keep_bytes
  rng = np.random.default_rng(0)
  for threshold in range(1, 256):
    values = np.arange(256)
    for position in range(4):
      others = rng.integers(0, 256, size=(256, 3))
      lanes = np.insert(others, position, values, axis=1)  # [256, 4] bytes
      words = (lanes * (1 << (8 * np.arange(4)))).sum(axis=1)
      got = np.array([compare(int(w), threshold * 0x01010101) for w in words])
      want = ((lanes >= threshold) << (8 * np.arange(4) + 7)).sum(axis=1)
      np.testing.assert_array_equal(got, want)


def test_kernel_keep_bit_layouts_on_host_lanes(tmp_path):
  """The CUDA kernels' keep-bit layouts (src/cuda/dropout_bits.cuh: the
  forward's quad transpose of packed bits, the backward's 8 x 8 one), built
  for the host with a thread per lane of a warp: every element's bit equals
  DropoutMask's, for each accumulator size the kernels use."""
  run = run_host_test(tmp_path, "dropout_bits_host_test.cc")
  assert run.returncode == 0 and " 0 mismatches" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("rate,applied", [(0.1, 26 / 256), (0.5, 0.5), (1e-4, 1 / 256),
                                          (0.9999, 255 / 256), (0.0, 0.0)])
def test_rate_is_applied_in_256ths(rate, applied):
  """One Philox byte decides a key: the rate applied is the nearest multiple
  of 1/256 in [1/256, 255/256], and survivors are scaled by its 1 / (1 - rate),
  on every backend alike."""
  assert reference.applied_dropout_rate(rate) == applied
  assert jax_flash2.api.make_config(jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)),
                                    jnp.zeros((1, 4, 1, 8)), dropout_rate=rate,
                                    dropout_rng=jax.random.key(0)).dropout_rate == applied
