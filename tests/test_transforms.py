"""flash_attention under JAX transformations, edge cases, and argument errors."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_flash2
from jax_flash2 import _ext
from conftest import KERNEL_DTYPE, attention_fn, random_inputs, supports

def _dtype(backend):
  # The compiled kernels' dtype for "kernel" (bfloat16 on the GPU, where
  # float32 runs the blockwise path that test_float32_blockwise covers).
  return KERNEL_DTYPE if backend == "kernel" else jnp.float32


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


@pytest.mark.parametrize("slopes_shape", ["h", "bh"])
def test_vmap_and_grad_with_alibi_and_segments(backend, rng, slopes_shape):
  """vmap over [2, B, ...] with segment ids batched and slopes either shared
  ([H], unbatched) or per example ([2, B, H]): equal to one call on the folded
  batch, forward and gradients (slopes present, grads in q, k, v only)."""
  dtype = _dtype(backend)
  n, b, t, s, h = 2, 2, 37, 45, 4
  q, k, v = (x.reshape((n, b) + x.shape[1:]) for x in
             random_inputs(rng, n * b, t, s, h, 2, 16, dtype))
  q_ids = jnp.asarray(np.sort(rng.integers(0, 3, (n, b, t)), axis=-1), jnp.int32)
  kv_ids = jnp.asarray(np.sort(rng.integers(0, 3, (n, b, s)), axis=-1), jnp.int32)
  shape = (h,) if slopes_shape == "h" else (n, b, h)
  slopes = jnp.asarray(rng.uniform(0.05, 0.5, shape), jnp.float32)

  def loss(q, k, v, slopes, q_ids, kv_ids):
    out, lse = attention_fn(backend)(q, k, v, causal=True, return_lse=True,
                                     alibi_slopes=slopes, segment_ids=(q_ids, kv_ids))
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

  value_and_grad = jax.value_and_grad(loss, argnums=(0, 1, 2))
  in_axes = (0, 0, 0, None if slopes_shape == "h" else 0, 0, 0)
  values, grads = jax.jit(jax.vmap(value_and_grad, in_axes=in_axes))(q, k, v, slopes, q_ids,
                                                                     kv_ids)
  flat = lambda x: x.reshape((n * b,) + x.shape[2:])  # noqa: E731
  flat_slopes = slopes if slopes_shape == "h" else flat(slopes)
  want_value, want_grads = value_and_grad(flat(q), flat(k), flat(v), flat_slopes, flat(q_ids),
                                          flat(kv_ids))
  np.testing.assert_allclose(float(values.sum()), float(want_value), rtol=_tol(dtype))
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(flat(g), np.float32), np.asarray(w, np.float32),
                               atol=5 * _tol(dtype), rtol=_tol(dtype))


def test_alibi_slopes_get_zero_gradient(backend, rng):
  """The slopes are constants: zero cotangent, on every backend alike."""
  q, k, v = random_inputs(rng, 1, 9, 9, 2, 1, 8, _dtype(backend))
  slopes = jnp.asarray([0.1, 0.2], jnp.float32)
  loss = lambda s: jnp.sum(attention_fn(backend)(q, k, v, alibi_slopes=s).astype(jnp.float32))
  assert np.all(np.asarray(jax.grad(loss)(slopes)) == 0)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_unread_inputs_are_placeholders(platform):
  """The optional inputs a call does not read (ALiBi slopes, segment ids,
  dropout seeds, the KV-cache lengths, block table and scales) reach the
  kernels as zero-size constants, so XLA computes nothing for them; the ones
  it reads keep their shapes."""
  if platform == "cuda" and _ext.cuda_ext is None:
    pytest.skip("needs the CUDA extension to lower for CUDA")
  q = jnp.ones((2, 9, 2, 16), jnp.bfloat16)
  slopes = jnp.ones((2,), jnp.float32)

  def operand_types(**kwargs):
    fn = jax.jit(lambda q: jax_flash2.flash_attention(q, q, q, **kwargs))
    ir = fn.trace(q).lower(lowering_platforms=(platform,)).as_text()
    (operands,) = re.findall(r"stablehlo\.custom_call @jax_flash2_\w+\(.*\} : \((.*)\) ->", ir)
    return [t.strip() for t in operands.split(",")][3:]

  # ..., then the KV-cache lengths, block table and scales (read by kvcache calls only).
  unread_kv = ["tensor<0xi32>", "tensor<0xi32>", "tensor<0xf32>"]
  assert operand_types() == ["tensor<0xf32>", "tensor<0xi32>", "tensor<0xi32>",
                             "tensor<0xui32>"] + unread_kv
  assert operand_types(alibi_slopes=slopes) == [
      "tensor<2x2xf32>", "tensor<0xi32>", "tensor<0xi32>", "tensor<0xui32>"] + unread_kv
  if platform == "cpu":  # the compiled module fills no placeholder
    hlo = jax.jit(lambda q: jax_flash2.flash_attention(q, q, q)).lower(q).compile().as_text()
    assert "broadcast" not in hlo, hlo


@pytest.mark.skipif(_ext.cuda_ext is None, reason="needs the CUDA extension to lower for CUDA")
@pytest.mark.parametrize("option", ["alibi_slopes", "segment_ids", "softcap"])
def test_cuda_lowering_passes_score_options(option):
  """The CUDA kernels serve softcap, ALiBi and segment ids: forward and
  backward lower for CUDA with the option's attribute on."""
  q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
  kwargs, attribute = {
      "alibi_slopes": ({"alibi_slopes": jnp.ones((2,), jnp.float32)}, "has_alibi = true"),
      "segment_ids": ({"segment_ids": (jnp.zeros((1, 8), jnp.int32),) * 2},
                      "has_segment_ids = true"),
      "softcap": ({"softcap": 1.0}, "softcap = 1.0"),
  }[option]
  grad = jax.jit(jax.grad(lambda q: jnp.sum(
      jax_flash2.flash_attention(q, q, q, **kwargs).astype(jnp.float32))))
  ir = grad.trace(q).lower(lowering_platforms=("cuda",)).as_text()
  assert ir.count(attribute) == 2  # the forward and the backward call


class _FakeGpu:
  def __init__(self, core_count, compute_capability):
    self.core_count, self.compute_capability = core_count, compute_capability


@pytest.mark.parametrize("devices, plan", [
    ([], (132, 9)),                                            # no GPU: an H100/H200
    ([_FakeGpu(108, "8.0")] * 2, (108, 8)),                    # A100s
    ([_FakeGpu(108, "8.0"), _FakeGpu(132, "9.0")], (132, 9)),  # any 9.x sizes for Hopper
    ([_FakeGpu(148, "10.0")], (148, 10)),
])
def test_workspace_plan_follows_the_local_gpus(monkeypatch, devices, plan):
  from jax_flash2 import _lowering
  monkeypatch.setattr(_lowering.jax, "local_devices", lambda backend=None: devices)
  assert _lowering._gpu_plan() == plan


@pytest.mark.skipif(_ext.cuda_ext is None, reason="needs the CUDA extension's workspace_bytes")
def test_workspace_for_hopper_covers_the_sm80_kernels():
  """The workspace planned for cc 9 is enough for an sm80 GPU of the same SM
  count (what a mixed host or an export relies on), and non-Hopper GPUs do not
  pay for the Hopper kernels' stream-K slots."""
  shapes = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, window_left, window_right
      (1, 4096, 4096, 8, 8, 128, -1, -1), (2, 1000, 3000, 16, 2, 64, -1, 0),
      (4, 1, 32768, 32, 4, 128, -1, -1), (1, 777, 777, 4, 4, 256, 128, 0),
      (3, 2048, 2048, 12, 4, 96, -1, -1), (8, 16, 8192, 8, 8, 40, -1, -1),
  ]
  bytes_for = lambda backward, shape, cc: _ext.cuda_ext.workspace_bytes(
      backward, *shape, 132, False, cc)
  saved = 0
  for backward in (False, True):
    for shape in shapes:
      hopper, ampere = bytes_for(backward, shape, 9), bytes_for(backward, shape, 8)
      assert hopper >= ampere, (backward, shape, hopper, ampere)
      saved = max(saved, hopper - ampere)
  if _ext.cuda_ext.has_sm90():  # the stream-K slots, when the tiles do not fill whole waves
    assert saved > 1 << 20, saved


@pytest.mark.skipif(_ext.cuda_ext is None, reason="needs the CUDA extension to lower for CUDA")
def test_cuda_lowering_passes_dropout():
  """The CUDA lowering hands dropout to the kernels: the rate as an attribute
  of the forward and backward calls, the [B, H, 2] seeds as an operand."""
  q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
  loss = lambda q: jnp.sum(jax_flash2.flash_attention(
      q, q, q, dropout_rate=0.125, dropout_rng=jax.random.key(0)).astype(jnp.float32))
  ir = jax.jit(jax.grad(loss)).trace(q).lower(lowering_platforms=("cuda",)).as_text()
  calls = re.findall(r"stablehlo\.custom_call @(jax_flash2_\w+)\((.*)", ir)
  assert sorted(name for name, _ in calls) == sorted([_ext.FORWARD_TARGET,
                                                      _ext.BACKWARD_TARGET]), calls
  for name, rest in calls:
    assert "dropout_rate = 1.250000e-01 : f32" in rest, (name, rest)
    assert "tensor<1x2x2xui32>" in rest, (name, rest)


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
  """Reverse mode saves q, k, v, out and lse only: no [.., T, S] array."""
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
    (_arrays(q=(1, 8, 2, 264), k=(1, 8, 2, 264)), {}, ValueError, r"must be in \[1, 256\]"),
    (_arrays(q=(1, 8, 2, 0), k=(1, 8, 2, 0)), {}, ValueError, r"must be in \[1, 256\]"),
    (_arrays(k=(1, 8, 2, 16), v=(1, 9, 2, 16)), {}, ValueError, "k.shape and v.shape"),
    (_arrays(dtype=jnp.int32), {}, TypeError, "q.dtype must be one of"),
    ((jnp.ones((1, 8, 2, 16)), jnp.ones((1, 8, 2, 16), jnp.bfloat16), jnp.ones((1, 8, 2, 16))),
     {}, TypeError, "share one dtype"),
    (_arrays(), {"softmax_scale": 0.0}, ValueError, "softmax_scale must be finite and > 0"),
    (_arrays(), {"softmax_scale": float("nan")}, ValueError, "softmax_scale"),
    (_arrays(), {"softmax_scale": float("inf")}, ValueError, "softmax_scale"),
    (_arrays(), {"softmax_scale": "big"}, TypeError, "softmax_scale must be a number"),
    (_arrays(), {"causal": "yes"}, TypeError, "causal must be a bool"),
    (_arrays(), {"deterministic": 1}, TypeError, "deterministic must be a bool"),
    (_arrays(), {"window_size": (-2, 0)}, ValueError, "window_size left"),
    (_arrays(), {"window_size": 3}, ValueError, "window_size must be a pair"),
    (_arrays(), {"implementation": "triton"}, ValueError, "implementation must be one of"),
    (_arrays(), {"softcap": -1.0}, ValueError, "softcap must be finite and >= 0"),
    (_arrays(), {"softcap": float("inf")}, ValueError, "softcap must be finite"),
    (_arrays(), {"alibi_slopes": jnp.ones((3,), jnp.float32)}, ValueError,
     r"alibi_slopes.shape must be \[H\] = \(2,\) or \[B, H\] = \(1, 2\); got \(3,\)"),
    (_arrays(), {"alibi_slopes": jnp.ones((2, 2), jnp.float32)}, ValueError, "alibi_slopes.shape"),
    (_arrays(), {"alibi_slopes": jnp.ones((2,), jnp.float16)}, TypeError,
     "alibi_slopes.dtype must be float32; got float16"),
    (_arrays(), {"alibi_slopes": [0.1, 0.2]}, TypeError, "alibi_slopes must be an array"),
    (_arrays(), {"segment_ids": jnp.zeros((1, 8), jnp.int32)}, ValueError,
     "segment_ids must be a pair"),
    (_arrays(), {"segment_ids": (jnp.zeros((1, 7), jnp.int32), jnp.zeros((1, 8), jnp.int32))},
     ValueError, r"q_segment_ids.shape must be \[B, T\] = \(1, 8\); got \(1, 7\)"),
    (_arrays(k=(1, 5, 2, 16)), {"segment_ids": (jnp.zeros((1, 8), jnp.int32),) * 2},
     ValueError, r"kv_segment_ids.shape must be \[B, S\] = \(1, 5\)"),
    (_arrays(), {"segment_ids": (jnp.zeros((1, 8), jnp.float32), jnp.zeros((1, 8), jnp.int32))},
     TypeError, "q_segment_ids.dtype must be an integer type"),
    (_arrays(), {"segment_ids": (jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), bool))},
     TypeError, "kv_segment_ids.dtype must be an integer type"),
])
def test_bad_arguments(arrays, kwargs, error, match):
  with pytest.raises(error, match=match):
    jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v, **kwargs)).lower(*arrays)


def test_traced_softmax_scale_is_rejected():
  q, k, v = _arrays()
  with pytest.raises(TypeError, match="static Python number"):
    jax.jit(lambda q, k, v, s: jax_flash2.flash_attention(q, k, v, softmax_scale=s))(q, k, v, 0.5)


def test_deterministic_backward_is_bit_identical(rng):
  """Three runs of the backward give the same bits. CPU: many workers' worth
  of tasks (dQ partials summed in a fixed order). CUDA: enough (b, kv head)
  pairs that each CTA walks several key blocks into its dQ slice."""
  if jax.default_backend() == "cpu":
    q, k, v = random_inputs(rng, 1, 300, 700, 4, 1, 32, jnp.float32)
  else:
    q, k, v = random_inputs(rng, 4, 300, 1500, 32, 16, 64, jnp.bfloat16)
  loss = jax.jit(jax.grad(
      lambda q, k, v: jnp.sum(jnp.sin(jax_flash2.flash_attention(
          q, k, v, causal=True, deterministic=True).astype(jnp.float32))),
      argnums=(0, 1, 2)))
  runs = [jax.device_get(loss(q, k, v)) for _ in range(3)]
  for other in runs[1:]:
    for a, b in zip(runs[0], other):
      assert np.array_equal(a, b)


@pytest.mark.skipif(_ext.cuda_ext is None, reason="needs the CUDA extension to lower for CUDA")
def test_cuda_lowering_passes_deterministic_to_the_backward():
  q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)

  def grad_ir(deterministic):
    grad = jax.jit(jax.grad(lambda q: jnp.sum(jax_flash2.flash_attention(
        q, q, q, deterministic=deterministic).astype(jnp.float32))))
    return grad.trace(q).lower(lowering_platforms=("cuda",)).as_text()

  assert "deterministic = true" in grad_ir(True)
  assert "deterministic = false" in grad_ir(False)


def test_traced_softcap_is_rejected():
  q, k, v = _arrays()
  with pytest.raises(TypeError, match="softcap must be a static Python number"):
    jax.jit(lambda q, k, v, c: jax_flash2.flash_attention(q, k, v, softcap=c))(q, k, v, 1.0)
