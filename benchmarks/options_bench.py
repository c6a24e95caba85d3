"""GPU benchmark of the score options (softcap, ALiBi, both, attention sinks,
dropout 0.1, the deterministic backward) beside the plain path, in one run, with cuDNN (jax.nn.dot_product_attention)
where it can express the option: plain, and ALiBi as a [1, H, T, S] bias
tensor (cuDNN has no softcap). The sinks' forward+backward includes their
gradient (they are learnable). bf16, B = 2, H = 16; forward and forward+backward TFLOP/s, FLOPs
4 B T S H D forward (halved when causal), 2.5x that backward, so 3.5x for
forward+backward; each option's ratio to the plain path of the same shape.

  python benchmarks/options_bench.py --out benchmarks/results/h200_options.md
  python benchmarks/options_bench.py --only plain sinks --no-cudnn
  python benchmarks/options_bench.py --only "dropout 0.1" deterministic --no-cudnn
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2
from jax_flash2 import reference
from gpu_bench import time_jax
import _report

BATCH, HEADS = 2, 16
SOFTCAP = 50.0
DROPOUT = 0.1


def alibi_slopes():
  # The ALiBi paper's geometric slopes for H heads.
  return jnp.asarray(2.0 ** (-8.0 * np.arange(1, HEADS + 1) / HEADS), jnp.float32)


def variants(causal):
  """name -> (fn(q, k, v, *extra), the extra array: the slopes (ours), the bias
  (cuDNN) or the sinks)."""
  def ours(array="alibi_slopes", **kw):
    def fn(q, k, v, *extra):
      return jax_flash2.flash_attention(q, k, v, causal=causal, **kw,
                                        **({array: extra[0]} if extra else {}))
    return fn

  def cudnn(q, k, v, *bias):
    # The bias is an argument, not closed over (it would become a constant).
    return jax.nn.dot_product_attention(q, k, v, *bias, is_causal=causal,
                                        implementation="cudnn")

  return {
      "plain": (ours(), None),
      f"softcap {SOFTCAP:g}": (ours(softcap=SOFTCAP), None),
      "ALiBi": (ours(), "slopes"),
      f"softcap {SOFTCAP:g} + ALiBi": (ours(softcap=SOFTCAP), "slopes"),
      "sinks": (ours("sinks"), "sinks"),
      f"dropout {DROPOUT:g}": (ours("dropout_rng", dropout_rate=DROPOUT), "key"),
      "deterministic": (ours(deterministic=True), None),
      "cuDNN plain": (cudnn, None),
      "cuDNN ALiBi (bias)": (cudnn, "bias"),
  }


def measure(fn, args, flops, warmup_s, iters, extra_grad=False):
  grads = jax.grad(lambda q, k, v, *extra: jnp.sum(fn(q, k, v, *extra).astype(jnp.float32)),
                   argnums=(0, 1, 2, 3) if extra_grad else (0, 1, 2))
  try:
    tf = time_jax(jax.jit(fn), args, warmup_s, iters=iters)
    tb = time_jax(jax.jit(grads), args, warmup_s, iters=iters)
  except Exception as e:  # noqa: BLE001 - an implementation that cannot run this shape
    print(f"  failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
    return None
  return flops / tf / 1e12, 3.5 * flops / tb / 1e12


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192, 16384])
  parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
  parser.add_argument("--warmup-s", type=float, default=0.3)
  parser.add_argument("--iters", type=int, default=5, help="calls per timed sample (median of 3)")
  parser.add_argument("--no-cudnn", action="store_true")
  parser.add_argument("--only", nargs="+", default=None,
                      help="variant names to run (plain always runs: the ratios need it)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  names = list(variants(False))
  if args.no_cudnn:
    names = [n for n in names if not n.startswith("cuDNN")]
  if args.only:
    unknown = set(args.only) - set(names)
    if unknown:
      parser.error(f"--only: unknown variants {sorted(unknown)}; known: {names}")
    names = [n for n in names if n == "plain" or n in args.only]
  lines = [*_report.header(_report.command(), str(jax_flash2.kernel_info()["cuda"])), "",
           f"bf16, B = {BATCH}, H = {HEADS}, T = S. TFLOP/s forward / forward+backward; "
           "in brackets the ratio to jax_flash2's plain path of the same row.", "",
           "| D | T | causal | " + " | ".join(names) + " |",
           "|---|---|---|" + "---|" * len(names)]
  slopes = alibi_slopes()
  sinks = jnp.ones((HEADS,), jnp.float32)
  start = time.perf_counter()
  for head_dim in args.head_dims:
    for seqlen in args.seqlens:
      for causal in (False, True):
        keys = jax.random.split(jax.random.PRNGKey(seqlen + head_dim), 3)
        qkv = tuple(jax.random.normal(k, (BATCH, seqlen, HEADS, head_dim), jnp.bfloat16)
                    for k in keys)
        flops = 4.0 * BATCH * seqlen * seqlen * HEADS * head_dim * (0.5 if causal else 1.0)
        bias = None
        results = {}
        for name, (fn, extra) in variants(causal).items():
          if name not in names:
            continue
          if extra == "bias" and bias is None:
            bias = reference.alibi_bias(slopes[None], seqlen, seqlen).astype(jnp.bfloat16)
          more = {"slopes": (slopes,), "bias": (bias,), "sinks": (sinks,),
                  "key": (jax.random.key(seqlen),), None: ()}[extra]
          results[name] = measure(fn, qkv + more, flops, args.warmup_s, args.iters,
                                  extra_grad=extra == "sinks")
          r = results[name]
          print(f"D{head_dim} T{seqlen} causal={causal} {name}: "
                + ("failed" if r is None else f"{r[0]:.0f} / {r[1]:.0f}")
                + f"  [{time.perf_counter() - start:.0f}s]", flush=True)
        del bias
        plain = results["plain"]

        def cell(r):
          if r is None:
            return "-"
          if plain is None:
            return f"{r[0]:.0f} / {r[1]:.0f}"
          return f"{r[0]:.0f} / {r[1]:.0f} ({r[0] / plain[0]:.2f} / {r[1] / plain[1]:.2f})"

        lines.append(f"| {head_dim} | {seqlen} | {causal} | "
                     + " | ".join(cell(results.get(n)) for n in names) + " |")
        print(lines[-1], flush=True)
        # after every row: a cut run keeps the rows it finished
        _report.save("\n".join(lines) + "\n", args.out)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
