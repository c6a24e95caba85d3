"""CPU benchmark: jax_flash2's CPU kernels beside jax.nn.dot_product_attention
(XLA) in one run, float32, forward and forward+backward.

FLOPs: forward 4*B*T*T*H*D, halved for causal; forward+backward 3.5x that.

  python benchmarks/cpu_bench.py --out benchmarks/results/cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jax_flash2
import _report


def median_time(fn, args, reps):
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(time.perf_counter() - start)
  return statistics.median(samples)


def run(seqlen, batch, heads, head_dim, causal, with_xla, reps):
  keys = jax.random.split(jax.random.PRNGKey(seqlen), 3)
  q, k, v = (jax.random.normal(key, (batch, seqlen, heads, head_dim), jnp.float32) for key in keys)
  impls = {"jax_flash2": lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=causal)}
  if with_xla:
    impls["xla"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal)
  flops = 4 * batch * seqlen * seqlen * heads * head_dim * (0.5 if causal else 1.0)
  row = {}
  for name, f in impls.items():
    grad = jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v)), argnums=(0, 1, 2))
    t_fwd = median_time(jax.jit(f), (q, k, v), reps)
    t_all = median_time(jax.jit(grad), (q, k, v), reps)
    row[name] = (t_fwd, t_all, flops / t_fwd / 1e9, 3.5 * flops / t_all / 1e9)
  return row


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096])
  parser.add_argument("--long", type=int, default=16384, help="a length run for jax_flash2 only")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()

  lines = [
      f"Command: `{_report.command()}`",
      f"Machine: {jax.devices()[0].device_kind}, {jax.local_device_count()} device(s), "
      f"jax {jax.__version__}, kernels {jax_flash2.kernel_info()['cpu']}",
      f"float32, B = {args.batch}, H = {args.heads}, D = {args.head_dim}; median of {args.reps}.",
      "",
      "| T | causal | jax_flash2 fwd ms (GFLOP/s) | xla fwd ms (GFLOP/s) | fwd speedup "
      "| jax_flash2 fwd+bwd ms (GFLOP/s) | xla fwd+bwd ms (GFLOP/s) | fwd+bwd speedup |",
      "|---|---|---|---|---|---|---|---|",
  ]
  cases = [(t, True) for t in args.seqlens] + ([(args.long, False)] if args.long else [])
  for seqlen, with_xla in cases:
    for causal in (False, True):
      row = run(seqlen, args.batch, args.heads, args.head_dim, causal, with_xla, args.reps)
      ours = row["jax_flash2"]
      xla = row.get("xla")
      cell = lambda r, i: "not run (needs the T x T matrix)" if r is None else f"{r[i] * 1e3:.1f} ({r[i + 2]:.0f})"
      speed = lambda i: "-" if xla is None else f"{xla[i] / ours[i]:.2f}x"
      lines.append(f"| {seqlen} | {causal} | {cell(ours, 0)} | {cell(xla, 0)} | {speed(0)} | "
                   f"{cell(ours, 1)} | {cell(xla, 1)} | {speed(1)} |")
      print(lines[-1], flush=True)
  text = "\n".join(lines) + "\n"
  _report.emit(text, args.out)


if __name__ == "__main__":
  main()
