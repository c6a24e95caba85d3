"""Flax layers: jax_flash2.flax (nnx), jax_flash2.flax.linen and the attention_fn drop-in.

With the same weights the flash layers match plain Flax attention (which runs
jax.nn.dot_product_attention), outputs and parameter gradients, for MHA, GQA
and MQA, causal and not, and under Flax's transforms.

The layers compute in MODEL_DTYPE (conftest): float32 on CPU, where the flash
layer must equal the plain one to float32 rounding; bfloat16 on the GPU (the
CUDA kernels take 16-bit inputs; parameters stay float32), where the oracle
rule applies: against the plain layer in float32 (highest matmul precision),
the flash layer's error is at most 2x the plain bfloat16 layer's plus a slack.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
import flax.linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import jax_flash2  # noqa: E402
import jax_flash2.flax as jf  # noqa: E402
import jax_flash2.flax.linen as jfl  # noqa: E402
from conftest import MODEL_DTYPE, ON_GPU  # noqa: E402
from oracle import ABS_SLACK, assert_close_to_oracle, max_err, naive_same_dtype  # noqa: E402

DTYPE = MODEL_DTYPE
FEATURES = 32
HEADS = 4
HEAD_CASES = {"mha": HEADS, "gqa": 2, "mqa": 1}
TOL = dict(atol=2e-5, rtol=2e-5)


def close(a, b, **tol):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), **(tol or TOL))


def tree_close(a, b, **tol):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    close(x, y, **tol)


def agree(ours, plain, reference, dtype=DTYPE, **tol):
  """The flash layer's results `ours` against the plain layer's `plain`.

  float32: equal within `tol`. 16-bit: the oracle rule against `reference()`,
  the plain layer's results in float32, computed at the highest matmul precision
  (on the GPU float32 matmuls may otherwise run in TF32): per leaf, the error is
  at most 2x the plain layer's plus the slack, scaled by the largest reference
  value of the whole tree. (Per leaf would be too strict where the exact value
  is 0 by symmetry, as for the key bias gradient, which softmax cancels: both
  errors are then rounding noise of the larger gradients it is summed from.)
  """
  if jnp.dtype(dtype) == jnp.float32:
    tree_close(ours, plain, **tol)
    return
  with jax.default_matmul_precision("highest"):
    expected = reference()
  lo, to = jax.tree.flatten(ours)
  lp, tp = jax.tree.flatten(plain)
  le, te = jax.tree.flatten(expected)
  assert to == tp == te
  scale = max([1.0] + [float(np.max(np.abs(np.asarray(e, np.float64)))) for e in le])
  for i, (o, p, e) in enumerate(zip(lo, lp, le)):
    o = np.asarray(o, np.float64)
    assert np.all(np.isfinite(o)), f"leaf {i} of {to}: non-finite values"
    err, base = max_err(o, e), max_err(p, e)
    bound = 2.0 * base + ABS_SLACK[jnp.dtype(dtype)] * scale
    assert err <= bound, (f"leaf {i} of {to}: error {err:.3g} > bound {bound:.3g} "
                          f"(plain {jnp.dtype(dtype).name}: {base:.3g})")


def inputs(shape, seed=0):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def plain_twin(flash, kv_heads, dtype, **kw):
  """A plain nnx.MultiHeadAttention computing in `dtype` with flash's weights."""
  plain = nnx.MultiHeadAttention(
      HEADS, FEATURES, num_kv_heads=kv_heads, decode=False, dtype=dtype, rngs=nnx.Rngs(1), **kw)
  nnx.update(plain, nnx.state(flash, nnx.Param))
  return plain


def flash_and_plain(kv_heads, causal, dtype=DTYPE, **kw):
  """A flash nnx layer, a plain nnx.MultiHeadAttention with its weights, both
  computing in `dtype`, and a maker of the plain layer in float32."""
  flash = jf.MultiHeadAttention(
      HEADS, FEATURES, num_kv_heads=kv_heads, causal=causal, dtype=dtype, rngs=nnx.Rngs(0), **kw)
  return (flash, plain_twin(flash, kv_heads, dtype, **kw),
          lambda: plain_twin(flash, kv_heads, jnp.float32, **kw))


def param_grads(model, loss):
  return nnx.grad(loss)(model)


# nnx module


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", sorted(HEAD_CASES))
def test_nnx_matches_plain_flax(heads, causal):
  flash, plain, reference = flash_and_plain(HEAD_CASES[heads], causal)
  x = inputs((2, 24, FEATURES))
  assert flash(x).dtype == DTYPE
  agree(flash(x), plain(x, is_causal=causal), lambda: reference()(x, is_causal=causal))

  # The K/V projections really are the smaller ones.
  assert flash.key.kernel.shape == (FEATURES, HEAD_CASES[heads], FEATURES // HEADS)

  def grads(model, **call):
    return nnx.state(param_grads(
        model, lambda m: jnp.sum(jnp.sin(m(x, **call).astype(jnp.float32)))))

  agree(grads(flash), grads(plain, is_causal=causal),
        lambda: grads(reference(), is_causal=causal), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_nnx_cross_attention(heads):
  # Cross-attention on a longer memory with its own feature width. (Not
  # causal: with T != S jax.nn.dot_product_attention aligns the causal mask
  # top-left, the kernels bottom-right.)
  kw = dict(in_kv_features=16, out_features=8, qkv_features=64)
  flash, plain, reference = flash_and_plain(HEAD_CASES[heads], causal=False, **kw)
  x, mem = inputs((2, 8, FEATURES), 1), inputs((2, 24, 16), 2)
  agree(flash(x, mem), plain(x, mem), lambda: reference()(x, mem))
  assert flash(x, mem).shape == (2, 8, 8)


@pytest.mark.parametrize("batch", [(), (2, 3)])
def test_nnx_batch_axes(batch):
  flash, plain, reference = flash_and_plain(2, causal=False)
  x = inputs(batch + (16, FEATURES))
  agree(flash(x), plain(x), lambda: reference()(x))


def test_nnx_dtype():
  flash, plain, reference = flash_and_plain(2, causal=True, dtype=jnp.bfloat16)
  x = inputs((2, 16, FEATURES))
  out = flash(x)
  assert out.dtype == jnp.bfloat16
  assert flash.query.kernel.dtype == jnp.float32
  agree(out, plain(x, is_causal=True), lambda: reference()(x, is_causal=True),
        dtype=jnp.bfloat16)


def test_nnx_rejects_bad_heads():
  with pytest.raises(ValueError, match="num_kv_heads"):
    jf.MultiHeadAttention(4, FEATURES, num_kv_heads=3, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="qkv_features"):
    jf.MultiHeadAttention(4, FEATURES, qkv_features=30, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="qkv_features"):
    jf.MultiHeadAttention(4, FEATURES, qkv_features=0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rate", [-0.1, float("nan"), 1.0])
def test_modules_reject_bad_dropout_rates_even_when_deterministic(rate):
  """A rate outside [0, 1) is an error also where no dropout would run (it
  would otherwise silently mean no dropout)."""
  with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
    jf.MultiHeadAttention(2, FEATURES, dropout_rate=rate, deterministic=True, rngs=nnx.Rngs(0))
  layer = jfl.MultiHeadAttention(2, dropout_rate=rate, deterministic=True)
  with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
    layer.init(jax.random.key(0), inputs((1, 8, FEATURES)))


def test_module_window_size_is_checked_by_name():
  layer = jf.MultiHeadAttention(2, FEATURES, window_size=4, rngs=nnx.Rngs(0))
  with pytest.raises((ValueError, TypeError), match="window_size"):
    layer(inputs((1, 8, FEATURES)))


# Transforms


def test_jax_jit_functional():
  flash, plain, reference = flash_and_plain(2, causal=True)
  graphdef, state = nnx.split(flash)
  x = inputs((2, 16, FEATURES))

  @jax.jit
  def loss(state, x):
    return jnp.sum(nnx.merge(graphdef, state)(x).astype(jnp.float32) ** 2)

  def plain_grads(model):
    return nnx.state(param_grads(
        model, lambda m: jnp.sum(m(x, is_causal=True).astype(jnp.float32) ** 2)))

  agree(jax.grad(loss)(state, x), plain_grads(plain), lambda: plain_grads(reference()),
        atol=1e-4, rtol=1e-4)


def test_nnx_jit_grad_train_step():
  optax = pytest.importorskip("optax")
  flash, plain, reference = flash_and_plain(2, causal=True)
  x, y = inputs((2, 16, FEATURES), 1), inputs((2, 16, FEATURES), 2)

  def train(model, **call):
    """Three SGD steps: the losses and the trained parameters."""
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    @nnx.jit
    def step(model, opt):
      loss, grads = nnx.value_and_grad(
          lambda m: jnp.mean((m(x, **call).astype(jnp.float32) - y) ** 2))(model)
      opt.update(model, grads)
      return loss

    losses = jnp.stack([step(model, opt) for _ in range(3)])
    return losses, nnx.state(model, nnx.Param)

  flash_losses, flash_params = train(flash)
  assert flash_losses[-1] < flash_losses[0]
  agree((flash_losses, flash_params), train(plain, is_causal=True),
        lambda: train(reference(), is_causal=True), atol=1e-5, rtol=1e-5)


def test_nnx_remat():
  flash, plain, reference = flash_and_plain(2, causal=True)
  x = inputs((2, 16, FEATURES))

  def loss(model):
    return jnp.sum(nnx.remat(lambda m, x: m(x))(model, x).astype(jnp.float32) ** 2)

  def plain_grads(model):
    return nnx.state(param_grads(
        model, lambda m: jnp.sum(m(x, is_causal=True).astype(jnp.float32) ** 2)))

  g = nnx.jit(nnx.grad(loss))(flash)
  agree(nnx.state(g), plain_grads(plain), lambda: plain_grads(reference()),
        atol=1e-4, rtol=1e-4)


class Block(nnx.Module):
  """Pre-norm residual attention block, as stacked in a transformer."""

  def __init__(self, attention_cls, rngs):
    self.norm = nnx.LayerNorm(FEATURES, rngs=rngs)
    self.attn = attention_cls(rngs)

  def __call__(self, x, **call):
    return x + self.attn(self.norm(x), **call).astype(x.dtype)


def test_nnx_scan_over_layers():
  layers = 3

  def stacked(attention_cls):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return Block(attention_cls, rngs)

    return create(nnx.Rngs(0))

  flash = stacked(lambda rngs: jf.MultiHeadAttention(
      HEADS, FEATURES, num_kv_heads=2, causal=True, dtype=DTYPE, rngs=rngs))

  def plain_stack(dtype):
    plain = stacked(lambda rngs: nnx.MultiHeadAttention(
        HEADS, FEATURES, num_kv_heads=2, decode=False, dtype=dtype, rngs=rngs))
    nnx.update(plain, nnx.state(flash, nnx.Param))
    return plain

  plain = plain_stack(DTYPE)
  x = inputs((2, 16, FEATURES))

  def run(model, x, **call):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, x):
      return block(x, **call)

    return body(model, x)

  def loss(model, **call):
    return jnp.sum(run(model, x, **call) ** 2)

  def plain_grads(model):
    return nnx.state(nnx.grad(lambda m: loss(m, is_causal=True))(model))

  agree(nnx.jit(run)(flash, x), run(plain, x, is_causal=True),
        lambda: run(plain_stack(jnp.float32), x, is_causal=True), atol=1e-4, rtol=1e-4)
  agree(nnx.state(nnx.jit(nnx.grad(loss))(flash)), plain_grads(plain),
        lambda: plain_grads(plain_stack(jnp.float32)), atol=1e-3, rtol=1e-3)


# Linen


def plain_linen(params, x, kv, causal, dtype=DTYPE):
  """The same Linen parameters through jax.nn.dot_product_attention, computing
  in `dtype` as the layer's DenseGeneral projections do."""
  p = jax.tree.map(lambda a: a.astype(dtype), params["params"])
  x, kv = x.astype(dtype), kv.astype(dtype)

  def proj(name, y):
    return jnp.einsum("...f,fhd->...hd", y, p[name]["kernel"]) + p[name]["bias"]

  q, k, v = proj("query", x), proj("key", kv), proj("value", kv)
  o = jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  return jnp.einsum("...hd,hdf->...f", o, p["out"]["kernel"]) + p["out"]["bias"]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", sorted(HEAD_CASES))
def test_linen_matches_plain(heads, causal):
  layer = jfl.MultiHeadAttention(HEADS, num_kv_heads=HEAD_CASES[heads], causal=causal,
                                 dtype=DTYPE)
  x = inputs((2, 24, FEATURES))
  params = layer.init(jax.random.key(0), x)
  assert params["params"]["key"]["kernel"].shape == (
      FEATURES, HEAD_CASES[heads], FEATURES // HEADS)
  agree(jax.jit(layer.apply)(params, x), plain_linen(params, x, x, causal),
        lambda: plain_linen(params, x, x, causal, jnp.float32))

  def grads(apply):
    return jax.grad(lambda p: jnp.sum(jnp.sin(apply(p).astype(jnp.float32))))(params)

  agree(grads(lambda p: layer.apply(p, x)), grads(lambda p: plain_linen(p, x, x, causal)),
        lambda: grads(lambda p: plain_linen(p, x, x, causal, jnp.float32)),
        atol=1e-4, rtol=1e-4)


def test_linen_matches_flax_mha_and_cross_attention():
  x, mem = inputs((2, 8, FEATURES), 1), inputs((2, 20, FEATURES), 2)
  plain = nn.MultiHeadDotProductAttention(HEADS, dtype=DTYPE)
  params = plain.init(jax.random.key(0), x, mem)
  # MHA parameters are interchangeable with flax's own layer.
  agree(jfl.MultiHeadAttention(HEADS, dtype=DTYPE).apply(params, x, mem),
        plain.apply(params, x, mem),
        lambda: nn.MultiHeadDotProductAttention(HEADS, dtype=jnp.float32).apply(params, x, mem))
  layer = jfl.MultiHeadAttention(HEADS, num_kv_heads=1, dtype=DTYPE)
  p = layer.init(jax.random.key(1), x, mem)
  agree(layer.apply(p, x, mem), plain_linen(p, x, mem, causal=False),
        lambda: plain_linen(p, x, mem, causal=False, dtype=jnp.float32))


# The attention_fn drop-in


def test_drop_in_nnx():
  def layer(dtype, **kw):
    return nnx.MultiHeadAttention(HEADS, FEATURES, num_kv_heads=2, decode=False, dtype=dtype,
                                  rngs=nnx.Rngs(0), **kw)

  flash_fn = layer(DTYPE, attention_fn=jf.dot_product_attention)
  plain = layer(DTYPE)
  x = inputs((2, 16, FEATURES))
  for causal in (False, True):
    agree(flash_fn(x, is_causal=causal), plain(x, is_causal=causal),
          lambda: layer(jnp.float32)(x, is_causal=causal))
  # Dropout configured but switched off is fine.
  flash_fn.dropout_rate = 0.5
  agree(flash_fn(x, deterministic=True), plain(x), lambda: layer(jnp.float32)(x))


def test_drop_in_linen():
  x = inputs((2, 16, FEATURES))
  flash_fn = nn.MultiHeadDotProductAttention(
      HEADS, attention_fn=jf.dot_product_attention, dtype=DTYPE)
  plain = nn.MultiHeadDotProductAttention(HEADS, dtype=DTYPE)
  reference = nn.MultiHeadDotProductAttention(HEADS, dtype=jnp.float32)
  params = plain.init(jax.random.key(0), x)
  agree(flash_fn.apply(params, x), plain.apply(params, x), lambda: reference.apply(params, x))

  def query_grad(layer):
    loss = lambda p: jnp.sum(layer.apply(p, x).astype(jnp.float32) ** 2)  # noqa: E731
    return jax.grad(loss)(params)["params"]["query"]["kernel"]

  agree(query_grad(flash_fn), query_grad(plain), lambda: query_grad(reference),
        atol=1e-4, rtol=1e-4)


def test_drop_in_errors():
  x = inputs((2, 16, HEADS, 8))
  with pytest.raises(ValueError, match=r"key must be \[\.\.\., T\|S, H\|K, D\] \(rank >= 3\)"):
    jf.dot_product_attention(x, x[0, 0], x)
  with pytest.raises(ValueError, match="bias is not supported"):
    jf.dot_product_attention(x, x, x, bias=jnp.zeros((2, HEADS, 16, 16)))
  with pytest.raises(ValueError, match="mask is not supported.*is_causal=True"):
    jf.dot_product_attention(x, x, x, mask=jnp.ones((2, HEADS, 16, 16), bool))
  with pytest.raises(ValueError, match="dropout_rate=0.1 with deterministic=False needs "
                     "dropout_rng"):
    jf.dot_product_attention(x, x, x, dropout_rate=0.1)
  x16 = x.astype(DTYPE)
  agree(jf.dot_product_attention(x16, x16, x16, dropout_rate=0.1, deterministic=True),
        jax.nn.dot_product_attention(x16, x16, x16), lambda: jax.nn.dot_product_attention(x, x, x))

  # Through the layers: a Linen mask, nnx dropout, sown weights.
  y = inputs((2, 16, FEATURES))
  linen = nn.MultiHeadDotProductAttention(
      HEADS, attention_fn=jf.dot_product_attention, dtype=DTYPE)
  params = linen.init(jax.random.key(0), y)
  with pytest.raises(ValueError, match="mask is not supported"):
    linen.apply(params, y, mask=nn.make_causal_mask(y[..., 0]))
  layer = nnx.MultiHeadAttention(
      HEADS, FEATURES, attention_fn=jf.dot_product_attention, dropout_rate=0.1,
      decode=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="sow_weights"):
    layer(y, deterministic=True, sow_weights=True)


def test_import_jax_flash2_does_not_import_flax(tmp_path):
  code = "import sys, jax_flash2; assert 'flax' not in sys.modules, 'flax imported'"
  # cwd outside the source tree: `python -c` puts the cwd first on sys.path.
  subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_nnx_and_linen_window_and_softcap(softcap):
  """The local-window and softcap options reach the kernel: both modules equal
  their own projections fed to the reference with the same options."""
  x = jax.random.normal(jax.random.key(3), (2, 24, 32), jnp.float32)
  opts = dict(causal=True, window_size=(5, -1), softcap=softcap)

  def nnx_layer(dtype):
    return jf.MultiHeadAttention(4, 32, num_kv_heads=2, dtype=dtype, rngs=nnx.Rngs(0), **opts)

  def through_reference(layer, attention):
    return layer.out(attention(layer.query(x), layer.key(x), layer.value(x)))

  layer = nnx_layer(DTYPE)
  try:
    out = layer(x)
  except NotImplementedError:
    if ON_GPU and softcap:  # a valid request the CUDA kernels do not serve yet
      pytest.skip("softcap: the CUDA kernels raise NotImplementedError")
    raise
  if DTYPE == jnp.float32:
    want = through_reference(
        layer, lambda q, k, v: jax_flash2.reference.attention(q, k, v, **opts))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-5)
  else:
    with jax.default_matmul_precision("highest"):
      expected = through_reference(
          nnx_layer(jnp.float32), lambda q, k, v: jax_flash2.reference.attention(q, k, v, **opts))
    plain = through_reference(layer, lambda q, k, v: naive_same_dtype(q, k, v, **opts)[0])
    assert_close_to_oracle("out", out, expected, plain, DTYPE)

  module = jfl.MultiHeadAttention(num_heads=4, num_kv_heads=2, dtype=DTYPE, **opts)
  params = module.init(jax.random.key(1), x)
  plain = jfl.MultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, dtype=DTYPE)
  assert not np.allclose(np.asarray(module.apply(params, x), np.float32),
                         np.asarray(plain.apply(params, x), np.float32), atol=1e-3)


def test_drop_in_dropout():
  """Active dropout runs in the kernels with Flax's dropout rng: the drop-in
  equals flash_attention with that key, and the layers drop weights."""
  x = inputs((2, 3, 16, HEADS, 8)).astype(DTYPE)  # two batch axes, merged into B
  key = jax.random.key(4)
  got = jf.dot_product_attention(x, x, x, dropout_rate=0.3, dropout_rng=key)
  merged = x.reshape((6, 16, HEADS, 8))
  want = jax_flash2.flash_attention(merged, merged, merged, dropout_rate=0.3, dropout_rng=key)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want).reshape(x.shape))
  plain = jf.dot_product_attention(x, x, x, dropout_rate=0.3, deterministic=True)
  assert not np.allclose(np.asarray(got), np.asarray(plain), atol=1e-3)

  y = inputs((2, 16, FEATURES))
  layer = nnx.MultiHeadAttention(
      HEADS, FEATURES, attention_fn=jf.dot_product_attention, dropout_rate=0.3,
      decode=False, dtype=DTYPE, rngs=nnx.Rngs(0))
  dropped = layer(y, deterministic=False, rngs=nnx.Rngs(dropout=1))
  again = layer(y, deterministic=False, rngs=nnx.Rngs(dropout=1))
  np.testing.assert_array_equal(np.asarray(dropped), np.asarray(again))
  assert not np.allclose(np.asarray(dropped), np.asarray(layer(y, deterministic=True)), atol=1e-3)

  linen = nn.MultiHeadDotProductAttention(HEADS, attention_fn=jf.dot_product_attention,
                                          dropout_rate=0.3, deterministic=False, dtype=DTYPE)
  params = linen.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, y)
  grads = jax.grad(lambda p: jnp.sum(linen.apply(p, y, rngs={"dropout": key}) ** 2))(params)
  assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))


def test_modules_dropout():
  """dropout_rate on the flash modules: the nnx module equals its own
  projections fed to the reference with the key of its dropout stream; both
  modules drop only when not deterministic and repeat with the same rng."""
  x = jax.random.normal(jax.random.key(3), (2, 24, 32), jnp.float32)
  layer = jf.MultiHeadAttention(4, 32, num_kv_heads=2, causal=True, dropout_rate=0.3,
                                dtype=DTYPE, rngs=nnx.Rngs(0))
  got = layer(x, deterministic=False, rngs=nnx.Rngs(dropout=5))
  q, k, v = layer.query(x), layer.key(x), layer.value(x)
  # The reference on the same (DTYPE) projections; 16-bit kernels round P
  # and O to DTYPE where the reference does not round alike.
  atol = 2e-5 if DTYPE == jnp.float32 else 2e-2
  want = layer.out(jax_flash2.reference.attention(
      q, k, v, causal=True, dropout_rate=0.3, dropout_rng=nnx.Rngs(dropout=5).dropout()))
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=atol)
  plain = layer.out(jax_flash2.reference.attention(q, k, v, causal=True))
  np.testing.assert_allclose(np.asarray(layer(x, deterministic=True), np.float32),
                             np.asarray(plain, np.float32), atol=atol)
  assert not np.allclose(np.asarray(got), np.asarray(plain), atol=1e-3)
  with pytest.raises(ValueError, match="needs deterministic"):
    layer(x)
  with pytest.raises(ValueError, match="needs rngs"):
    layer(x, deterministic=False)

  module = jfl.MultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, dropout_rate=0.3,
                                  dtype=DTYPE)
  params = module.init(jax.random.key(1), x, deterministic=True)
  run = lambda key: module.apply(params, x, deterministic=False, rngs={"dropout": key})  # noqa: E731
  np.testing.assert_array_equal(np.asarray(run(jax.random.key(2))),
                                np.asarray(run(jax.random.key(2))))
  still = module.apply(params, x, deterministic=True)
  no_dropout = jfl.MultiHeadAttention(num_heads=4, num_kv_heads=2, causal=True, dtype=DTYPE)
  np.testing.assert_array_equal(np.asarray(still), np.asarray(no_dropout.apply(params, x)))
  assert not np.allclose(np.asarray(run(jax.random.key(2))), np.asarray(still), atol=1e-3)


@pytest.mark.parametrize("seqlens", [(5, 9), (9, 5), (7, 7), (1, 6), (6, 1)])
def test_drop_in_is_causal_is_top_left(seqlens):
  """Flax's is_causal is jnp.tril(ones(T, S)), query i sees keys j <= i, also
  when T != S: the drop-in gives Flax's outputs and gradients there."""
  seqlen_q, seqlen_k = seqlens
  rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
  q = jnp.asarray(rng.standard_normal((2, seqlen_q, HEADS, 8)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((2, seqlen_k, HEADS, 8)), jnp.float32) for _ in "kv")

  def run(fn, dtype):
    f = lambda q, k, v: fn(q.astype(dtype), k.astype(dtype), v.astype(dtype),  # noqa: E731
                           is_causal=True).astype(jnp.float32)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(jnp.cos(out))

  agree(run(jf.dot_product_attention, DTYPE), run(nnx.dot_product_attention, DTYPE),
        lambda: run(nnx.dot_product_attention, jnp.float32), atol=1e-5, rtol=1e-5)


def test_deterministic_backward_reaches_the_kernel():
  """Flax's `deterministic` means no dropout; the kernels' bit-identical
  backward is asked for by deterministic_backward, in the modules and the
  drop-in, and reaches the backward's config."""
  x = inputs((2, 16, FEATURES))

  def configs(f, *args):
    return set(re.findall(r"deterministic=(True|False)", str(jax.make_jaxpr(f)(*args))))

  for flag in (False, True):
    layer = jf.MultiHeadAttention(HEADS, FEATURES, deterministic_backward=flag, rngs=nnx.Rngs(0))
    grad = lambda x: jax.grad(lambda x: jnp.sum(layer(x, deterministic=True)))(x)  # noqa: E731
    assert configs(grad, x) == {str(flag)}
    linen = jfl.MultiHeadAttention(HEADS, deterministic_backward=flag)
    params = linen.init(jax.random.key(0), x)
    assert configs(jax.grad(lambda p: jnp.sum(linen.apply(p, x))), params) == {str(flag)}
    y = inputs((2, 16, HEADS, 8))
    drop_in = functools.partial(jf.dot_product_attention, deterministic_backward=flag)
    assert configs(jax.grad(lambda y: jnp.sum(drop_in(y, y, y))), y) == {str(flag)}


# Packed documents: segment ids


def packed_ids(batch_shape, seqlen, seed=0):
  """[*batch_shape, seqlen] int32 ids of documents of mixed lengths (some of
  1 token), non-decreasing along each row, different per row."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(int(np.prod(batch_shape))):
    cuts = np.sort(rng.choice(np.arange(1, seqlen), size=4, replace=False))
    rows.append(np.searchsorted(cuts, np.arange(seqlen), side="right"))
  return jnp.asarray(np.reshape(rows, batch_shape + (seqlen,)), jnp.int32)


def segment_mask(q_ids, kv_ids, causal):
  mask = nnx.make_attention_mask(q_ids, kv_ids, jnp.equal)
  return nnx.combine_masks(mask, nnx.make_causal_mask(q_ids)) if causal else mask


@pytest.mark.parametrize("causal", [False, True])
def test_nnx_segment_ids_match_flax_mask(causal):
  """A packed batch through segment_ids equals Flax's layer with the
  document mask (and the causal mask), outputs and parameter gradients."""
  flash, plain, reference = flash_and_plain(2, causal)
  x = inputs((2, 24, FEATURES))
  ids = packed_ids((2,), 24)
  mask = segment_mask(ids, ids, causal)
  agree(flash(x, segment_ids=ids), plain(x, mask=mask), lambda: reference()(x, mask=mask))
  # The ids change the result (the documents are really separated).
  assert not np.allclose(np.asarray(flash(x, segment_ids=ids), np.float32),
                         np.asarray(flash(x), np.float32), atol=1e-3)
  # The length bound is a speed hint: a true one (these rows' documents are
  # at most 21 tokens) and a wrong one leave the results as they are.
  for bound in (21, 2):
    agree(flash(x, segment_ids=ids, max_segment_length=bound), plain(x, mask=mask),
          lambda: reference()(x, mask=mask))

  def grads(model, **call):
    return nnx.state(param_grads(
        model, lambda m: jnp.sum(jnp.sin(m(x, **call).astype(jnp.float32)))))

  agree(grads(flash, segment_ids=ids), grads(plain, mask=mask),
        lambda: grads(reference(), mask=mask), atol=1e-4, rtol=1e-4)


def test_nnx_segment_ids_cross_attention_and_batch_axes():
  """A pair of ids for cross-attention (T != S), and two batch axes."""
  kw = dict(in_kv_features=16)
  flash, plain, reference = flash_and_plain(1, causal=False, **kw)
  x, mem = inputs((2, 3, 8, FEATURES), 1), inputs((2, 3, 20, 16), 2)
  q_ids, kv_ids = packed_ids((2, 3), 8, 1), packed_ids((2, 3), 20, 2)
  mask = segment_mask(q_ids, kv_ids, False)
  agree(flash(x, mem, segment_ids=(q_ids, kv_ids)), plain(x, mem, mask=mask),
        lambda: reference()(x, mem, mask=mask))
  with pytest.raises(ValueError, match="one array serves self-attention"):
    flash(x, mem, segment_ids=q_ids)
  with pytest.raises(ValueError, match="kv_segment_ids must have the batch axes"):
    flash(x, mem, segment_ids=(q_ids, kv_ids[:1]))


@pytest.mark.parametrize("causal", [False, True])
def test_linen_segment_ids_match_flax_mask(causal):
  x = inputs((2, 24, FEATURES))
  ids = packed_ids((2,), 24, 3)
  mask = segment_mask(ids, ids, causal)
  layer = jfl.MultiHeadAttention(HEADS, causal=causal, dtype=DTYPE)
  plain = nn.MultiHeadDotProductAttention(HEADS, dtype=DTYPE)
  reference = nn.MultiHeadDotProductAttention(HEADS, dtype=jnp.float32)
  params = plain.init(jax.random.key(0), x)
  agree(layer.apply(params, x, segment_ids=ids), plain.apply(params, x, mask=mask),
        lambda: reference.apply(params, x, mask=mask))

  def grads(apply):
    return jax.grad(lambda p: jnp.sum(jnp.sin(apply(p).astype(jnp.float32))))(params)

  agree(grads(lambda p: layer.apply(p, x, segment_ids=ids)),
        grads(lambda p: plain.apply(p, x, mask=mask)),
        lambda: grads(lambda p: reference.apply(p, x, mask=mask)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("seqlens", [(16, 16), (9, 16), (16, 9)])
def test_drop_in_segment_ids(seqlens):
  """The drop-in's segment_ids keyword, with Flax's top-left is_causal also
  when T != S, against jax.nn.dot_product_attention with the combined mask."""
  seqlen_q, seqlen_k = seqlens
  q = inputs((2, seqlen_q, HEADS, 8), 1)
  k, v = inputs((2, seqlen_k, 2, 8), 2), inputs((2, seqlen_k, 2, 8), 3)
  q_ids, kv_ids = packed_ids((2,), seqlen_q, 4), packed_ids((2,), seqlen_k, 5)
  mask = (nnx.make_attention_mask(q_ids, kv_ids, jnp.equal, dtype=bool)
          & jnp.tril(jnp.ones((seqlen_q, seqlen_k), bool)))

  def run(fn, dtype, **kw):
    f = lambda q, k, v: fn(q.astype(dtype), k.astype(dtype), v.astype(dtype),  # noqa: E731
                           **kw).astype(jnp.float32)
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(jnp.cos(out))

  def plain(dtype):
    # Rows that see no key: jax.nn gives the mean of v, the kernels 0 (and
    # LSE -inf); compare on the rows that see one.
    def fn(q, k, v):
      seen = mask.any(-1)[:, 0, :, None, None]  # [B, T, 1, 1]
      return jax.nn.dot_product_attention(q, k, v, mask=mask) * seen
    return run(fn, dtype)

  ours = run(jf.dot_product_attention, DTYPE, is_causal=True, segment_ids=(q_ids, kv_ids))
  agree(ours, plain(DTYPE), lambda: plain(jnp.float32), atol=1e-5, rtol=1e-5)
