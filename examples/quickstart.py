"""jax_flash2 in one minute: forward and backward on the default device,
checked against the reference and timed beside jax.nn.dot_product_attention.

  pip install . && python examples/quickstart.py
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2


def timed(fn, *args, iters=5):
  jax.block_until_ready(fn(*args))  # compile and warm up
  start = time.perf_counter()
  for _ in range(iters):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / iters


def main():
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.bfloat16 if on_gpu else jnp.float32
  batch, seqlen, heads, kv_heads, head_dim = (4, 4096, 16, 4, 128) if on_gpu else (1, 1024, 8, 2, 64)
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(kq, (batch, seqlen, heads, head_dim), dtype)
  k = jax.random.normal(kk, (batch, seqlen, kv_heads, head_dim), dtype)
  v = jax.random.normal(kv, (batch, seqlen, kv_heads, head_dim), dtype)
  print(f"device: {jax.devices()[0]}, kernels: {jax_flash2.kernel_info()}")
  print(f"q {q.shape}, k/v {k.shape} {jnp.dtype(dtype).name}, causal, GQA {heads // kv_heads}:1")

  def loss(attention, q, k, v):
    return jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2)

  ours = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True)
  reference = lambda q, k, v: jax_flash2.reference.attention(q, k, v, causal=True)
  # jax.nn.dot_product_attention takes GQA directly; causal there is top-left,
  # the same as ours when T == S.
  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)

  fwd = {name: jax.jit(f) for name, f in (("jax_flash2", ours), ("jax.nn", xla))}
  grad = {name: jax.jit(jax.grad(lambda q, k, v, f=f: loss(f, q, k, v), argnums=(0, 1, 2)))
          for name, f in (("jax_flash2", ours), ("jax.nn", xla))}

  out = fwd["jax_flash2"](q, k, v)
  ref = jax.jit(reference)(q, k, v)
  err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
  grads = grad["jax_flash2"](q, k, v)
  ref_grads = jax.jit(jax.grad(lambda q, k, v: loss(reference, q, k, v), argnums=(0, 1, 2)))(q, k, v)
  grad_err = max(
      float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))) /
            (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-6))
      for a, b in zip(grads, ref_grads))
  print(f"forward max |ours - reference| = {err:.2e}; gradients max relative error = {grad_err:.2e}")
  tolerance = 5e-2 if dtype == jnp.bfloat16 else 1e-4
  assert np.isfinite(err) and err < tolerance and grad_err < tolerance, "mismatch with the reference"

  flops = 4 * batch * seqlen * seqlen * heads * head_dim / 2  # causal
  for name in fwd:
    t_fwd = timed(fwd[name], q, k, v)
    t_bwd = timed(grad[name], q, k, v)
    print(f"{name:>11}: forward {t_fwd * 1e3:8.2f} ms ({flops / t_fwd / 1e12:6.2f} TFLOP/s), "
          f"forward+backward {t_bwd * 1e3:8.2f} ms ({3.5 * flops / t_bwd / 1e12:6.2f} TFLOP/s)")
  print("OK")


if __name__ == "__main__":
  main()
