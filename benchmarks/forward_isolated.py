"""Forward-only timings of jax_flash2 beside cuDNN, in a process of its own
(no torch, nothing else on the GPU): short forwards (0.2-1 ms) are sensitive to
host load, so they are best timed alone. Prints which kernel (sm80 / sm90)
served each call.

  python benchmarks/forward_isolated.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

import jax_flash2
from jax_flash2 import _ext

SHAPES = [(16, 1024, 16, 128), (4, 4096, 16, 128), (16, 1024, 32, 64)]  # B, T, H, D


def median_time(fn, args, iters=20, reps=3):
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / iters)
  return sorted(samples)[len(samples) // 2]


def main():
  print("| shape | causal | implementation | ms | TFLOP/s |")
  print("|---|---|---|---|---|")
  for batch, seqlen, heads, head_dim in SHAPES:
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q, k, v = (jax.random.normal(key, (batch, seqlen, heads, head_dim), jnp.bfloat16)
               for key in keys)
    for causal in (False, True):
      flops = 4 * batch * seqlen * seqlen * heads * head_dim * (0.5 if causal else 1.0)
      impls = {
          "jax_flash2": lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=causal),
          "cudnn": lambda q, k, v: jax.nn.dot_product_attention(
              q, k, v, is_causal=causal, implementation="cudnn"),
      }
      for name, fn in impls.items():
        before = _ext.cuda_ext.forward_call_counts()
        t = median_time(jax.jit(fn), (q, k, v))
        after = _ext.cuda_ext.forward_call_counts()
        path = ""
        if name == "jax_flash2":
          path = " (" + "/".join(p for p in after if after[p] > before[p]) + ")"
        print(f"| B{batch} T{seqlen} H{heads} D{head_dim} | {causal} | {name}{path} | "
              f"{t * 1e3:.3f} | {flops / t / 1e12:.0f} |", flush=True)


if __name__ == "__main__":
  main()
