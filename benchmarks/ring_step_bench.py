"""The kernels of one ring-attention step, timed on one GPU, and when the K/V
hop hides under them.

A step of jax_flash2.ring_attention runs, per device, the local queries
against one visiting K/V block: a (T/n x T/n) block pair, fully visible
(off-diagonal) or causal (the diagonal block); the forward with the LSE, the
backward from a given LSE, and the fp32 merge of (out, lse). This times each
at the block shapes a ring step uses (B 1, H 16, K 4 or 16, D 128, bf16,
T/n 8k..128k) and sets them beside the time to move the step's K/V (forward)
or K/V and fp32 dK/dV (backward) over NVLink or InfiniBand:

  python3 benchmarks/ring_step_bench.py [--block 8192 16384 ...] [--kv-heads 4 16]

The transfer columns are a model (bytes / link bandwidth, no latency), the
kernel columns are measured here.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2
from jax_flash2 import context_parallel as cp

LINKS = {"NVLink": 450e9, "IB": 50e9}  # bytes/s per GPU and direction


def timed(fn, *args, reps):
  jax.block_until_ready(fn(*args))  # compile and warm up
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def step_kernels(block, heads, kv_heads, head_dim, dtype, reps):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (1, block, heads, head_dim), dtype)
  k = jax.random.normal(keys[1], (1, block, kv_heads, head_dim), dtype)
  v = jax.random.normal(keys[2], (1, block, kv_heads, head_dim), dtype)
  d_out = jax.random.normal(keys[3], q.shape, dtype)
  cfg = cp.RingConfig("seq", 1, "contiguous", "ring", False, head_dim ** -0.5, -1, -1, 0.0)
  rows = {}
  for name, window in (("full", (-1, -1)), ("diagonal", (-1, 0))):
    fwd = jax.jit(lambda q, k, v, w=window: jax_flash2.flash_attention(
        q, k, v, window_size=w, return_lse=True))
    out, lse = fwd(q, k, v)
    bwd = jax.jit(lambda q, k, v, out, lse, d_out, w=window: cp._block_backward(
        cfg, q, k, v, out, lse, d_out, jnp.zeros_like(lse), None, None, w))
    rows[name] = (timed(fwd, q, k, v, reps=reps),
                  timed(bwd, q, k, v, out, lse, d_out, reps=reps))
  acc = jnp.zeros(q.shape, jnp.float32)
  acc_lse = jnp.zeros(lse.shape, jnp.float32)
  merge = jax.jit(cp._merge)
  rows["merge"] = timed(merge, acc, acc_lse, out, lse, reps=reps)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--block", type=int, nargs="+",
                 default=[8192, 16384, 32768, 65536, 131072], help="T/n")
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--kv-heads", type=int, nargs="+", default=[4, 16])
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--reps", type=int, default=5)
  args = p.parse_args(argv)
  dtype = jnp.bfloat16
  print(f"device: {jax.devices()[0].device_kind}; B 1, H {args.heads}, D {args.head_dim}, bf16")
  print("times in ms (median of %d); TFLOP/s of the full block (4 T/n^2 H D forward, 2.5x "
        "backward); hop = step bytes / link bandwidth (model)" % args.reps)
  head = (f"{'K':>3} {'T/n':>7} | {'fwd full':>9} {'TF/s':>5} {'fwd diag':>9} | {'bwd full':>9} "
          f"{'TF/s':>5} {'bwd diag':>9} | {'merge':>7} | {'KV MB':>7} {'hop NVL':>8} "
          f"{'hop IB':>7} | {'bwd MB':>7} {'hop NVL':>8} {'hop IB':>7}")
  print(head)
  print("-" * len(head))
  for kv_heads in args.kv_heads:
    for block in args.block:
      rows = step_kernels(block, args.heads, kv_heads, args.head_dim, dtype, args.reps)
      (fwd_full, bwd_full), (fwd_diag, bwd_diag), merge = (rows["full"], rows["diagonal"],
                                                          rows["merge"])
      flops = 4.0 * block * block * args.heads * args.head_dim
      kv_bytes = 2 * block * kv_heads * args.head_dim * 2  # K and V in bf16
      bwd_bytes = kv_bytes + 2 * block * kv_heads * args.head_dim * 4  # + dK, dV in fp32
      hop = {name: kv_bytes / bw * 1e3 for name, bw in LINKS.items()}
      bwd_hop = {name: bwd_bytes / bw * 1e3 for name, bw in LINKS.items()}
      print(f"{kv_heads:>3} {block:>7} | {fwd_full * 1e3:9.3f} {flops / fwd_full / 1e12:5.0f} "
            f"{fwd_diag * 1e3:9.3f} | {bwd_full * 1e3:9.3f} "
            f"{2.5 * flops / bwd_full / 1e12:5.0f} {bwd_diag * 1e3:9.3f} | {merge * 1e3:7.3f} | "
            f"{kv_bytes / 1e6:7.1f} {hop['NVLink']:8.3f} {hop['IB']:7.3f} | "
            f"{bwd_bytes / 1e6:7.1f} {bwd_hop['NVLink']:8.3f} {bwd_hop['IB']:7.3f}", flush=True)


if __name__ == "__main__":
  main()
