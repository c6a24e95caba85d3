"""jax.export of functions using flash_attention: export, serialize,
deserialize, run again (and differentiate), on CPU and on GPU when present.

The disabled_checks the user must pass are jax_flash2.export.disabled_checks();
the test also pins that they are needed and sufficient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_flash2
import jax_flash2.export
from conftest import MODEL_DTYPE, ON_GPU

# bfloat16 on the GPU (the CUDA kernels take 16-bit inputs), float32 on CPU.
# The restored module runs the same kernels: 16-bit results may differ only by
# a summation order (dq's atomics on CUDA) flipping a last bit.
DTYPE = MODEL_DTYPE
TOL = dict(atol=1e-6, rtol=1e-6) if DTYPE == jnp.float32 else dict(atol=2e-2, rtol=2e-2)


def qkv(batch=2):
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (batch, 24, 4, 32), DTYPE)
  k = jax.random.normal(keys[1], (batch, 40, 2, 32), DTYPE)
  v = jax.random.normal(keys[2], (batch, 40, 2, 32), DTYPE)
  return q, k, v


def attention(q, k, v):
  return jax_flash2.flash_attention(q, k, v, causal=True)


def close(a, b):
  np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **TOL)


def roundtrip(exported, vjp_order=0):
  pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
  return export.deserialize(exported.serialize(vjp_order=vjp_order))


def test_export_needs_the_disabled_checks():
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
    export.export(jax.jit(attention))(*qkv())
  text = export.export(jax.jit(attention), disabled_checks=jax_flash2.export.disabled_checks())(
      *qkv()).mlir_module()
  assert jax_flash2.export.TARGETS[0] in text


def test_export_serialize_run_and_grad():
  q, k, v = qkv()
  exported = export.export(jax.jit(attention),
                           disabled_checks=jax_flash2.export.disabled_checks())(q, k, v)
  restored = roundtrip(exported, vjp_order=1)
  # jax.export names lowering platforms ('cuda'), not backends ('gpu').
  assert restored.platforms == ({"gpu": "cuda"}.get(jax.default_backend(), jax.default_backend()),)
  close(restored.call(q, k, v), attention(q, k, v))

  # The VJP was serialized with it (vjp_order=1).
  def loss(f):
    return lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)

  grads = jax.grad(loss(restored.call), argnums=(0, 1, 2))(q, k, v)
  for got, want in zip(grads, jax.grad(loss(attention), argnums=(0, 1, 2))(q, k, v)):
    close(got, want)


@pytest.mark.skipif(ON_GPU, reason="the CUDA lowering needs static shapes (workspace size)")
def test_export_training_step_and_symbolic_batch():
  # A gradient computation exported as such, with a symbolic batch size.
  def step(q, k, v):
    return jax.grad(lambda q: jnp.sum(attention(q, k, v).astype(jnp.float32)))(q)

  b, = export.symbolic_shape("b")
  q, k, v = qkv()
  specs = [jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype) for x in (q, k, v)]
  restored = roundtrip(export.export(
      jax.jit(step), disabled_checks=jax_flash2.export.disabled_checks())(*specs))
  for batch in (1, 3):
    args = qkv(batch)
    close(restored.call(*args), step(*args))


@pytest.mark.skipif(ON_GPU, reason="the CUDA lowering needs static shapes (workspace size)")
def test_export_forward_ad_with_symbolic_batch():
  # The tangents are plain JAX (no custom call of their own): exported like
  # any function, here with a symbolic batch size.
  def tangents(q, k, v):
    f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True, return_lse=True)
    return jax.jvp(f, (q, k, v), (jnp.sin(q), k, v))[1]

  b, = export.symbolic_shape("b")
  q, k, v = qkv()
  specs = [jax.ShapeDtypeStruct((b,) + x.shape[1:], x.dtype) for x in (q, k, v)]
  restored = roundtrip(export.export(
      jax.jit(tangents), disabled_checks=jax_flash2.export.disabled_checks())(*specs))
  for batch in (1, 3):
    args = qkv(batch)
    for got, want in zip(restored.call(*args), tangents(*args)):
      close(got, want)
