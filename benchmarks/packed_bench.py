"""Packed sequences on the GPU: documents packed into rows of 16k tokens with
segment ids, the same tokens through flash_attention_varlen (the packed
[total, H, D] tensors and cu_seqlens), beside the same documents run as a
batch, ours and cuDNN's (cuDNN's packed layout: per-row document lengths and
offsets), forward and forward+backward, bf16, causal.

TFLOP/s count useful work only: the visible (query, key) pairs of each
document, 4 D H per pair forward (two products of 2 D H), 2.5 times that for
forward+backward. Each timed call chains 5 dependent steps in one jitted
program (chained), so short calls are timed on the GPU, not at the host's
dispatch rate; the samples of all implementations of a case are taken in
rounds (time_calls). Printed as a markdown table, then a second one with the
temporary memory XLA allocates for our packed calls (the compiled program's
memory_analysis().temp_size_in_bytes, kernel workspace included; the inputs
and outputs are the same for both), which for varlen shows that no padded
[n, max_seqlen] copy is made, and the device's peak_bytes_in_use after the run.

  python3 benchmarks/packed_bench.py                 # 8x2048, 64x256, mixed; D 64, 128
  python3 benchmarks/packed_bench.py --cases 8x2048 --head-dims 128
  python3 benchmarks/packed_bench.py --row 1024 --heads 2 --head-dims 64 --warmup-s 0  # smoke
  python3 benchmarks/packed_bench.py --out results/packed.md   # also writes the tables
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2
import _report

ROW = 16384  # tokens per packed row; --row changes it (the uniform cases keep 8 and 64
#              documents per row, so 8x2048 means 8 documents of ROW / 8)
BATCH_BUCKET = 256  # the mixed cases' "batch": documents padded to a multiple of it


def warm_up(call, seconds):
  jax.block_until_ready(call())
  t0 = time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    out = None
    for _ in range(5):
      out = call()
    jax.block_until_ready(out)


def chained(fn, steps):
  """fn run `steps` times in one jitted call, each step's first argument the
  previous step's first output (same shape and dtype): the steps cannot be
  merged, and one dispatch covers them all, so that the time is the GPU's
  even for calls shorter than the host's dispatch (the 64 x 256 forward
  takes about 100 us)."""
  def run(first, *rest):
    for _ in range(steps):
      out = fn(first, *rest)
      first = (out[0] if isinstance(out, tuple) else out).astype(first.dtype)
    return first
  return jax.jit(run)


def time_calls(calls, warmup_s, errors, steps=5, iters=3, reps=5):
  """Seconds per call of each fn(*args) of calls ({key: (fn, args)}): the
  median of reps samples, each iters calls of `steps` chained steps. The
  samples are taken in rounds, one of every key per round, so that the
  GPU's clock and power drift over a case falls on every implementation
  alike. A key whose call raises gets None, its error appended to
  errors."""
  ready = {}
  for key, (fn, args) in calls.items():
    f = chained(fn, steps)
    try:
      warm_up(lambda: f(*args), warmup_s)
    except Exception as e:  # a backend that cannot run this shape
      errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
      continue
    ready[key] = (f, args)
  samples = {key: [] for key in ready}
  for _ in range(reps):
    for key, (f, args) in ready.items():
      jax.block_until_ready(f(*args))
      t0 = time.perf_counter()
      out = None
      for _ in range(iters):
        out = f(*args)
      jax.block_until_ready(out)
      samples[key].append((time.perf_counter() - t0) / (iters * steps))
  return {key: statistics.median(samples[key]) if key in samples else None for key in calls}


def mixed_lengths(rng, rows, lo=32, hi=8192):
  """Rows of ROW tokens filled with document lengths from a long-tailed
  (log-uniform) distribution in [lo, hi]; the last document of a row is cut
  to fit. Returns one list of lengths per row."""
  hi = min(hi, ROW // 2)
  out = []
  for _ in range(rows):
    lengths, used = [], 0
    while used < ROW:
      n = int(np.exp(rng.uniform(np.log(lo), np.log(hi))))
      n = min(n, ROW - used)
      lengths.append(n)
      used += n
    out.append(lengths)
  return out


def useful_pairs(rows, causal=True):
  return sum(n * (n + 1) // 2 if causal else n * n for row in rows for n in row)


def segment_ids(rows):
  ids = np.zeros((len(rows), ROW), np.int32)
  for b, row in enumerate(rows):
    ids[b] = np.repeat(np.arange(len(row), dtype=np.int32), row)
  return jnp.asarray(ids)


def cudnn_packed_fn():
  """cuDNN's packed (THD) attention, or (None, why) when this jax's
  fused_attention_stablehlo.dot_product_attention does not take the arguments
  used here."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
  except ImportError as e:
    return None, f"no cuDNN fused attention module ({e})"
  params = inspect.signature(fa.dot_product_attention).parameters
  need = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "mask_type", "scale")
  missing = [n for n in need if n not in params]
  if missing or not hasattr(fa, "MaskType") or not hasattr(fa.MaskType, "PADDING_CAUSAL"):
    return None, f"dot_product_attention lacks {missing or 'MaskType.PADDING_CAUSAL'}"

  def run(q, k, v, seqlen, offsets):
    return fa.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                    kv_offsets=offsets, scale=q.shape[-1]**-0.5,
                                    mask_type=fa.MaskType.PADDING_CAUSAL)
  return run, ""


def seqlen_offsets(rows):
  """cuDNN's [B, M] lengths and [B, M + 1] offsets, -1 past each row's documents."""
  m = max(len(r) for r in rows)
  seqlen = -np.ones((len(rows), m), np.int32)
  offsets = -np.ones((len(rows), m + 1), np.int32)
  for b, row in enumerate(rows):
    seqlen[b, :len(row)] = row
    offsets[b, :len(row) + 1] = np.concatenate([[0], np.cumsum(row)])
  return jnp.asarray(seqlen), jnp.asarray(offsets)


def cu_seqlens(rows):
  """[n + 1] int32 offsets of every document of every row, rows one after the
  other: the varlen view of the packed [B * ROW] tokens."""
  return jnp.asarray(np.concatenate([[0], np.cumsum([n for row in rows for n in row])]),
                     jnp.int32)


def temp_bytes(fn, args):
  """Temporary bytes of the compiled fn(*args) (memory_analysis), or None."""
  try:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)
  except Exception:  # a backend without the analysis
    return None


def fwd_bwd(fn):
  def loss(*args):
    return jnp.sum(fn(*args).astype(jnp.float32))
  return jax.grad(loss, argnums=(0, 1, 2))


def bench_case(name, rows, heads, head_dim, warmup_s, rng):
  """Times of one case: {impl: (fwd_s, fwd_bwd_s)}; None where not run."""
  dtype = jnp.bfloat16
  b = len(rows)

  def rand(shape):
    return jnp.asarray(rng.standard_normal(shape), dtype)

  q, k, v = (rand((b, ROW, heads, head_dim)) for _ in range(3))
  ids = segment_ids(rows)
  notes = []
  # (implementation, part, forward or forward+backward) -> (fn, args); part
  # is one batch of the "batch" figures (their times are summed).
  calls = {}

  def add(impl, fn, args, part=0):
    calls[(impl, part, 0)] = (fn, args)
    calls[(impl, part, 1)] = (fwd_bwd(fn), args)

  # The longest document, which a packing loader knows: the packed call's
  # max_segment_length (its tile hint) and varlen's max_seqlen.
  longest = max(n for row in rows for n in row)

  def ours_packed(q, k, v, ids):
    return jax_flash2.flash_attention(q, k, v, causal=True, segment_ids=(ids, ids),
                                      max_segment_length=longest)
  add("ours packed", ours_packed, (q, k, v, ids))
  memory = {"ours packed": tuple(temp_bytes(f, (q, k, v, ids))
                                 for f in (ours_packed, fwd_bwd(ours_packed)))}
  plan = jax_flash2.plan(q, k, v, causal=True, segment_ids=(ids, ids), max_segment_length=longest,
                         compute_capability=(9, 0),
                         sm_count=getattr(jax.devices()[0], "core_count", 132))
  notes.append(f"{name}: packed plan forward {plan['forward'].kernel}, "
               f"backward {plan['backward'].kernel}")

  # varlen on the same tokens: [B * ROW, H, D] and the offsets of all
  # documents; one offsets array for q and k (equal offsets: the packed path).
  cu = cu_seqlens(rows)

  def ours_varlen(q, k, v, cu):
    return jax_flash2.flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)
  flat = tuple(x.reshape((b * ROW,) + x.shape[2:]) for x in (q, k, v))
  add("ours varlen", ours_varlen, flat + (cu,))
  memory["ours varlen"] = tuple(temp_bytes(f, flat + (cu,))
                                for f in (ours_varlen, fwd_bwd(ours_varlen)))

  # The same documents as a batch: one batch per document length (uniform
  # cases are a single batch of B * ROW / n documents). Mixed lengths, as a
  # length-bucketing loader would batch them: one batch per multiple of
  # BATCH_BUCKET tokens, each document padded up to it (the padding's work
  # is not counted as useful; in these cases it is a few percent of it).
  docs = [n for row in rows for n in row]
  few_lengths = len(set(docs)) <= 4
  bucket = (lambda n: n) if few_lengths else (lambda n: -(-n // BATCH_BUCKET) * BATCH_BUCKET)
  groups = {}
  for n in docs:
    groups[bucket(n)] = groups.get(bucket(n), 0) + 1
  if not few_lengths:
    padded = useful_pairs([[bucket(n) for n in docs]])
    notes.append(f"{name}: batch figures pad each document to a multiple of {BATCH_BUCKET} "
                 f"tokens ({len(groups)} batches; {padded / useful_pairs(rows) - 1:.1%} more "
                 f"causal pairs than the documents hold)")
  batches = {n: tuple(rand((count, n, heads, head_dim)) for _ in range(3))
             for n, count in groups.items()}

  def ours_batch(q, k, v):
    return jax_flash2.flash_attention(q, k, v, causal=True)

  def cudnn_batch(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
  for n, qkv in batches.items():
    add("ours batch", ours_batch, qkv, n)
    add("cuDNN batch", cudnn_batch, qkv, n)

  cudnn_packed, why = cudnn_packed_fn()
  if cudnn_packed is None:
    notes.append(f"cuDNN packed not run: {why}")
  else:
    seqlen, offsets = seqlen_offsets(rows)
    add("cuDNN packed", cudnn_packed, (q, k, v, seqlen, offsets))

  errors = []
  seconds = time_calls(calls, warmup_s, errors)
  notes += [f"{name}: {e}" for e in dict.fromkeys(errors)]
  results = {}
  for impl in dict.fromkeys(key[0] for key in calls):
    times = []
    for i in range(2):
      parts = [t for key, t in seconds.items() if key[0] == impl and key[2] == i]
      times.append(None if any(t is None for t in parts) else sum(parts))
    results[impl] = tuple(times)
  return results, memory, notes


CASES = {
    "8x2048": lambda rng: [[ROW // 8] * 8],
    "64x256": lambda rng: [[ROW // 64] * 64],
    "mixed": lambda rng: mixed_lengths(rng, 4),
}
IMPLS = ["ours packed", "ours varlen", "ours batch", "cuDNN packed", "cuDNN batch"]
MEMORY_IMPLS = ["ours packed", "ours varlen"]


def peak_bytes_in_use():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def main(argv=None):
  global ROW
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--cases", default="8x2048,64x256,mixed")
  ap.add_argument("--head-dims", default="64,128")
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--warmup-s", type=float, default=0.5)
  ap.add_argument("--row", type=int, default=ROW, help="tokens per packed row (a multiple of 64)")
  ap.add_argument("--out", default=None, help="also write the tables to this markdown file")
  args = ap.parse_args(argv)
  if args.row < 64 or args.row % 64:
    ap.error(f"--row must be a positive multiple of 64; got {args.row}")
  unknown = sorted(set(args.cases.split(",")) - set(CASES))
  if unknown:
    ap.error(f"unknown --cases {unknown}; known: {sorted(CASES)}")
  ROW = args.row
  rng = np.random.default_rng(0)
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"jax_flash2 {jax_flash2.kernel_info()}", flush=True)
  lines = ["| case | D | " + " | ".join(f"{i} fwd / fwd+bwd" for i in IMPLS)
           + " | packed / batch (ours) | ours / cuDNN packed | varlen / packed |",
           "|---|---|" + "---|" * (len(IMPLS) + 3)]
  memory_lines = ["| case | D | " + " | ".join(f"{i} temp MiB fwd / fwd+bwd" for i in MEMORY_IMPLS)
                  + " | q, k, v MiB |", "|---|---|" + "---|" * (len(MEMORY_IMPLS) + 1)]
  all_notes = []
  for case in args.cases.split(","):
    rows = CASES[case](np.random.default_rng(0))  # the same documents whatever ran before
    pairs = useful_pairs(rows)
    for d in (int(x) for x in args.head_dims.split(",")):
      flops = 4 * pairs * d * args.heads
      res, memory, notes = bench_case(f"{case} D{d}", rows, args.heads, d, args.warmup_s, rng)
      all_notes += notes

      def tf(impl, i):
        t = res.get(impl, (None, None))[i]
        return None if t is None else flops * (2.5 if i else 1.0) / t / 1e12

      def cell(impl):
        f, fb = tf(impl, 0), tf(impl, 1)
        return " / ".join("-" if x is None else f"{x:.0f}" for x in (f, fb))

      def ratio(a, b):
        out = []
        for i in range(2):
          x, y = tf(a, i), tf(b, i)
          out.append("-" if x is None or y is None else f"{x / y:.2f}")
        return " / ".join(out)

      lines.append(f"| {case} | {d} | " + " | ".join(cell(i) for i in IMPLS)
                   + f" | {ratio('ours packed', 'ours batch')} | "
                   f"{ratio('ours packed', 'cuDNN packed')} | "
                   f"{ratio('ours varlen', 'ours packed')} |")
      print(lines[-1], flush=True)

      def mib(impl):
        return " / ".join("-" if x is None else f"{x / 2**20:,.1f}"
                          for x in memory.get(impl, (None, None)))
      qkv = 3 * len(rows) * ROW * args.heads * d * 2  # bf16
      memory_lines.append(f"| {case} | {d} | " + " | ".join(mib(i) for i in MEMORY_IMPLS)
                          + f" | {qkv / 2**20:,.1f} |")
      print(memory_lines[-1], flush=True)
  report = [*_report.header(_report.command(), f"bf16, H {args.heads}, causal"), "",
            "TFLOP/s of useful work (visible pairs only):", "", *lines, "",
            "Temporary memory of the compiled calls (memory_analysis().temp_size_in_bytes):", "",
            *memory_lines]
  peak = peak_bytes_in_use()
  if peak is not None:
    report += ["", f"device peak_bytes_in_use over the whole run: {peak / 2**30:.2f} GiB"]
  report += [f"- {n}" for n in all_notes]
  print()
  _report.emit("\n".join(report) + "\n", args.out)

if __name__ == "__main__":
  main()
