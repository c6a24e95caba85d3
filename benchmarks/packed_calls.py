"""Microseconds per call of the packed forward and forward+backward (segment
ids, max_segment_length) beside the same documents as a batch: rows of 16k,
H 16, causal, bf16 (packed_bench.time_calls: 5 chained steps, 3 calls a
sample, the median of 7 samples taken in rounds). One line per case, led by
LABEL, so that runs of two builds, alternated, can be set side by side:

  PYTHONPATH=/tmp/old python3 benchmarks/packed_calls.py old
  python3 benchmarks/packed_calls.py new --cases 64x256 --head-dims 64
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2
from packed_bench import CASES, ROW, fwd_bwd, segment_ids, time_calls


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("label")
  uniform = [case for case in CASES if case != "mixed"]
  parser.add_argument("--cases", default=",".join(uniform),
                      help=f"comma-separated, of {uniform} (packed_bench.CASES)")
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--warmup-s", type=float, default=0.2)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  unknown = sorted(set(args.cases.split(",")) - set(uniform))
  if unknown:
    parser.error(f"unknown --cases {unknown}; known: {uniform}")
  for case in args.cases.split(","):
    rows = CASES[case](rng)  # one row of equal documents
    docs, n = len(rows[0]), rows[0][0]
    ids = segment_ids(rows)
    for d in args.head_dims:
      packed_qkv = tuple(jnp.asarray(rng.standard_normal((1, ROW, args.heads, d)), jnp.bfloat16)
                         for _ in range(3))
      batch_qkv = tuple(x.reshape(docs, n, args.heads, d) for x in packed_qkv)

      def packed(q, k, v, ids=ids, n=n):
        return jax_flash2.flash_attention(q, k, v, causal=True, segment_ids=(ids, ids),
                                          max_segment_length=n)

      def batch(q, k, v):
        return jax_flash2.flash_attention(q, k, v, causal=True)

      calls = {"packed fwd": (packed, packed_qkv), "batch fwd": (batch, batch_qkv),
               "packed fwd+bwd": (fwd_bwd(packed), packed_qkv),
               "batch fwd+bwd": (fwd_bwd(batch), batch_qkv)}
      errors = []
      times = time_calls(calls, args.warmup_s, errors, reps=7)
      us = {key: None if t is None else round(t * 1e6, 1) for key, t in times.items()}
      print(args.label, f"{case} D{d}", json.dumps(us), *errors, flush=True)


if __name__ == "__main__":
  main()
