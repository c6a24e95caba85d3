"""flash_attention_with_kvcache on CUDA: the decode kernel with per-sequence
lengths and block tables (and the gathered fallback), against the reference
on the same bfloat16 values, and the append kernel against the XLA scatters
it replaces, bit for bit; skipped without a GPU."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from jax_flash2 import kvcache

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")


def _cc():
  return tuple(int(x) for x in str(jax.devices()[0].compute_capability).split("."))


def _inputs(seed, batch, seqlen_q, heads, kv_heads, head_dim, capacity, lengths, page_size):
  """q, k_new, v_new, the contiguous cache, and the same keys as a shuffled
  page pool (NaN past every length and in the unused pages) with its table."""
  rng = np.random.default_rng(seed)
  bf = lambda shape: rng.standard_normal(shape).astype(np.float32)
  q, k_new, v_new = (bf((batch, seqlen_q, h, head_dim)) for h in (heads, kv_heads, kv_heads))
  kc, vc = (bf((batch, capacity, kv_heads, head_dim)) for _ in range(2))
  for b, n in enumerate(lengths):
    kc[b, n:] = vc[b, n:] = np.nan
  max_pages = capacity // page_size
  num_pages = batch * max_pages + 2
  table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
  pools = []
  for cache in (kc, vc):
    pool = np.full((num_pages, page_size, kv_heads, head_dim), np.nan, np.float32)
    for b in range(batch):
      for j in range(max_pages):
        pool[table[b, j]] = cache[b, j * page_size:(j + 1) * page_size]
    pools.append(pool)
  as_bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)
  return (as_bf16(q), as_bf16(k_new), as_bf16(v_new), as_bf16(kc), as_bf16(vc),
          as_bf16(pools[0]), as_bf16(pools[1]), jnp.asarray(table),
          jnp.asarray(lengths, jnp.int32))


SHAPES = [
    # batch, T, H, K, D, capacity, lengths, page_size
    (4, 1, 32, 8, 128, 2048, [0, 2048, 1, 777], 16),
    (3, 1, 8, 1, 64, 1024, [1024, 5, 300], 64),
    (2, 3, 16, 4, 128, 4096, [17, 4093], 256),       # 12 packed rows
    (2, 5, 8, 1, 128, 512, [0, 507], 16),            # 40 rows: the gathered fallback
    (2, 1, 16, 2, 256, 1024, [900, 33], 32),
    (1, 1, 32, 8, 128, 32768, [32767], 64),          # split over many blocks
    (8, 1, 32, 8, 128, 4096, [4096, 1, 2, 3, 4, 5, 6, 7], 16),  # one long among short
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("append", [False, True])
def test_decode_kernel_against_reference(shape, append):
  batch, seqlen_q, heads, kv_heads, head_dim, capacity, lengths, page_size = shape
  if append:
    lengths = [min(n, capacity - seqlen_q) for n in lengths]
  q, k_new, v_new, kc, vc, kp, vp, table, seqlens = _inputs(
      sum(lengths) + seqlen_q, batch, seqlen_q, heads, kv_heads, head_dim, capacity, lengths,
      page_size)
  extra = dict(k=k_new, v=v_new) if append else {}
  results = {}
  for name, caches, tbl in (("contiguous", (kc, vc), None), ("paged", (kp, vp), table)):
    for impl in ("kernel", "reference"):
      fn = jax.jit(lambda q, a, b, n, t, e: kvcache.flash_attention_with_kvcache(
          q, a, b, cache_seqlens=n, block_table=t, return_lse=True, implementation=impl, **e))
      results[name, impl] = [np.asarray(x, np.float32) for x in fn(q, *caches, seqlens, tbl,
                                                                   extra)[:2]]
  for name in ("contiguous", "paged"):
    out, lse = results[name, "kernel"]
    ref_out, ref_lse = results[name, "reference"]
    assert np.all(np.isfinite(out)), f"{name}: NaN past the lengths reached the output"
    np.testing.assert_allclose(out, ref_out, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-3, rtol=1e-3)
  # Same keys, same chunks, same splits: the paged call is the contiguous one.
  np.testing.assert_array_equal(results["contiguous", "kernel"][0], results["paged", "kernel"][0])
  forward = kvcache.plan(q, kp, vp, block_table=table, compute_capability=_cc())["forward"]
  rows = seqlen_q * heads // kv_heads
  if rows <= 16 * (2 if head_dim <= 128 else 1) and _cc() in ((8, 0), (9, 0)):
    assert forward.kernel == "sm80-decode", forward


def test_softcap_runs_the_gathered_fallback():
  q, k_new, v_new, kc, vc, kp, vp, table, seqlens = _inputs(
      3, 2, 1, 8, 2, 128, 512, [100, 511], 16)
  forward = kvcache.plan(q, kp, vp, block_table=table, compute_capability=_cc(),
                         softcap=3.0)["forward"]
  assert forward.kernel == "unsupported" and "softcap" in forward.reason
  outs = [np.asarray(kvcache.flash_attention_with_kvcache(
      q, kp, vp, cache_seqlens=seqlens, block_table=table, softcap=3.0, implementation=impl),
      np.float32) for impl in ("kernel", "reference")]
  assert np.all(np.isfinite(outs[0]))
  np.testing.assert_allclose(outs[0], outs[1], atol=2e-2, rtol=2e-2)


def test_append_in_place_on_gpu():
  q, k_new, v_new, kc, vc, kp, vp, table, seqlens = _inputs(
      5, 4, 1, 32, 8, 128, 1024, [0, 5, 100, 1000], 64)
  step = jax.jit(lambda q, a, b, k, v, n: kvcache.flash_attention_with_kvcache(
      q, a, b, cache_seqlens=n, k=k, v=v, block_table=table), donate_argnums=(1, 2))
  compiled = step.lower(q, kp, vp, k_new, v_new, seqlens).compile()
  memory = compiled.memory_analysis()
  cache_bytes = kp.size * 2
  assert memory.alias_size_in_bytes >= 2 * cache_bytes
  assert memory.temp_size_in_bytes < cache_bytes
  hlo = compiled.as_text()
  assert 'custom_call_target="jax_flash2_kv_append"' in hlo  # the append kernel, not scatters
  assert not _cache_copies(hlo, kp), _cache_copies(hlo, kp)
  out, kp2, _ = compiled(q, kp, vp, k_new, v_new, seqlens)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  page, slot = int(table[1, 5 // 64]), 5 % 64
  np.testing.assert_array_equal(np.asarray(kp2[page, slot], np.float32),
                                np.asarray(k_new[1, 0], np.float32))


# The decode kernel's own dequantization (in a process of its own): int8 and
# fp8 caches, contiguous (per-head scales) and paged (per-page scales), every head-dim
# bucket, bfloat16 and float16 q, against the reference on the same stored values.
_QUANTIZED_DECODE = """
import jax, jax.numpy as jnp, numpy as np
from jax_flash2 import kvcache
rng = np.random.default_rng(0)
SHAPES = [  # batch, T, H, K, D, capacity, lengths, page_size
    (4, 1, 32, 8, 128, 2048, [0, 2048, 1, 777], 16),
    (3, 1, 8, 1, 64, 1024, [1024, 5, 300], 64),
    (2, 3, 16, 4, 128, 4096, [17, 4093], 256),       # 12 rows: the 16-key tile
    (2, 4, 32, 4, 128, 1024, [1000, 3], 64),         # 32 rows: the 32-key tile, two m16 tiles
    (2, 1, 16, 2, 256, 1024, [900, 33], 32),
    (1, 1, 32, 8, 128, 32768, [32767], 64),          # many splits
]
for dtype in (jnp.int8, jnp.float8_e4m3fn):
  for q_dtype in (jnp.bfloat16, jnp.float16):
    for batch, t, h, kh, d, cap, lengths, page in SHAPES:
      pages = batch * cap // page + 1
      table = jnp.asarray(rng.permutation(pages)[:batch * cap // page].reshape(batch, -1), jnp.int32)
      q = jnp.asarray(rng.standard_normal((batch, t, h, d)) * 3, q_dtype)
      for paged in (False, True):
        shape = (pages, page, kh, d) if paged else (batch, cap, kh, d)
        scale_shape = (pages, kh) if paged else (kh,)
        ks, vs = (jnp.asarray(rng.uniform(0.01, 0.05, scale_shape), jnp.float32) for _ in range(2))
        raw = [jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2)]
        kc, vc = (kvcache.quantize(x, dtype, s if not paged else s[:, None]) for x, s in zip(raw, (ks, vs)))
        args = dict(cache_seqlens=jnp.asarray(lengths, jnp.int32), block_table=table if paged else None,
                    k_scale=ks, v_scale=vs, return_lse=True)
        plan = kvcache.plan(q, kc, vc, block_table=args["block_table"])["forward"]
        assert plan.kernel == "sm80-decode" and "copy" not in plan.reason, plan
        fn = jax.jit(lambda q, kc, vc, impl: kvcache.flash_attention_with_kvcache(
            q, kc, vc, implementation=impl, **args), static_argnums=3)
        ir = fn.lower(q, kc, vc, "kernel").as_text()
        assert "x" + ("i8" if dtype == jnp.int8 else "f8E4M3FN") + ">" in [
            l for l in ir.splitlines() if "custom_call" in l and "jax_flash2" in l][0]
        (out, lse), (ref, ref_lse) = (fn(q, kc, vc, i) for i in ("kernel", "reference"))
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        assert np.all(np.isfinite(out)), (dtype, q_dtype, d, paged)
        np.testing.assert_allclose(out, ref, atol=2e-2, rtol=2e-2, err_msg=str((dtype, q_dtype, d, t, paged)))
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-3, rtol=2e-3)
print("ok")
"""


def test_quantized_caches_in_the_decode_kernel(tmp_path):
  import subprocess
  import sys

  from conftest import package_env
  env = package_env(XLA_PYTHON_CLIENT_PREALLOCATE="false")
  out = subprocess.run([sys.executable, "-c", _QUANTIZED_DECODE], env=env, capture_output=True,
                       text=True, timeout=600, cwd=tmp_path)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-4000:]


# The append kernel (src/cuda/kv_append.cu) against the XLA scatters it
# replaces (kvcache._append_xla): the same bits in both caches, for every
# cache layout and dtype and for lengths that drop tokens.
_INT32_MAX, _INT32_MIN = int(np.iinfo(np.int32).max), int(np.iinfo(np.int32).min)
_MAX_PAGES = 4


def _append_lengths(capacity, seqlen_new, page_size):
  """cache_seqlens with a reason each: the first position, the last run that
  fits, runs partly and wholly past the capacity, a negative start (tokens
  t >= 2 still land at 0, 1, ...), int32 overflow of cache_seqlens + t, and
  (paged) the runs that the table's special rows send into a page outside
  the pool, to page id -1, and into a page another sequence also uses."""
  lengths = [0, capacity - seqlen_new, capacity - seqlen_new + 2, capacity + 5, -2,
             _INT32_MAX - 1, _INT32_MIN]
  if page_size:
    lengths += [page_size - 2, 2 * page_size + 3, page_size + 8]
  else:
    lengths += [11]
  return lengths


def _append_table(batch, num_pages, page_size, rng):
  """A shuffled block table with the rows _append_lengths pairs with: row 7
  runs from a valid page into one past the pool, row 8 into page id -1, and
  row 9's second page is row 0's first (written at slots 8.. there, row 0 at
  slots 0..4, so no slot is written twice)."""
  table = rng.permutation(num_pages)[:batch * _MAX_PAGES].reshape(batch, _MAX_PAGES)
  table[7, 1] = num_pages + 3
  table[8, 2] = -1
  table[9, 1] = table[0, 0]
  return table.astype(np.int32)


def _random_cache(shape, dtype, rng):
  if jnp.dtype(dtype) in (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn)):
    return jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8).view(dtype))
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _bits(x):
  return np.asarray(x).view(np.uint8)


# (cache dtype, k dtype, scales per page): same-dtype caches, then int8 and
# fp8 caches from every k dtype with [K] and (paged) [num_pages, K] scales.
_APPEND_DTYPES = [(d, d, False) for d in (jnp.bfloat16, jnp.float16, jnp.float32)] + [
    (c, s, per_page) for c in (jnp.int8, jnp.float8_e4m3fn)
    for s in (jnp.bfloat16, jnp.float16, jnp.float32) for per_page in (False, True)]
# (page_size, T, D): D = 40 takes the 8-element vector copies (five per row),
# D = 20 the element-wise ones.
_APPEND_SHAPES = [(0, 1, 40), (0, 5, 40), (16, 1, 40), (16, 5, 40), (64, 1, 40), (64, 5, 40),
                  (0, 5, 20), (16, 5, 20)]
_APPEND_CASES = [shape + dtypes for shape in _APPEND_SHAPES for dtypes in _APPEND_DTYPES
                 if shape[0] or not dtypes[2]]  # [num_pages, K] scales only for paged caches


@pytest.mark.parametrize("page_size,seqlen_new,head_dim,cache_dtype,k_dtype,per_page",
                         _APPEND_CASES)
def test_append_kernel_matches_the_xla_scatter(page_size, seqlen_new, head_dim, cache_dtype,
                                               k_dtype, per_page):
  rng = np.random.default_rng(page_size * 1000 + seqlen_new * 100 + head_dim)
  kv_heads = 3
  if page_size:
    capacity = _MAX_PAGES * page_size
    lengths = _append_lengths(capacity, seqlen_new, page_size)
    batch = len(lengths)
    num_pages = batch * _MAX_PAGES + 3
    table = jnp.asarray(_append_table(batch, num_pages, page_size, rng))
    cache_shape = (num_pages, page_size, kv_heads, head_dim)
  else:
    capacity = 37
    lengths = _append_lengths(capacity, seqlen_new, 0)
    batch, num_pages, table = len(lengths), 0, None
    cache_shape = (batch, capacity, kv_heads, head_dim)
  seqlens = jnp.asarray(lengths, jnp.int32)
  kc, vc = (_random_cache(cache_shape, cache_dtype, rng) for _ in range(2))
  new = [rng.standard_normal((batch, seqlen_new, kv_heads, head_dim)).astype(np.float32) * 3
         for _ in range(2)]
  # Row 0 lands at position 0: NaN of both signs and infinities reach the cache.
  new[0][0, 0, 0, :4] = [np.nan, -np.nan, np.inf, -np.inf]
  new[1][0, 0, 1, 5] = np.nan
  k, v = (jnp.asarray(x, k_dtype) for x in new)
  quantized = jnp.dtype(cache_dtype) != jnp.dtype(k_dtype)
  scales = (None, None)
  if quantized:
    # From 0.005 (|x / scale| up to ~2500: both cache types saturate) to 0.5
    # (small values round into fp8's subnormals).
    shape = (num_pages, kv_heads) if per_page else (kv_heads,)
    scales = tuple(jnp.asarray(rng.uniform(0.005, 0.5, shape), jnp.float32) for _ in range(2))
  abstract = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)
  q = jax.ShapeDtypeStruct((batch, seqlen_new, kv_heads, head_dim), k_dtype)
  # Abstract lengths and table: _check leaves their values unchecked, as traced ones.
  layout = kvcache._check(q, kc, vc, abstract(seqlens), k, v, abstract(table), *scales)

  def route(fn):
    return jax.jit(lambda kc, vc, k, v, n, t, ks, vs: fn(kc, vc, k, v, n, t, layout, ks, vs))

  args = (kc, vc, k, v, seqlens, table) + scales
  kernel, xla = route(kvcache._append), route(kvcache._append_xla)
  assert "jax_flash2_kv_append" in kernel.lower(*args).as_text()
  before = [_bits(kc), _bits(vc)]
  got, want = kernel(*args), xla(*args)
  for name, g, w, old, cache in zip(("k_cache", "v_cache"), got, want, before, (kc, vc)):
    np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)
    np.testing.assert_array_equal(_bits(cache), old, err_msg=f"{name} changed without donation")
  assert not np.array_equal(_bits(got[0]), before[0]), "nothing was appended"


def _cache_copies(hlo: str, cache) -> list[str]:
  """Lines of compiled HLO whose instruction, a copy (or a fusion named for
  one), makes an array of the cache's shape."""
  dtype = {"bfloat16": "bf16", "float16": "f16", "float32": "f32", "int8": "s8",
           "float8_e4m3fn": "f8e4m3fn"}[jnp.dtype(cache.dtype).name]
  shape = re.escape(f"{dtype}[{','.join(map(str, cache.shape))}]")
  copy = re.compile(r"^\s*(ROOT )?%?[\w.-]*copy[\w.-]* = \(?" + shape)
  return [line for line in hlo.splitlines() if copy.match(line)]


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.int8])
def test_append_kernel_writes_donated_caches_in_place(cache_dtype):
  rng = np.random.default_rng(7)
  batch, seqlen_new, kv_heads, head_dim, page_size, num_pages = 4, 1, 8, 128, 64, 21
  table = jnp.asarray(rng.permutation(num_pages)[:batch * 5].reshape(batch, 5), jnp.int32)
  kc, vc = (_random_cache((num_pages, page_size, kv_heads, head_dim), cache_dtype, rng)
            for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((batch, seqlen_new, kv_heads, head_dim)), jnp.bfloat16)
          for _ in range(2))
  scales = (None, None)
  if cache_dtype == jnp.int8:
    scales = tuple(jnp.asarray(rng.uniform(0.01, 0.05, (kv_heads,)), jnp.float32)
                   for _ in range(2))
  seqlens = jnp.asarray([0, 63, 64, 300], jnp.int32)
  q = jax.ShapeDtypeStruct((batch, seqlen_new, 16, head_dim), jnp.bfloat16)
  layout = kvcache._check(q, kc, vc, seqlens, k, v, table, *scales)
  want = jax.jit(lambda *a: kvcache._append_xla(*a[:6], layout, *a[6:]))(
      kc, vc, k, v, seqlens, table, *scales)
  want = [_bits(x) for x in want]
  step = jax.jit(lambda kc, vc, k, v, n, ks, vs: kvcache._append(kc, vc, k, v, n, table, layout,
                                                                  ks, vs), donate_argnums=(0, 1))
  compiled = step.lower(kc, vc, k, v, seqlens, *scales).compile()
  hlo = compiled.as_text()
  calls = [line for line in hlo.splitlines() if 'custom_call_target="jax_flash2_kv_append"' in line]
  assert len(calls) == 1 and "output_to_operand_aliasing" in calls[0], calls
  assert "(0, {})" in calls[0] and "(1, {})" in calls[0], calls
  assert "input_output_alias" in hlo.splitlines()[0], hlo.splitlines()[0]
  assert not _cache_copies(hlo, kc), _cache_copies(hlo, kc)
  memory = compiled.memory_analysis()
  assert memory.alias_size_in_bytes >= 2 * kc.nbytes
  assert memory.temp_size_in_bytes < kc.nbytes
  got = compiled(kc, vc, k, v, seqlens, *scales)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(_bits(g), w)
