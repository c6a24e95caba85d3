"""Decode over a KV cache: jax_flash2.flash_attention_with_kvcache beside an
XLA gather-and-attend baseline and cuDNN (paged where this jax exposes it).

Shapes: T 1, H 32, K 8, D 128, bfloat16; contiguous [B, S_max, K, D] and
paged caches (page 16 / 64 / 256); per-sequence lengths drawn uniformly in
[1k, 32k], or one 32k sequence among 1k ones. GB/s counts the K/V bytes
actually valid (sum of lengths * K * D * 2 bytes * 2), beside the H200's
~4.3 TB/s copy rate. Each timing is a jitted loop of --steps dependent
decode steps, divided by the steps (dispatch excluded); the caches are
loop invariants (donated and carried when the step appends).

  python benchmarks/kvcache_bench.py --out kvcache.md
  python benchmarks/kvcache_bench.py --quick --out kvcache.md   # fewer rows
"""

from __future__ import annotations

import argparse
import inspect
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import kvcache
import _report

COPY_RATE = 4.3e12  # bytes/s, H200 device-to-device copy
H, K, D = 32, 8, 128
S_MAX = 32768


def lengths_for(kind: str, batch: int, rng) -> np.ndarray:
  if kind == "uniform":
    return rng.integers(min(1024, S_MAX), S_MAX + 1, size=batch).astype(np.int32)
  lens = np.full(batch, min(1024, S_MAX), np.int32)  # "one long": one S_max sequence among 1k ones
  lens[0] = S_MAX
  return lens


def make_cache(batch, lens, page_size, dtype, key):
  """(k_cache, v_cache, block_table or None): a contiguous [B, S_max, K, D]
  cache, or a pool holding just the pages the sequences use (shuffled)."""
  k1, k2 = jax.random.split(key)
  if page_size == 0:
    shape = (batch, S_MAX, K, D)
    return (jax.random.normal(k1, shape, jnp.bfloat16).astype(dtype),
            jax.random.normal(k2, shape, jnp.bfloat16).astype(dtype), None)
  max_pages = S_MAX // page_size
  used = [-(-int(n) // page_size) for n in lens]
  num_pages = sum(used) + 1
  order = np.random.default_rng(0).permutation(num_pages - 1) + 1
  table = np.zeros((batch, max_pages), np.int32)  # unused entries: page 0, never read
  start = 0
  for b, n in enumerate(used):
    table[b, :n] = order[start:start + n]
    start += n
  shape = (num_pages, page_size, K, D)
  return (jax.random.normal(k1, shape, jnp.bfloat16).astype(dtype),
          jax.random.normal(k2, shape, jnp.bfloat16).astype(dtype), jnp.asarray(table))


def timed_loop(attend, steps, carry_caches=False, unroll=True):
  """A jitted loop of `steps` dependent decode steps (each step's q depends on
  the previous output, so XLA can neither hoist nor merge them). The caches
  are loop invariants, read in place; carry_caches: attend returns (out,
  k_cache, v_cache), carried to the next step, and the caches are donated so
  that the append updates them in place (the loop's init would otherwise copy
  the whole cache once per call). Without it the loop returns q alone: a
  cache handed back undonated would be copied into a new output buffer on
  every call. unroll: straight-line steps; a rolled loop adds its own
  per-step cost (--rolled). Returns fn(q, kc, vc, *args) -> q, or (q, kc,
  vc) with carry_caches."""
  def run(q, kc, vc, *args):
    if not carry_caches:
      body = lambda _, q: q + (attend(q, kc, vc, *args)[..., :1] * 0).astype(q.dtype)
      return jax.lax.fori_loop(0, steps, body, q, unroll=unroll)

    def body(_, state):
      q, kc, vc = state
      out, kc, vc = attend(q, kc, vc, *args)
      return q + (out[..., :1] * 0).astype(q.dtype), kc, vc
    return jax.lax.fori_loop(0, steps, body, (q, kc, vc), unroll=unroll)
  return jax.jit(run, donate_argnums=(1, 2) if carry_caches else ())


def time_it(fn, args, steps, warmup_s, reps=5) -> float:
  """Seconds per step of fn(q, kc, vc, *rest) (timed_loop's); where it
  returns the caches (they may have been donated) they feed the next call."""
  q, kc, vc, *rest = args

  def call():
    nonlocal kc, vc
    result = jax.block_until_ready(fn(q, kc, vc, *rest))
    if isinstance(result, tuple):
      _, kc, vc = result

  call()
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < warmup_s:
    call()
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    call()
    samples.append((time.perf_counter() - t0) / steps)
  return float(np.median(samples))


def cudnn_paged():
  """cuDNN's attention with paged K/V, if this jax exposes page tables."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
  except ImportError:
    return None
  params = inspect.signature(cudnn.dot_product_attention).parameters
  if "page_table_k" not in params or "page_table_v" not in params:
    return None
  return cudnn.dot_product_attention


def parse_rows(names):
  """[(B, kind, page)] from names 'B:kind:page' (kind uniform | long)."""
  return [(int(b), "one long" if k == "long" else k, int(pg))
          for b, k, pg in (name.split(":") for name in names)]


def row(args, batch, kind, page_size, dtype=jnp.bfloat16, append=False, baselines=True):
  rng = np.random.default_rng(batch * 131 + page_size)
  lens = lengths_for(kind, batch, rng)
  key = jax.random.key(batch + page_size)
  kc, vc, table = make_cache(batch, lens, page_size, jnp.bfloat16, key)
  scales = {}
  if dtype != jnp.bfloat16:
    scale = jnp.full((K,), 4.0 / (127 if dtype == jnp.int8 else 448), jnp.float32)
    kc, vc = kvcache.quantize(kc, dtype, scale), kvcache.quantize(vc, dtype, scale)
    scales = dict(k_scale=scale, v_scale=scale)
  q = jax.random.normal(jax.random.key(1), (batch, 1, H, D), jnp.bfloat16)
  knew = jax.random.normal(jax.random.key(2), (batch, 1, K, D), jnp.bfloat16)
  seqlens = jnp.asarray(lens - (1 if append else 0))
  valid_bytes = float(lens.sum()) * K * D * 2 * 2 * (jnp.dtype(dtype).itemsize / 2)
  result = dict(batch=batch, kind=kind, layout=f"paged {page_size}" if page_size else "contiguous",
                dtype=jnp.dtype(dtype).name, append=append, mean_len=int(lens.mean()))

  def ours(impl):
    def attend(q, kc, vc, n, t, knew):
      extra = dict(k=knew, v=knew) if append else {}
      return kvcache.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=n, block_table=t,
                                                  implementation=impl, **scales, **extra)
    return attend

  fn = timed_loop(ours("kernel"), args.steps, carry_caches=append,
                  unroll=not args.rolled)
  t = time_it(fn, (q, kc, vc, seqlens, table, knew), args.steps, args.warmup)
  result.update(ours_us=t * 1e6, gbs=valid_bytes / t / 1e9, frac=valid_bytes / t / COPY_RATE)
  if baselines:
    try:
      steps = max(2, args.steps // 5)  # the baseline is slow: fewer steps
      fn = timed_loop(ours("reference"), steps)
      result["xla_us"] = time_it(fn, (q, kc, vc, seqlens, table, knew), steps, 0.0, reps=3) * 1e6
    except Exception as e:  # noqa: BLE001 (reported in the table)
      result["xla_us"] = f"error: {type(e).__name__}"
    result["cudnn_us"] = cudnn_time(args, q, kc, vc, seqlens, table, page_size)
  del kc, vc
  return result


def cudnn_time(args, q, kc, vc, seqlens, table, page_size):
  """cuDNN paged attention where this jax has it; for a contiguous cache
  jax.nn.dot_product_attention(implementation="cudnn") with the lengths."""
  try:
    if page_size == 0:
      def attend(q, kc, vc, n, t, _):
        return jax.nn.dot_product_attention(q, kc, vc, key_value_seq_lengths=n,
                                            implementation="cudnn")
    else:
      paged = cudnn_paged()
      if paged is None:
        return "n/a (no page tables in this jax)"
      def attend(q, kc, vc, n, t, _):
        ones = jnp.ones_like(n)
        pt = t[:, None, :, None]
        return paged(q, kc, vc, q_seqlen=ones, kv_seqlen=n, page_table_k=pt, page_table_v=pt,
                     scale=D ** -0.5)
    fn = timed_loop(attend, args.steps, unroll=not args.rolled)
    return time_it(fn, (q, kc, vc, seqlens, table, None), args.steps, args.warmup) * 1e6
  except Exception as e:  # noqa: BLE001 (reported in the table)
    return f"error: {type(e).__name__}: {str(e).splitlines()[0][:60]}"


def fmt(x):
  return f"{x:.1f}" if isinstance(x, float) else str(x)


def markdown(rows, command):
  lines = [*_report.header(command),
           "", "| B | lengths | mean len | layout | dtype | append | ours us | GB/s (valid) | of 4.3 TB/s "
           "| XLA gather us | cuDNN us |", "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['batch']} | {r['kind']} | {r['mean_len']} | {r['layout']} | {r['dtype']} | "
                 f"{'yes' if r['append'] else 'no'} | {r['ours_us']:.1f} | {r['gbs']:.0f} | "
                 f"{100 * r['frac']:.0f}% | {fmt(r.get('xla_us', '-'))} | "
                 f"{fmt(r.get('cudnn_us', '-'))} |")
  return "\n".join(lines) + "\n"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", help="markdown table file")
  p.add_argument("--steps", type=int, default=20)
  p.add_argument("--warmup", type=float, default=0.3, help="seconds")
  p.add_argument("--quick", action="store_true", help="a subset of the rows")
  p.add_argument("--rolled", action="store_true",
                 help="time a rolled fori_loop (its per-step cost included)")
  p.add_argument("--rows", nargs="*", help="only rows named B:kind:page (kind uniform|long, "
                 "page 0 = contiguous), e.g. 16:uniform:64")
  p.add_argument("--no-baselines", action="store_true", help="ours alone")
  p.add_argument("--s-max", type=int, default=S_MAX, help="cache capacity (a smoke test: small)")
  p.add_argument("--dtypes", nargs="*", choices=("bfloat16", "float8_e4m3fn", "int8"),
                 help="cache dtypes of the appending rows (default: all three, none with --rows)")
  p.add_argument("--dtype-rows", nargs="*", default=["16:uniform:64"],
                 help="the appending rows' B:kind:page (default 16:uniform:64)")
  args = p.parse_args(argv)
  globals()["S_MAX"] = args.s_max
  batches = (1, 16, 64) if not args.quick else (1, 16)
  pages = (0, 16, 64, 256) if not args.quick else (0, 16, 64)
  rows = []
  plan = [(b, "uniform", pg) for b in batches for pg in pages]
  plan += [(b, "one long", pg) for b in batches[1:] for pg in (0, 64)]
  if args.quick:
    plan += [(64, "uniform", 64)]
  if args.rows is not None:
    plan = parse_rows(args.rows)
  for b, kind, pg in plan:
    rows.append(row(args, b, kind, pg,
                    baselines=not args.no_baselines and (b < 64 or not args.quick)))
    print(markdown(rows[-1:], "").splitlines()[-1], flush=True)
  # The cache dtypes' rows append as they attend: over a loop-invariant
  # quantized cache XLA would hoist a dequantized copy out of the loop.
  dtypes = args.dtypes if args.dtypes is not None else (
      ("bfloat16", "float8_e4m3fn", "int8") if args.rows is None else ())
  for b, kind, pg in parse_rows(args.dtype_rows):
    for dtype in dtypes:
      rows.append(row(args, b, kind, pg, dtype=jnp.dtype(dtype), append=True, baselines=False))
      print(markdown(rows[-1:], "").splitlines()[-1], flush=True)
  _report.emit(markdown(rows, _report.command()), args.out)


if __name__ == "__main__":
  main()
