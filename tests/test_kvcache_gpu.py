"""flash_attention_with_kvcache on CUDA: the decode kernel with per-sequence
lengths and block tables (and the gathered fallback), against the reference
on the same bfloat16 values; skipped without a GPU."""

from __future__ import annotations

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
