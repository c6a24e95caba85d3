"""float32 on CUDA: the blockwise plain-JAX path (_blockwise.forward /
backward) that float32 calls lower to there.

On CPU the private switch _lowering._BLOCKWISE_FLOAT32_ON_CPU lowers float32
calls to the same path, so these tests check it here against the float64
oracle, forward and gradients (reverse and forward mode), under the default
matmul precision and 'highest', and that it never forms a T x S tensor. On a
GPU the same path runs without the switch (float32 is served by "kernel").
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from jax_flash2 import _blockwise, _ext, _lowering
from conftest import ON_GPU, random_inputs
from oracle import assert_close_to_oracle, naive_same_dtype, oracle
from test_attention import VARIANT_CASES, _check_forward, _check_gradients, _variant_id

PRECISIONS = ("default", "highest")


@contextlib.contextmanager
def _blockwise_path(precision="default"):
  """float32 calls lowered by the blockwise path (on CPU by the switch, on a
  GPU always), under the given jax.default_matmul_precision."""
  saved = _lowering._BLOCKWISE_FLOAT32_ON_CPU
  _lowering._BLOCKWISE_FLOAT32_ON_CPU = True
  jax.clear_caches()  # the switch is read at lowering time
  try:
    with jax.default_matmul_precision(None if precision == "default" else precision):
      yield
  finally:
    _lowering._BLOCKWISE_FLOAT32_ON_CPU = saved
    jax.clear_caches()


def _targets(hlo: str) -> set[str]:
  return set(re.findall(r'custom_call_target="(jax_flash2[a-z0-9_]*)"', hlo))


def test_switch_selects_the_blockwise_path(rng):
  q, k, v = random_inputs(rng, 1, 40, 40, 2, 1, 16, jnp.float32)
  loss = lambda q, k, v: jnp.sum(jax_flash2.flash_attention(q, k, v, causal=True) ** 2)  # noqa
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  with _blockwise_path():
    assert not _targets(grad.lower(q, k, v).compile().as_text())
  if not ON_GPU:
    assert _targets(grad.lower(q, k, v).compile().as_text()) == {
        _ext.FORWARD_TARGET, _ext.BACKWARD_TARGET}


CASES = [
    (1, 1, 1, 1, 1, 8, False),
    (2, 17, 17, 2, 1, 32, True),
    (1, 130, 257, 8, 2, 64, True),
    (2, 257, 130, 2, 2, 80, True),   # T > S: rows that see no key
    (1, 600, 600, 2, 1, 40, False),  # several query blocks (at most 512 rows each)
]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_gradients(case, precision, rng):
  with _blockwise_path(precision):
    _check_forward("kernel", case, jnp.float32, rng)
    _check_gradients("kernel", case, jnp.float32, rng, with_lse_cotangent=True)


@pytest.mark.parametrize("variant", VARIANT_CASES[::2] + VARIANT_CASES[-1:], ids=_variant_id)
def test_options(variant, rng):
  """Windows, softcap, ALiBi, segment ids, GQA: as the oracle."""
  case, options = variant
  with _blockwise_path():
    _check_forward("kernel", case, jnp.float32, rng, options)
    _check_gradients("kernel", case, jnp.float32, rng, with_lse_cotangent=True, options=options)


def test_many_blocks_with_options(rng, monkeypatch):
  """Blocks of 16 rows with a ragged tail, every option: the block offsets
  reach the masks, the bias, the ids and the backward's dK, dV sums."""
  monkeypatch.setattr(_blockwise, "_MAX_ROWS", 16)
  case = (2, 75, 61, 4, 2, 16, True)
  options = {"window_size": (30, -1), "softcap": 5.0, "segments": "packed", "alibi": "bh"}
  with _blockwise_path():
    _check_forward("kernel", case, jnp.float32, rng, options)
    _check_gradients("kernel", case, jnp.float32, rng, with_lse_cotangent=True, options=options)


def test_dropout_matches_the_kernels_mask(rng, monkeypatch):
  """With dropout the blockwise path applies the kernels' keep mask: equal
  (to float32 rounding) to the CPU kernel's results, forward and gradients."""
  if ON_GPU:
    pytest.skip("compares with the CPU kernels")
  monkeypatch.setattr(_blockwise, "_MAX_ROWS", 16)
  q, k, v = random_inputs(rng, 2, 45, 37, 4, 2, 16, jnp.float32)
  key = jax.random.key(7)

  def run():
    f = lambda q, k, v: jax_flash2.flash_attention(  # noqa: E731
        q, k, v, causal=True, dropout_rate=0.3, dropout_rng=key, return_lse=True)
    (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
    return (out, lse) + vjp((jnp.cos(out), jnp.sin(lse)))

  want = run()
  with _blockwise_path():
    got = run()
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def test_forward_mode_and_vmap(rng):
  q, k, v = random_inputs(rng, 2, 33, 29, 2, 1, 16, jnp.float32)
  f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True, return_lse=True)  # noqa
  with jax.enable_x64(True):
    ref = lambda *a: jax_flash2.reference.attention(  # noqa: E731
        *a, causal=True, return_lse=True)
    args64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
    want, want_t = jax.jvp(ref, args64, args64)
  # 'highest': on a GPU the default (TF32) would be off by more than the
  # float32 tolerance; test_gpu_precision_follows_default_matmul_precision checks TF32.
  with _blockwise_path("highest"):
    got, got_t = jax.jit(lambda *a: jax.jvp(f, a, a))(q, k, v)
    batched = jax.jit(jax.vmap(f))(q[None], k[None], v[None])
  for a, b in zip(jax.tree.leaves((got, got_t)), jax.tree.leaves((want, want_t))):
    np.testing.assert_allclose(a, np.asarray(b), atol=2e-5, rtol=2e-5)
  for a, b in zip(batched, got):
    np.testing.assert_allclose(a[0], b, atol=1e-6, rtol=1e-6)


def _largest_f32_buffer(hlo: str) -> int:
  sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
           for dims in re.findall(r"f32\[([\d,]*)\]", hlo)]
  return max(sizes)


def test_memory_is_linear_in_t(rng, monkeypatch):
  """T = S = 4096: the compiled forward and forward+backward hold no T x S
  buffer, only query blocks of scores (128 rows here), and their scratch is a
  fraction of one T x S float32 matrix."""
  monkeypatch.setattr(_blockwise, "_MAX_ROWS", 128)
  seqlen = 4096
  q, k, v = random_inputs(rng, 1, seqlen, seqlen, 1, 1, 64, jnp.float32)
  f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True)  # noqa: E731
  loss = lambda q, k, v: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
  rows, count = _blockwise.block_rows(1, 1, seqlen, seqlen)
  assert (rows, count) == (128, 32)
  with _blockwise_path():
    for fn in (jax.jit(f), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
      compiled = fn.lower(q, k, v).compile()
      largest = _largest_f32_buffer(compiled.as_text())
      assert largest <= 2 * rows * seqlen, largest
      memory = compiled.memory_analysis()
      if memory is not None:
        assert memory.temp_size_in_bytes < seqlen * seqlen * 4 / 4, memory.temp_size_in_bytes


@pytest.mark.skipif(not ON_GPU, reason="TF32 is a GPU matmul mode")
@pytest.mark.parametrize("precision", PRECISIONS)
def test_gpu_precision_follows_default_matmul_precision(precision, rng):
  """Under the default precision (TF32 tensor cores) the error is within 2x
  that of a plain float32 attention under the same precision; under
  'highest' also, and float32-accurate (the bound's baseline is then full
  float32)."""
  q, k, v = random_inputs(rng, 2, 300, 400, 4, 2, 64, jnp.float32)
  with jax.default_matmul_precision(None if precision == "default" else precision):
    out = jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True))(q, k, v)
    base, _ = naive_same_dtype(q, k, v, causal=True)
  d_out = jnp.zeros_like(out)
  (want, _), _ = oracle(q, k, v, d_out, jnp.zeros((2, 4, 300)), causal=True)
  assert_close_to_oracle("out", out, want, base, jnp.float32)
  if precision == "highest":
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


def test_nan_propagates(rng):
  """A NaN in one q row: that row's out, LSE and dq are NaN, the rest finite,
  as on the kernels."""
  q, k, v = random_inputs(rng, 1, 37, 41, 2, 1, 16, jnp.float32)
  q = q.at[0, 20, 1, 3].set(jnp.nan)
  f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True, return_lse=True)  # noqa
  with _blockwise_path():
    (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
    dq = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))[0]
  expected = np.zeros((37, 2), bool)
  expected[20, 1] = True
  np.testing.assert_array_equal(np.isnan(np.asarray(out[0])).any(-1), expected)
  np.testing.assert_array_equal(np.isnan(np.asarray(lse[0])), expected.T)
  np.testing.assert_array_equal(np.isnan(np.asarray(dq[0])).any(-1), expected)
