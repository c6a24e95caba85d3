"""GPU benchmark: jax_flash2 beside cuDNN and XLA (jax.nn.dot_product_attention)
and FlashAttention-2 (torch SDPA, FLASH backend) in one run.

FLOPs: forward 4*B*T*S*H*D, halved for causal; forward+backward 3.5x forward
(the backward counts 2.5x). Decode: achieved bandwidth = bytes of K and V / time.

  python benchmarks/gpu_bench.py --head-dims 64 128 256 --xla-max-seqlen 0 --out grid.md

(the grid goes into benchmarks/results/h200.md, section "Package grid").

Each timing is 3 samples of 10 back-to-back calls after one call; with
--warmup-s X, after X seconds of calls (the clocks settled at the power limit).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp

import jax_flash2
import _report


def warm_up(call, sync, seconds):
  """One call, then `seconds` of back-to-back calls (--warmup-s): the H200 runs
  these kernels at its power limit, and a few short samples after an idle
  moment (compiling the next function) catch the clocks still settling."""
  sync(call())
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    for _ in range(5):
      out = call()
    sync(out)


def time_jax(fn, args, warmup_s, iters=10, reps=3):
  warm_up(lambda: fn(*args), jax.block_until_ready, warmup_s)
  samples = []
  for _ in range(reps):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / iters)
  return statistics.median(samples)


def jax_impls(causal):
  def ours(q, k, v):
    return jax_flash2.flash_attention(q, k, v, causal=causal)

  def cudnn(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

  def xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

  return {"jax_flash2": ours, "cudnn": cudnn, "xla": xla}


def fwd_bwd(fn):
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32))

  return jax.grad(loss, argnums=(0, 1, 2))


def torch_flash_times(batch, seqlen, heads, head_dim, causal, warmup_s, iters=10, reps=3):
  try:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
  except ImportError:
    return None, None
  q, k, v = (torch.randn(batch, heads, seqlen, head_dim, device="cuda", dtype=torch.bfloat16,
                         requires_grad=True) for _ in range(3))
  f = torch.nn.functional.scaled_dot_product_attention

  def run(backward):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
      o = f(q, k, v, is_causal=causal)
      if backward:
        o.sum().backward()

  def timed(backward):
    warm_up(lambda: run(backward), lambda _: torch.cuda.synchronize(), warmup_s)
    samples = []
    for _ in range(reps):
      start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      start.record()
      for _ in range(iters):
        run(backward)
      end.record()
      torch.cuda.synchronize()
      samples.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(samples)

  try:
    return timed(False), timed(True)
  except RuntimeError:
    return None, None


def grid(args):
  rows = []
  for head_dim in args.head_dims:
    heads = 2048 // head_dim
    for causal in (False, True):
      for seqlen in args.seqlens:
        batch = 16384 // seqlen
        key = jax.random.split(jax.random.PRNGKey(seqlen), 3)
        q, k, v = (jax.random.normal(kk, (batch, seqlen, heads, head_dim), jnp.bfloat16) for kk in key)
        flops = 4 * batch * seqlen * seqlen * heads * head_dim * (0.5 if causal else 1.0)
        row = {"D": head_dim, "causal": causal, "T": seqlen, "B": batch}
        for name, fn in jax_impls(causal).items():
          if name == "xla" and seqlen > args.xla_max_seqlen:
            row[name] = None  # materializes B*H*T*T scores: slow, and not the point of comparison
            continue
          try:
            tf = time_jax(jax.jit(fn), (q, k, v), args.warmup_s)
            tb = time_jax(jax.jit(fwd_bwd(fn)), (q, k, v), args.warmup_s)
            row[name] = (flops / tf / 1e12, 3.5 * flops / tb / 1e12)
          except Exception as e:  # noqa: BLE001 - a peer that can't run this shape
            row[name] = None
            print(f"  {name} failed at {row}: {type(e).__name__}: {str(e)[:120]}")
        tf, tb = torch_flash_times(batch, seqlen, heads, head_dim, causal, args.warmup_s)
        row["torch_fa2"] = None if tf is None else (flops / tf / 1e12, 3.5 * flops / tb / 1e12)
        rows.append(row)
        print(row, flush=True)
  return rows


# Decode steps per timed call: one jitted scan over DECODE_STEPS queries, each
# reading all of K and V, so the time per step is the kernels' and not the
# host's dispatch (about 60 us per call on the H200 machine, more than a
# whole step at S = 32k).
DECODE_STEPS = 32


def decode_steps(fn, unroll=1):
  def run(qs, k, v):
    return jax.lax.scan(lambda carry, q: (carry, fn(q, k, v)), 0, qs, unroll=unroll)[1]

  return jax.jit(run)


def decode(args):
  rows = []
  heads, kv_heads, head_dim = 32, 4, 128
  for tq, batch, seqlen_k in itertools.product(args.decode_queries, (1, 8), args.decode_seqlens):
    keys = jax.random.split(jax.random.PRNGKey(batch * seqlen_k + tq), 3)
    qs = jax.random.normal(keys[0], (DECODE_STEPS, batch, tq, heads, head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, seqlen_k, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, seqlen_k, kv_heads, head_dim), jnp.bfloat16)
    kv_bytes = 2 * k.size * 2
    row = {"T": tq, "B": batch, "S": seqlen_k}
    for name, fn in jax_impls(False).items():
      if name == "xla" and seqlen_k > 32768:
        continue
      try:
        t = time_jax(decode_steps(fn, args.decode_unroll), (qs, k, v), args.warmup_s,
                     iters=3) / DECODE_STEPS
        row[name] = (t * 1e6, kv_bytes / t / 1e9)
      except Exception as e:  # noqa: BLE001
        row[name] = None
        print(f"  {name} failed at {row}: {type(e).__name__}: {str(e)[:120]}")
    rows.append(row)
    print(row, flush=True)
  return rows


def fmt(x):
  return "-" if x is None else f"{x[0]:.0f} / {x[1]:.0f}"


def markdown(grid_rows, decode_rows, command, decode_unroll):
  names = ["jax_flash2", "cudnn", "xla", "torch_fa2"]
  lines = [*_report.header(command), "",
           "TFLOP/s, forward / forward+backward (bf16, B*T = 16k, H*D = 2048):", "",
           "| D | causal | T | " + " | ".join(names) + " |", "|---" * (3 + len(names)) + "|"]
  for r in grid_rows:
    lines.append(f"| {r['D']} | {r['causal']} | {r['T']} | " + " | ".join(fmt(r.get(n)) for n in names) + " |")
  lines += ["", "Decode (bf16, T queries, H = 32, K = 4, D = 128, no mask; per step of a jitted "
            f"scan over {DECODE_STEPS} steps, unroll {decode_unroll}): microseconds / GB/s of K+V:",
            "", "| T | B | S | jax_flash2 | cudnn | xla |", "|---|---|---|---|---|---|"]
  for r in decode_rows:
    lines.append(f"| {r['T']} | {r['B']} | {r['S']} | "
                 + " | ".join(fmt(r.get(n)) for n in ("jax_flash2", "cudnn", "xla")) + " |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seqlens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--no-decode", action="store_true")
  parser.add_argument("--no-grid", action="store_true", help="the decode table alone")
  parser.add_argument("--xla-max-seqlen", type=int, default=4096)
  parser.add_argument("--decode-queries", type=int, nargs="+", default=[1],
                      help="query rows T per decode step (1: one token; more: speculative/chunked)")
  parser.add_argument("--decode-seqlens", type=int, nargs="+", default=[4096, 32768, 131072])
  parser.add_argument("--decode-unroll", type=int, default=1,
                      help="scan unroll of the decode steps: >1 drops the loop's per-step cost")
  parser.add_argument("--warmup-s", type=float, default=0.0,
                      help="seconds of calls before each timing (steady clocks at the power limit)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  grid_rows = [] if args.no_grid else grid(args)
  decode_rows = [] if args.no_decode else decode(args)
  _report.emit(markdown(grid_rows, decode_rows, _report.command(), args.decode_unroll), args.out)


if __name__ == "__main__":
  main()
