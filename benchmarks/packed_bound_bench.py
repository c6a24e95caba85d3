"""The packed forward with and without max_segment_length, beside the same
documents as a batch: 64 documents of 256 tokens in one row of 16k, bf16,
H 16, causal. Microseconds per forward: packed_bench.time_calls with 20
chained forwards per jitted call, 5 calls per sample, the median of 7
samples taken in rounds (the three variants alternated).

  python3 benchmarks/packed_bound_bench.py [--head-dims 64 128]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2
from packed_bench import time_calls

ROW, DOC, HEADS = 16384, 256, 16


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--warmup-s", type=float, default=0.2)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  ids = jnp.asarray(np.arange(ROW) // DOC, jnp.int32)[None]

  def packed(q, **bound):
    return jax_flash2.flash_attention(q, q, q, causal=True, segment_ids=(ids, ids), **bound)

  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; us per forward")
  print(f"| D | packed, max_segment_length={DOC} | packed, no bound | batch |")
  print("|---|---|---|---|")
  for d in args.head_dims:
    q = jnp.asarray(rng.standard_normal((1, ROW, HEADS, d)), jnp.bfloat16)
    calls = {
        "bound": (lambda q: packed(q, max_segment_length=DOC), (q,)),
        "no bound": (packed, (q,)),
        "batch": (lambda q: jax_flash2.flash_attention(q, q, q, causal=True),
                  (q.reshape(ROW // DOC, DOC, HEADS, d),)),
    }
    errors = []
    seconds = time_calls(calls, args.warmup_s, errors, steps=20, iters=5, reps=7)
    for error in errors:
      print(f"- {error}")
    print(f"| {d} | " + " | ".join("-" if s is None else f"{s * 1e6:.1f}"
                                   for s in seconds.values()) + " |")


if __name__ == "__main__":
  main()
