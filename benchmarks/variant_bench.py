"""GPU benchmark of the attention variants, beside cuDNN where it offers the
same option (jax.nn.dot_product_attention(implementation="cudnn")), in one run.

TFLOP/s count only the (query, key) pairs a variant lets through: 4*D*H*B per
visible pair forward, 3.5x that forward+backward. Rows:
  window    sliding window of 4096 keys (causal) at T = 32k
  packed    8 documents of 2k tokens packed in T = 16k (causal within each);
            cuDNN runs the same documents unpacked as B = 8, T = 2k
  softcap   softcap = 50 at T = 8k; cuDNN has no softcap: its plain run is shown
  alibi     ALiBi slopes at T = 8k; cuDNN gets the same bias as a [1, H, T, S] tensor
  determ.   deterministic=True backward beside the default, T = 8k

  python benchmarks/variant_bench.py --out variants.md

(the table goes into benchmarks/results/h200.md, section "Variants").
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2
from jax_flash2 import reference
from gpu_bench import time_jax
import _report

HEADS, HEAD_DIM = 16, 128


def inputs(batch, seqlen, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  return tuple(jax.random.normal(k, (batch, seqlen, HEADS, HEAD_DIM), jnp.bfloat16) for k in keys)


def visible_pairs(seqlen, left, causal=True):
  i = np.arange(seqlen)
  lo = np.maximum(i - left, 0) if left >= 0 else np.zeros_like(i)
  hi = i if causal else np.full_like(i, seqlen - 1)
  return int(np.sum(hi - lo + 1))


def measure(name, fn, args, pairs, batch):
  """(fwd ms, fwd TFLOP/s, fwd+bwd ms, fwd+bwd TFLOP/s) of fn(q, k, v, *extra)
  for args = (q, k, v, *extra), gradients with respect to q, k, v; printed as
  soon as measured."""
  flops = 4.0 * HEAD_DIM * HEADS * batch * pairs
  grads = jax.grad(lambda q, k, v, *extra: jnp.sum(fn(q, k, v, *extra).astype(jnp.float32)),
                   argnums=(0, 1, 2))
  try:
    tf = time_jax(jax.jit(fn), args)
    tb = time_jax(jax.jit(grads), args)
  except Exception as e:  # noqa: BLE001 - a path that cannot run this option
    print(f"{name}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
    return None
  result = (tf * 1e3, flops / tf / 1e12, tb * 1e3, 3.5 * flops / tb / 1e12)
  print(f"{name}: {result[1]:.0f} / {result[3]:.0f} TFLOP/s", flush=True)
  return result


def cudnn(**kw):
  # Extra arguments (a bias) are passed in, not closed over: a closed-over
  # array would be embedded in the program as a constant (2 GB for ALiBi).
  return lambda q, k, v, *bias: jax.nn.dot_product_attention(
      q, k, v, *bias, implementation="cudnn", **kw)


def flash(**kw):
  return lambda q, k, v, *slopes: jax_flash2.flash_attention(
      q, k, v, **kw, **({"alibi_slopes": slopes[0]} if slopes else {}))


def rows():
  out = []

  # Sliding window 4096 (causal) at T = 32k.
  t, w = 32768, 4096
  args = inputs(1, t)
  pairs = visible_pairs(t, w)
  name = "window 4096, causal, B1 T32k"
  out.append((name, measure(name, flash(causal=True, window_size=(w, 0)), args, pairs, 1),
              measure(name + " cuDNN", cudnn(is_causal=True, local_window_size=(w, 0)), args,
                      pairs, 1)))

  # 8 packed documents of 2k tokens.
  docs, doc_len = 8, 2048
  args = inputs(1, docs * doc_len)
  ids = jnp.repeat(jnp.arange(docs, dtype=jnp.int32), doc_len)[None]
  pairs = docs * visible_pairs(doc_len, -1)
  name = "8 packed docs x 2k, causal (cuDNN: unpacked B8 T2k)"
  ours = measure(name, flash(causal=True, segment_ids=(ids, ids)), args, pairs, 1)
  unpacked = inputs(docs, doc_len)
  out.append((name, ours, measure(name + " cuDNN", cudnn(is_causal=True), unpacked,
                                  pairs // docs, docs)))

  # softcap 50 and its plain counterpart, T = 8k.
  t = 8192
  args = inputs(2, t)
  pairs = t * t
  name = "softcap 50, B2 T8k"
  out.append((name, measure(name, flash(softcap=50.0), args, pairs, 2), None))
  name = "plain (no softcap), B2 T8k"
  out.append((name, measure(name, flash(), args, pairs, 2),
              measure(name + " cuDNN", cudnn(), args, pairs, 2)))

  # ALiBi, T = 8k: slopes for us, a materialized bias for cuDNN.
  slopes = jnp.asarray(2.0 ** (-8.0 * np.arange(1, HEADS + 1) / HEADS), jnp.float32)
  bias = reference.alibi_bias(jnp.broadcast_to(slopes, (1, HEADS)), t, t).astype(jnp.bfloat16)
  name = "ALiBi, B2 T8k"
  out.append((name, measure(name, flash(), args + (slopes,), pairs, 2),
              measure(name + " cuDNN", cudnn(), args + (bias,), pairs, 2)))

  # Deterministic backward vs the default (atomics) one, causal, T = 8k.
  pairs = visible_pairs(t, -1)
  name = "causal default bwd, B2 T8k"
  out.append((name, measure(name, flash(causal=True), args, pairs, 2), None))
  name = "causal deterministic bwd, B2 T8k"
  out.append((name, measure(name, flash(causal=True, deterministic=True), args, pairs, 2), None))
  return out


def markdown(table, command):
  def cell(r):
    return "-" if r is None else f"{r[1]:.0f} / {r[3]:.0f} ({r[0]:.2f} / {r[2]:.2f} ms)"

  lines = [*_report.header(command), "",
           f"bf16, H = {HEADS}, D = {HEAD_DIM}. TFLOP/s over visible pairs, forward / forward+backward "
           "(milliseconds in brackets):", "",
           "| variant | jax_flash2 | cuDNN |", "|---|---|---|"]
  for name, ours, peer in table:
    lines.append(f"| {name} | {cell(ours)} | {cell(peer)} |")
  return "\n".join(lines) + "\n"


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  _report.emit(markdown(rows(), _report.command()), args.out)


if __name__ == "__main__":
  main()
