"""One jitted forward (or forward+backward) of packed documents, or of the
same documents as a batch, with the profiler on for the last call only, so
that ncu lists that call's kernels (XLA's included):

  ncu --profile-from-start off --metrics gpu__time_duration.sum \\
      python3 benchmarks/packed_profile.py packed --docs 64 --head-dim 64 --backward
"""

from __future__ import annotations

import argparse
import ctypes

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2
from packed_bench import ROW, fwd_bwd, segment_ids


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
  parser.add_argument("layout", choices=["packed", "batch"])
  parser.add_argument("--docs", type=int, default=64, help="documents in the row of 16k")
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--backward", action="store_true")
  args = parser.parse_args()
  n = ROW // args.docs
  rng = np.random.default_rng(0)
  shape = (1, ROW) if args.layout == "packed" else (args.docs, n)
  q, k, v = (jnp.asarray(rng.standard_normal(shape + (args.heads, args.head_dim)), jnp.bfloat16)
             for _ in range(3))
  ids = segment_ids([[n] * args.docs])

  def attend(q, k, v):
    if args.layout == "batch":
      return jax_flash2.flash_attention(q, k, v, causal=True)
    return jax_flash2.flash_attention(q, k, v, causal=True, segment_ids=(ids, ids),
                                      max_segment_length=n)

  fn = jax.jit(fwd_bwd(attend) if args.backward else attend)
  for _ in range(3):
    jax.block_until_ready(fn(q, k, v))
  profiler(True)
  jax.block_until_ready(fn(q, k, v))
  profiler(False)


if __name__ == "__main__":
  main()
