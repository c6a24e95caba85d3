"""One jitted forward (or forward+backward) of a packed_bench case, as packed
rows with segment ids, through flash_attention_varlen on the same tokens, or
as a batch of equal documents, with the profiler on for the last call only,
so that ncu lists that call's kernels (XLA's included):

  ncu --profile-from-start off --metrics gpu__time_duration.sum \\
      python3 benchmarks/packed_profile.py packed --case 64x256 --head-dim 64 --backward
"""

from __future__ import annotations

import argparse
import ctypes

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2
from packed_bench import CASES, ROW, cu_seqlens, fwd_bwd, segment_ids


def profiler(start: bool) -> None:
  """cuProfilerStart / cuProfilerStop on device 0's primary context, which
  jax's calls run in."""
  cuda = ctypes.CDLL("libcuda.so.1")
  ctx = ctypes.c_void_p()
  status = (cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) or cuda.cuCtxSetCurrent(ctx) or
            (cuda.cuProfilerStart() if start else cuda.cuProfilerStop()))
  if status != 0:
    raise RuntimeError(f"CUDA driver call failed with status {status}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("layout", choices=["packed", "varlen", "batch"])
  parser.add_argument("--case", choices=sorted(CASES), default="64x256",
                      help="packed_bench's documents (batch: uniform cases only)")
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--backward", action="store_true")
  args = parser.parse_args()
  rows = CASES[args.case](np.random.default_rng(0))  # packed_bench's documents
  lengths = {n for row in rows for n in row}
  longest = max(lengths)
  if args.layout == "batch":
    if len(lengths) != 1:
      parser.error("batch: a case of equal documents (8x2048, 64x256)")
    shape = (sum(len(row) for row in rows), longest)
  elif args.layout == "varlen":
    shape = (len(rows) * ROW,)
  else:
    shape = (len(rows), ROW)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal(shape + (args.heads, args.head_dim)), jnp.bfloat16)
             for _ in range(3))
  ids, cu = segment_ids(rows), cu_seqlens(rows)

  def attend(q, k, v, ids, cu):
    if args.layout == "batch":
      return jax_flash2.flash_attention(q, k, v, causal=True)
    if args.layout == "varlen":
      return jax_flash2.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)
    return jax_flash2.flash_attention(q, k, v, causal=True, segment_ids=(ids, ids),
                                      max_segment_length=longest)

  fn = jax.jit(fwd_bwd(attend) if args.backward else attend)
  for _ in range(3):
    jax.block_until_ready(fn(q, k, v, ids, cu))
  profiler(True)
  jax.block_until_ready(fn(q, k, v, ids, cu))
  profiler(False)


if __name__ == "__main__":
  main()
