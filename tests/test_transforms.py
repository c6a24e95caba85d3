"""flash_attention under JAX transformations, edge cases, and argument errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash2
from conftest import attention_fn, random_inputs, supports

# float32 where the backend serves it (CPU), else bfloat16.
def _dtype(backend):
  return jnp.float32 if supports(backend, jnp.float32) else jnp.bfloat16


def _tol(dtype):
  return 2e-5 if dtype == jnp.float32 else 2e-2


def test_jit_matches_eager(backend, rng):
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 2, 33, 47, 4, 2, 32, dtype)
  f = attention_fn(backend)
  eager = f(q, k, v, causal=True)
  jitted = jax.jit(lambda q, k, v: f(q, k, v, causal=True))(q, k, v)
  np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(jitted, np.float32))


@pytest.mark.parametrize("extra_axes", [1, 2])
def test_vmap_folds_into_batch(backend, rng, extra_axes):
  dtype = _dtype(backend)
  lead = (3, 2)[:extra_axes]
  q, k, v = (x.reshape(lead + (2,) + x.shape[1:]) for x in
             random_inputs(rng, int(np.prod(lead)) * 2, 21, 30, 4, 1, 16, dtype))
  f = lambda q, k, v: attention_fn(backend)(q, k, v, causal=True, return_lse=True)
  mapped = f
  for _ in range(extra_axes):
    mapped = jax.vmap(mapped)
  out, lse = jax.jit(mapped)(q, k, v)
  flat = [x.reshape((-1,) + x.shape[extra_axes + 1:]) for x in (q, k, v)]
  want_out, want_lse = f(*flat)
  np.testing.assert_allclose(np.asarray(out, np.float32).reshape(want_out.shape),
                             np.asarray(want_out, np.float32), atol=_tol(dtype))
  np.testing.assert_allclose(np.asarray(lse).reshape(want_lse.shape), np.asarray(want_lse),
                             atol=_tol(dtype))


def test_vmap_with_unbatched_kv_and_in_axes(backend, rng):
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 1, 9, 12, 2, 2, 8, dtype)
  qs = jnp.stack([q[0], 2 * q[0], -q[0]], axis=1)  # [T, 3, H, D], mapped along axis 1
  f = attention_fn(backend)
  out = jax.vmap(lambda qi: f(qi[None], k, v)[0], in_axes=1, out_axes=0)(qs)
  for i, scale in enumerate((1, 2, -1)):
    want = f(q * scale, k, v)[0]
    np.testing.assert_allclose(np.asarray(out[i], np.float32), np.asarray(want, np.float32),
                               atol=_tol(dtype))


def test_vmap_of_grad(backend, rng):
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 4, 13, 13, 2, 1, 16, dtype)
  loss = lambda q, k, v: jnp.sum(attention_fn(backend)(q[None], k[None], v[None], causal=True)
                                 .astype(jnp.float32) ** 2)
  grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
  for i in range(4):
    want = jax.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i])
    for g, w in zip(grads, want):
      np.testing.assert_allclose(np.asarray(g[i], np.float32), np.asarray(w, np.float32),
                                 atol=5 * _tol(dtype), rtol=_tol(dtype))


def test_grad_of_jit_and_checkpoint(backend, rng):
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 2, 40, 40, 4, 2, 32, dtype)
  f = attention_fn(backend)
  loss = lambda q, k, v: jnp.sum(jnp.tanh(f(q, k, v, causal=True).astype(jnp.float32)))
  plain = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
  of_jit = jax.grad(jax.jit(loss), argnums=(0, 1, 2))(q, k, v)
  remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
  for a, b, c in zip(plain, of_jit, remat):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=_tol(dtype))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(c, np.float32), atol=_tol(dtype))


def test_residuals_hold_nothing_quadratic(rng):
  """The custom_vjp saves q, k, v, out and lse only: no [.., T, S] array."""
  q, k, v = random_inputs(rng, 1, 256, 384, 2, 2, 8, _dtype("kernel"))
  f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True)
  _, vjp_fn = jax.vjp(f, q, k, v)
  leaves = jax.tree_util.tree_leaves(vjp_fn)
  assert leaves, "vjp closure should hold the residuals"
  for leaf in leaves:
    assert not (256 in np.shape(leaf) and 384 in np.shape(leaf)), f"T x S residual {leaf.shape}"


@pytest.mark.skipif(not supports("kernel", jnp.float32), reason="needs float32 kernels (CPU)")
def test_check_grads_reverse_mode(rng):
  q, k, v = random_inputs(rng, 1, 7, 9, 2, 1, 8, jnp.float32)
  f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True)
  check_grads(f, (q, k, v), order=1, modes=["rev"], atol=5e-2, rtol=5e-2, eps=1e-2)
  g = lambda q, k, v: jax_flash2.flash_attention(q, k, v, return_lse=True)[1]
  check_grads(g, (q, k, v), order=1, modes=["rev"], atol=5e-2, rtol=5e-2, eps=1e-2)


def test_rows_that_see_no_key(backend, rng):
  """Causal with T > S: the first T - S queries see nothing: out 0, LSE -inf, grads finite."""
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 1, 20, 5, 2, 1, 16, dtype)
  f = attention_fn(backend)
  out, lse = f(q, k, v, causal=True, return_lse=True)
  assert np.all(np.asarray(out[:, :15], np.float32) == 0)
  assert np.all(np.isneginf(np.asarray(lse[:, :, :15])))
  assert np.all(np.isfinite(np.asarray(lse[:, :, 15:])))
  grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v, causal=True).astype(jnp.float32)),
                   argnums=(0, 1, 2))(q, k, v)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g, np.float32)))
  assert np.all(np.asarray(grads[0][:, :15], np.float32) == 0)


def test_large_magnitude_inputs_stay_finite(backend, rng):
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 1, 70, 70, 2, 2, 64, dtype)
  out = attention_fn(backend)(q * 30, k * 30, v, causal=True)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_kernel_info_names_cpu_isa():
  info = jax_flash2.kernel_info()
  assert info["cpu"].startswith("cpu-flash2 (")
  assert any(isa in info["cpu"] for isa in ("avx512", "avx2", "baseline"))


# --- argument errors, raised at trace time -------------------------------------------------


def _arrays(q=(1, 8, 2, 16), k=(1, 8, 2, 16), v=None, dtype=jnp.float32):
  v = k if v is None else v
  return (jnp.ones(q, dtype), jnp.ones(k, dtype), jnp.ones(v, dtype))


@pytest.mark.parametrize("arrays,kwargs,error,match", [
    (_arrays(q=(8, 2, 16)), {}, ValueError, "q.shape must be rank 4"),
    (_arrays(q=(2, 8, 2, 16)), {}, ValueError, "batch sizes"),
    (_arrays(q=(1, 8, 3, 16)), {}, ValueError, "H % K == 0"),
    (_arrays(q=(1, 8, 2, 32)), {}, ValueError, "head dims"),
    (_arrays(q=(1, 8, 2, 264), k=(1, 8, 2, 264)), {}, ValueError, "multiple of 8 in"),
    (_arrays(q=(1, 8, 2, 12), k=(1, 8, 2, 12)), {}, ValueError, "multiple of 8 in"),
    (_arrays(k=(1, 8, 2, 16), v=(1, 9, 2, 16)), {}, ValueError, "k.shape and v.shape"),
    (_arrays(dtype=jnp.int32), {}, TypeError, "q.dtype must be one of"),
    ((jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16), jnp.bfloat16), jnp.ones((1, 8, 2, 16))),
     {}, TypeError, "share one dtype"),
    (_arrays(), {"softmax_scale": 0.0}, ValueError, "softmax_scale must be finite and > 0"),
    (_arrays(), {"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
    (_arrays(), {"softmax_scale": float("inf")}, ValueError, "softmax_scale"),
    (_arrays(), {"softmax_scale": "big"}, TypeError, "softmax_scale must be a number"),
    (_arrays(), {"causal": "yes"}, TypeError, "causal must be a bool"),
    (_arrays(), {"window_size": (-2, 0)}, ValueError, "window_size left"),
    (_arrays(), {"window_size": 3}, ValueError, "window_size must be a pair"),
    (_arrays(), {"implementation": "triton"}, ValueError, "implementation must be one of"),
    (_arrays(), {"softcap": -1.0}, ValueError, "softcap must be finite and >= 0"),
    (_arrays(), {"softcap": float("inf")}, ValueError, "softcap must be finite"),
])
def test_bad_arguments(arrays, kwargs, error, match):
  with pytest.raises(error, match=match):
    jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v, **kwargs)).lower(*arrays)


def test_traced_softmax_scale_is_rejected():
  q, k, v = _arrays()
  with pytest.raises(TypeError, match="static Python number"):
    jax.jit(lambda q, k, v, s: jax_flash2.flash_attention(q, k, v, softmax_scale=s))(q, k, v, 0.5)
