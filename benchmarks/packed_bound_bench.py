"""The packed forward with and without max_segment_length, beside the same
documents as a batch: 64 documents of 256 tokens in one row of 16k, bf16,
H 16, causal. Microseconds per forward (the median over rounds; each
sample 5 jitted calls of 20 chained forwards, the three variants
alternated round by round).

  python3 benchmarks/packed_bound_bench.py [--head-dims 64 128] [--rounds 7]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2

ROW, DOC, HEADS, STEPS, CALLS = 16384, 256, 16, 20, 5


def chained(fn):
  def run(q):
    for _ in range(STEPS):
      q = fn(q)
    return q
  return jax.jit(run)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--rounds", type=int, default=7)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  ids = jnp.asarray(np.arange(ROW) // DOC, jnp.int32)[None]
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; us per forward")
  print("| D | packed, max_segment_length=256 | packed, no bound | batch |")
  print("|---|---|---|---|")
  for d in args.head_dims:
    q = jnp.asarray(rng.standard_normal((1, ROW, HEADS, d)), jnp.bfloat16)
    variants = [
        (lambda q: jax_flash2.flash_attention(q, q, q, causal=True, segment_ids=(ids, ids),
                                              max_segment_length=DOC), q),
        (lambda q: jax_flash2.flash_attention(q, q, q, causal=True, segment_ids=(ids, ids)), q),
        (lambda q: jax_flash2.flash_attention(q, q, q, causal=True),
         q.reshape(ROW // DOC, DOC, HEADS, d)),
    ]
    calls = [(chained(fn), x) for fn, x in variants]
    for f, x in calls:
      jax.block_until_ready(f(x))
    samples = [[] for _ in calls]
    for _ in range(args.rounds):
      for (f, x), times in zip(calls, samples):
        jax.block_until_ready(f(x))
        t0 = time.perf_counter()
        for _ in range(CALLS):
          out = f(x)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / (CALLS * STEPS) * 1e6)
    print(f"| {d} | " + " | ".join(f"{np.median(t):.1f}" for t in samples) + " |")


if __name__ == "__main__":
  main()
