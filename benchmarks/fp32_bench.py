"""float32 attention on the GPU: jax_flash2's float32 path (the blockwise
plain-JAX forward and backward that float32 calls lower to on CUDA) beside
jax.nn.dot_product_attention(implementation="xla") in float32, forward and
forward+backward, under the default matmul precision (TF32 tensor cores) and
under "highest" (float32-accurate).

FLOPs: forward 4*B*T*S*H*D, halved for causal; forward+backward 3.5x forward
(the backward counts 2.5x). XLA's float32 attention forms the [B, H, T, S]
scores; cases whose scores would not fit in --xla-max-gib are left out for it.

  python benchmarks/fp32_bench.py --seqlens 1024 4096 16384 --out fp32.md

Each timing is the median of 3 samples of 10 back-to-back calls after one call.
"""

from __future__ import annotations

import argparse
import itertools

import jax
import jax.numpy as jnp

import jax_flash2
import _report
from gpu_bench import time_jax


def impls(causal):
  def ours(q, k, v):
    return jax_flash2.flash_attention(q, k, v, causal=causal)

  def xla(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

  return {"jax_flash2": ours, "xla": xla}


def fwd_bwd(fn):
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v) ** 2)

  return jax.grad(loss, argnums=(0, 1, 2))


def run(args):
  rows = []
  for seqlen, head_dim, causal, precision in itertools.product(
      args.seqlens, args.head_dims, (False, True), args.precisions):
    batch = max(1, args.tokens // seqlen)
    shape = (batch, seqlen, args.heads, head_dim)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    flops = 4 * batch * seqlen * seqlen * args.heads * head_dim / (2 if causal else 1)
    scores_gib = batch * args.heads * seqlen * seqlen * 4 / 2**30
    for name, fn in impls(causal).items():
      if name == "xla" and scores_gib > args.xla_max_gib:
        rows.append((seqlen, batch, head_dim, causal, precision, name, None, None))
        continue
      with jax.default_matmul_precision(None if precision == "default" else precision):
        t_fwd = time_jax(jax.jit(fn), (q, k, v), warmup_s=0.0)
        t_bwd = time_jax(jax.jit(fwd_bwd(fn)), (q, k, v), warmup_s=0.0)
      rows.append((seqlen, batch, head_dim, causal, precision, name,
                   flops / t_fwd / 1e12, 3.5 * flops / t_bwd / 1e12))
      print(rows[-1], flush=True)
  return rows


def fmt(x):
  return "-" if x is None else f"{x:.1f}"


def markdown(rows, command):
  lines = [f"`{command}`", "", f"jax {jax.__version__}, {jax.devices()[0].device_kind}", "",
           "| T = S | B | D | causal | precision | impl | fwd TFLOP/s | fwd+bwd TFLOP/s |",
           "|---|---|---|---|---|---|---|---|"]
  for seqlen, batch, head_dim, causal, precision, name, fwd, both in rows:
    lines.append(f"| {seqlen} | {batch} | {head_dim} | {causal} | {precision} | {name} | "
                 f"{fmt(fwd)} | {fmt(both)} |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--seqlens", type=int, nargs="+", default=[1024, 4096, 16384])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--tokens", type=int, default=16384, help="B * T per case")
  parser.add_argument("--precisions", nargs="+", default=["default", "highest"],
                      choices=["default", "high", "highest"])
  parser.add_argument("--xla-max-gib", type=float, default=16.0,
                      help="skip XLA where its [B, H, T, S] float32 scores exceed this")
  parser.add_argument("--out", default=None, help="write the markdown table here")
  args = parser.parse_args()
  _report.emit(markdown(run(args), _report.command()), args.out)


if __name__ == "__main__":
  main()
