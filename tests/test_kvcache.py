"""flash_attention_with_kvcache against the float64 oracle, per backend.

Every case runs the reference and the kernels of the default device
(implementation="kernel": the CPU kernels here) on a contiguous and a paged
cache holding the same keys, with NaN in every slot past a sequence's length,
in unused pages and in the append slots before the append.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from jax_flash2 import kvcache
from conftest import package_env
from oracle import oracle

ON_GPU = jax.default_backend() == "gpu"
IMPLEMENTATIONS = ("reference", "kernel")
PAGE = 16


def _oracle(q, keys, values, lengths, **options):
  """out [B, T, H, D], lse [B, H, T] in float64: sequence b attends to its
  first lengths[b] keys, the diagonal aligned to its end."""
  q = np.asarray(q, np.float64)
  batch, seqlen_q, num_heads, head_dim = q.shape
  outs, lses = [], []
  for b in range(batch):
    n = int(lengths[b])
    if n == 0:
      outs.append(np.zeros((1, seqlen_q, num_heads, head_dim)))
      lses.append(np.full((1, num_heads, seqlen_q), -np.inf))
      continue
    slopes = options.get("alibi_slopes")
    opts = dict(options, alibi_slopes=None if slopes is None else np.asarray(slopes)[None])
    kb, vb = (np.asarray(x[b:b + 1, :n], np.float64) for x in (keys, values))
    (out, lse), _ = oracle(q[b:b + 1], kb, vb, np.zeros_like(q[b:b + 1]),
                           np.zeros((1, num_heads, seqlen_q)), **opts)
    # A query that sees no key: 0 out, LSE -inf (the oracle's empty rows).
    outs.append(np.where(np.isfinite(lse).transpose(0, 2, 1)[..., None], out, 0.0))
    lses.append(lse)
  return np.concatenate(outs), np.concatenate(lses)


def _paged(cache, max_pages, rng, extra_pages=3):
  """The contiguous cache [B, S_max, K, D] as a shuffled page pool (NaN in the
  unused pages) and its block table; every table entry a sequence does not
  use points to a NaN page."""
  batch = cache.shape[0]
  num_pages = batch * max_pages + extra_pages
  order = rng.permutation(num_pages)
  pool = np.full((num_pages, PAGE) + cache.shape[2:], np.nan, np.float32)
  table = order[:batch * max_pages].reshape(batch, max_pages).astype(np.int32)
  for b in range(batch):
    for j in range(max_pages):
      pool[table[b, j]] = cache[b, j * PAGE:(j + 1) * PAGE]
  return pool, table


def _case(seed, *, batch=3, seqlen_q=1, heads=4, kv_heads=2, head_dim=16, max_pages=3,
          lengths=None, append=False):
  rng = np.random.default_rng(seed)
  capacity = max_pages * PAGE
  new = seqlen_q if append else 0
  if lengths is None:
    lengths = [0, capacity - new, (capacity - new) // 2 + 1][:batch]
  lengths = np.asarray(lengths, np.int32)
  q = rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(np.float32)
  keys = rng.standard_normal((batch, capacity, kv_heads, head_dim)).astype(np.float32)
  values = rng.standard_normal((batch, capacity, kv_heads, head_dim)).astype(np.float32)
  k_new = v_new = None
  if append:
    k_new = rng.standard_normal((batch, seqlen_q, kv_heads, head_dim)).astype(np.float32)
    v_new = rng.standard_normal((batch, seqlen_q, kv_heads, head_dim)).astype(np.float32)
    for b, n in enumerate(lengths):  # what the oracle sees after the append
      keys[b, n:n + seqlen_q] = k_new[b]
      values[b, n:n + seqlen_q] = v_new[b]
  visible = lengths + new
  k_cache, v_cache = keys.copy(), values.copy()
  for b, n in enumerate(lengths):  # garbage past the length (the append slots included)
    k_cache[b, n:] = np.nan
    v_cache[b, n:] = np.nan
  return dict(q=q, keys=keys, values=values, k_cache=k_cache, v_cache=v_cache, k_new=k_new,
              v_new=v_new, lengths=lengths, visible=visible, rng=rng, max_pages=max_pages)


def _run(case, implementation, paged, **options):
  """(out, lse, k_cache, v_cache as contiguous numpy) of one call."""
  rng = np.random.default_rng(0)
  kc, vc = case["k_cache"], case["v_cache"]
  table = None
  if paged:
    kc, table = _paged(kc, case["max_pages"], rng)
    vc, _ = _paged(vc, case["max_pages"], np.random.default_rng(0))
  arrays = dict(cache_seqlens=jnp.asarray(case["lengths"]))
  if table is not None:
    arrays["block_table"] = jnp.asarray(table)
  if case["k_new"] is not None:
    arrays.update(k=jnp.asarray(case["k_new"]), v=jnp.asarray(case["v_new"]))
  if options.get("alibi_slopes") is not None:
    arrays["alibi_slopes"] = jnp.asarray(options.pop("alibi_slopes"))

  @jax.jit  # one compilation per call (eager op-by-op dispatch is slower here)
  def call(q, kc, vc, arrays):
    return jax_flash2.flash_attention_with_kvcache(q, kc, vc, return_lse=True,
                                                   implementation=implementation, **arrays,
                                                   **options)

  result = call(jnp.asarray(case["q"]), jnp.asarray(kc), jnp.asarray(vc), arrays)
  out, lse = result[:2]
  caches = result[2:]
  if caches and paged:
    caches = tuple(np.asarray(c)[table].reshape(case["keys"].shape) for c in caches)
  return np.asarray(out), np.asarray(lse), tuple(np.asarray(c) for c in caches)


def _close(actual, expected, atol=2e-5):
  np.testing.assert_allclose(actual, expected, atol=atol, rtol=2e-5)


# (seqlen_q, heads, kv_heads, append, options): odd T, GQA / MQA / MHA, every option.
CASES = [
    (1, 4, 2, False, {}),
    (1, 8, 1, True, {}),
    (3, 4, 4, True, {}),
    (5, 6, 2, False, {}),
    (16, 4, 2, True, {}),
    (7, 4, 1, True, dict(causal=False)),
    (3, 4, 2, True, dict(window_size=(9, 0))),
    (5, 4, 2, False, dict(causal=False, window_size=(6, 3))),
    (3, 4, 2, True, dict(softcap=2.5)),
    (1, 4, 2, False, dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625], np.float32))),
    (9, 4, 2, True, dict(alibi_slopes=np.array([0.3, 0.2, 0.1, 0.05], np.float32),
                          softmax_scale=0.3)),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("index", range(len(CASES)))
def test_against_oracle(implementation, index):
  seqlen_q, heads, kv_heads, append, options = CASES[index]
  case = _case(100 + index, seqlen_q=seqlen_q, heads=heads, kv_heads=kv_heads, append=append)
  oracle_options = dict(causal=options.get("causal", True),
                        window_size=options.get("window_size", (-1, -1)),
                        softcap=options.get("softcap", 0.0),
                        softmax_scale=options.get("softmax_scale"),
                        alibi_slopes=options.get("alibi_slopes"))
  expected_out, expected_lse = _oracle(case["q"], case["keys"], case["values"], case["visible"],
                                       **oracle_options)
  # The reference compiles slowly on CPU (~2 s a program): one layout per
  # case there, alternating; the kernels run both and compare them.
  layouts = (False, True) if implementation == "kernel" else (index % 2 == 1,)
  results = [_run(case, implementation, paged, **options) for paged in layouts]
  for out, lse, caches in results:
    assert np.all(np.isfinite(out)), "NaN from an unused slot or page reached the output"
    _close(out, expected_out)
    _close(lse, expected_lse)
    if append:  # the caches hold the appended tokens where the oracle put them
      for cache, full in zip(caches, (case["keys"], case["values"])):
        for b, n in enumerate(case["visible"]):
          np.testing.assert_array_equal(cache[b, :n], full[b, :n])
  if len(results) == 2:  # same keys in the same order, the same math: bit for bit
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])


def test_empty_sequence_and_query_before_the_cache():
  """Length 0 without append: 0 out, LSE -inf; T > length without append:
  the first T - length queries see no key."""
  case = _case(7, seqlen_q=5, lengths=[0, 2, 40])
  for implementation in IMPLEMENTATIONS:
    out, lse, _ = _run(case, implementation, True)
    assert np.all(out[0] == 0) and np.all(lse[0] == -np.inf)
    assert np.all(out[1, :3] == 0) and np.all(lse[1, :, :3] == -np.inf)
    assert np.all(np.isfinite(lse[1, :, 3:])) and np.all(np.isfinite(lse[2]))


def test_bfloat16_within_plain_attention_error():
  """bf16 inputs: error against the float64 oracle within 2x (plus slack) of
  a plain bf16 attention's."""
  from oracle import assert_close_to_oracle, naive_same_dtype
  case = _case(11, batch=2, seqlen_q=3, append=True, lengths=[5, 40])
  bf16 = {name: (None if case[name] is None else
                 np.asarray(jnp.asarray(case[name], jnp.bfloat16).astype(jnp.float32)))
          for name in ("q", "keys", "values", "k_new", "v_new")}
  expected, _ = _oracle(bf16["q"], bf16["keys"], bf16["values"], case["visible"], causal=True)
  cache = jnp.asarray(case["k_cache"], jnp.bfloat16), jnp.asarray(case["v_cache"], jnp.bfloat16)
  for implementation in IMPLEMENTATIONS:
    out, _, _ = jax_flash2.flash_attention_with_kvcache(
        jnp.asarray(bf16["q"], jnp.bfloat16), *cache, cache_seqlens=jnp.asarray(case["lengths"]),
        k=jnp.asarray(bf16["k_new"], jnp.bfloat16), v=jnp.asarray(bf16["v_new"], jnp.bfloat16),
        implementation=implementation)
    for b, n in enumerate(case["visible"]):
      base, _ = naive_same_dtype(*(jnp.asarray(x[b:b + 1, :m], jnp.bfloat16) for x, m in
                                   ((bf16["q"], 3), (bf16["keys"], n), (bf16["values"], n))),
                                 causal=True)
      assert_close_to_oracle(f"{implementation} out[{b}]", out[b:b + 1].astype(jnp.float32),
                             expected[b:b + 1], base.astype(jnp.float32), jnp.bfloat16)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_no_recompilation_when_lengths_change(implementation):
  case = _case(3, seqlen_q=1, append=True)
  step = jax.jit(functools.partial(jax_flash2.flash_attention_with_kvcache,
                                   implementation=implementation))
  kc, vc = jnp.asarray(case["k_cache"]), jnp.asarray(case["v_cache"])
  q, k, v = (jnp.asarray(case[n]) for n in ("q", "k_new", "v_new"))
  outs = []
  for lengths in ([0, 1, 2], [10, 30, 47], [5, 5, 5]):
    out, kc2, _ = step(q, kc, vc, cache_seqlens=jnp.asarray(lengths, jnp.int32), k=k, v=v)
    outs.append(np.asarray(out))
  assert step._cache_size() == 1
  assert not np.array_equal(outs[0], outs[1])  # the lengths did take effect


@pytest.mark.parametrize("paged", [False, True])
def test_append_in_place_when_donated(paged):
  """Under jit with the caches donated, the append writes into them: the
  caches' bytes are aliased to the outputs, the program keeps no temporary the
  size of a cache, and its HLO copies no cache."""
  batch, capacity, kv_heads, head_dim = 4, 1024, 2, 64
  if paged:
    shape, table = (batch * capacity // PAGE, PAGE, kv_heads, head_dim), jnp.arange(
        batch * capacity // PAGE, dtype=jnp.int32).reshape(batch, -1)
  else:
    shape, table = (batch, capacity, kv_heads, head_dim), None
  # A dtype each platform's kernels read in place: float32 on CUDA takes a
  # gathered copy by design, and XLA:CPU's scatter widens bfloat16 to float32.
  dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
  kc = jnp.zeros(shape, dtype)
  q = jnp.ones((batch, 1, 4, head_dim), dtype)
  k = jnp.ones((batch, 1, kv_heads, head_dim), dtype)

  def step(q, kc, vc, k, v, lengths):
    return jax_flash2.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lengths, k=k, v=v,
                                                   block_table=table)

  lowered = jax.jit(step, donate_argnums=(1, 2)).lower(q, kc, kc, k, k,
                                                       jnp.zeros((batch,), jnp.int32))
  compiled = lowered.compile()
  cache_bytes = kc.size * kc.dtype.itemsize
  memory = compiled.memory_analysis()
  if memory is not None:
    assert memory.alias_size_in_bytes >= 2 * cache_bytes
    assert memory.temp_size_in_bytes < cache_bytes
  text = compiled.as_text()
  dims = ",".join(str(d) for d in shape)
  copies = [line for line in text.splitlines()
            if f"[{dims}]" in line and (" copy(" in line or "copy-start" in line)]
  assert not copies, copies


@pytest.mark.parametrize("implementation,dtype,per_page", [
    ("kernel", jnp.int8, False), ("kernel", jnp.int8, True), ("kernel", jnp.float8_e4m3fn, False),
    ("kernel", jnp.float8_e4m3fn, True), ("reference", jnp.int8, True),
    ("reference", jnp.float8_e4m3fn, False)])
def test_quantized_cache_against_oracle_on_dequantized_values(implementation, dtype, per_page):
  case = _case(21, seqlen_q=3, append=True, lengths=[4, 30, 45])
  rng = np.random.default_rng(5)
  kc, table = _paged(case["k_cache"], case["max_pages"], rng)
  vc, _ = _paged(case["v_cache"], case["max_pages"], np.random.default_rng(5))
  num_pages, kv_heads = kc.shape[0], kc.shape[2]
  scale_shape = (num_pages, kv_heads) if per_page else (kv_heads,)
  # int8 steps of 0.035-0.05: the cache's values (|x| < 4.5) do not saturate.
  k_scale = jnp.asarray(rng.uniform(0.035, 0.05, scale_shape), jnp.float32)
  v_scale = jnp.asarray(rng.uniform(0.035, 0.05, scale_shape), jnp.float32)
  page_of = lambda s: (s[:, None, :, None] if per_page else s[None, None, :, None])
  kq = kvcache.quantize(jnp.asarray(kc), dtype, k_scale if not per_page else k_scale[:, None])
  vq = kvcache.quantize(jnp.asarray(vc), dtype, v_scale if not per_page else v_scale[:, None])
  out, lse, kq2, vq2 = jax_flash2.flash_attention_with_kvcache(
      jnp.asarray(case["q"]), kq, vq, cache_seqlens=jnp.asarray(case["lengths"]),
      k=jnp.asarray(case["k_new"]), v=jnp.asarray(case["v_new"]), block_table=jnp.asarray(table),
      k_scale=k_scale, v_scale=v_scale, return_lse=True, implementation=implementation)
  # The oracle on the dequantized cache after the append, gathered per sequence.
  keys, values = (np.asarray(c.astype(jnp.float32) * page_of(s))[table].reshape(
      case["keys"].shape) for c, s in ((kq2, k_scale), (vq2, v_scale)))
  expected_out, expected_lse = _oracle(case["q"], keys, values, case["visible"], causal=True)
  assert np.all(np.isfinite(np.asarray(out)))
  _close(np.asarray(out), expected_out, atol=1e-4)
  _close(np.asarray(lse), expected_lse, atol=1e-4)
  # The appended tokens were quantized with their page's scale: within half
  # an int8 step, or e4m3's 2^-4 relative rounding, of k_new.
  for b, n in enumerate(case["lengths"]):
    if dtype == jnp.int8:
      np.testing.assert_allclose(keys[b, n:n + 3], case["k_new"][b], rtol=0,
                                 atol=0.501 * float(np.max(k_scale)))
    else:
      np.testing.assert_allclose(keys[b, n:n + 3], case["k_new"][b], rtol=0.0625,
                                 atol=float(np.max(k_scale)) * 2.0**-9)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU kernels' path (on CUDA "
                    "the decode kernel reads it: test_kvcache_gpu.py)")
@pytest.mark.parametrize("dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_cpu_kernels_read_the_quantized_cache_itself(dtype):
  """The CPU kernel takes the int8 / fp8 contiguous cache and its [K] scales
  as operands (no dequantized copy of the cache in the program) and matches
  the oracle on the dequantized values; the fp8 slots past each length hold
  NaN, which never reaches the output."""
  case = _case(23, seqlen_q=2, append=False, lengths=[5, 17, 33])
  kv_heads = case["k_cache"].shape[2]
  rng = np.random.default_rng(9)
  k_scale, v_scale = (jnp.asarray(rng.uniform(0.035, 0.05, (kv_heads,)), jnp.float32)
                      for _ in range(2))
  kq, vq = (kvcache.quantize(jnp.asarray(case[n]), dtype, s)
            for n, s in (("k_cache", k_scale), ("v_cache", v_scale)))
  fn = jax.jit(lambda q, kq, vq, n: jax_flash2.flash_attention_with_kvcache(
      q, kq, vq, cache_seqlens=n, k_scale=k_scale, v_scale=v_scale, return_lse=True))
  args = (jnp.asarray(case["q"]), kq, vq, jnp.asarray(case["lengths"]))
  program = fn.lower(*args).as_text()
  element = "i8" if dtype == jnp.int8 else "f8E4M3FN"
  cache_type = "x".join(map(str, kq.shape))
  calls = [line for line in program.splitlines() if "custom_call" in line and "jax_flash2" in line]
  assert len(calls) == 1 and f"tensor<{cache_type}x{element}>" in calls[0], calls
  assert f"tensor<{cache_type}xf32>" not in program  # no float copy of the cache
  out, lse = fn(*args)
  keys, values = (np.asarray(c.astype(jnp.float32) * s[None, None, :, None])
                  for c, s in ((kq, k_scale), (vq, v_scale)))
  expected_out, expected_lse = _oracle(case["q"], keys, values, case["visible"], causal=True)
  assert np.all(np.isfinite(np.asarray(out)))
  _close(np.asarray(out), expected_out, atol=1e-4)
  _close(np.asarray(lse), expected_lse, atol=1e-4)


@pytest.mark.skipif(jax_flash2._ext.cuda_ext is None,
                    reason="needs the CUDA extension to lower for CUDA")
def test_cuda_lowering_sizes_the_workspace_for_the_pages():
  """Lowered for CUDA, a paged call's workspace is planned for S = max_pages *
  page_size (the block table's width, not any other operand's)."""
  from jax_flash2 import _lowering
  batch, heads, kv_heads, dim, page, max_pages = 8, 32, 8, 128, 16, 256
  q = jnp.ones((batch, 1, heads, dim), jnp.bfloat16)
  pool = jnp.ones((64, page, kv_heads, dim), jnp.bfloat16)
  table = jnp.zeros((batch, max_pages), jnp.int32)
  fn = jax.jit(lambda q, pool, table, n: jax_flash2.flash_attention_with_kvcache(
      q, pool, pool, cache_seqlens=n, block_table=table))
  ir = fn.trace(q, pool, table, jnp.zeros((batch,), jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  (results,) = re.findall(r"stablehlo\.custom_call @jax_flash2_\w+\(.*\) -> \((.*)\)", ir)
  workspace = int(re.findall(r"tensor<(\d+)xui8>", results)[0])
  sm_count, cc_major = _lowering._gpu_plan()
  expected = jax_flash2._ext.cuda_ext.workspace_bytes(
      False, batch, 1, max_pages * page, heads, kv_heads, dim, -1, 0, sm_count, False, cc_major)
  assert workspace == max(expected, 1) and expected > 0, (workspace, expected)


_QUANT_PLAN_AND_LOWERING = """
import jax, jax.numpy as jnp
import jax_flash2
from jax_flash2 import kvcache
q = jnp.ones((8, 1, 32, 128), jnp.bfloat16)
pool = jnp.ones((64, 16, 8, 128), jnp.int8)
table = jnp.zeros((8, 256), jnp.int32)
scale = jnp.ones((64, 8), jnp.float32)
forward = kvcache.plan(q, pool, pool, block_table=table)["forward"]
print(forward.kernel, "|", forward.reason)
if jax_flash2._ext.cuda_ext is not None:  # lowering for CUDA needs the extension
  fn = jax.jit(lambda q, pool, table, n: kvcache.flash_attention_with_kvcache(
      q, pool, pool, cache_seqlens=n, block_table=table, k_scale=scale, v_scale=scale))
  ir = fn.trace(q, pool, table, jnp.zeros((8,), jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  print([l for l in ir.splitlines() if "custom_call @jax_flash2" in l][0])
"""


@pytest.mark.parametrize("switch", [None, "0"])
def test_plan_and_cuda_lowering_of_a_quantized_cache(switch, tmp_path):
  """On CUDA the decode kernel reads an int8 cache itself: the plan says so,
  and the call lowered for CUDA hands the kernel the int8 pool and the
  kv_scales operand [B, 2, max_pages, K]. Under JAX_FLASH2_DECODE_QUANT=0
  (read once per process) the plan names the kernel that reads XLA's
  bfloat16 copy, and the call passes that copy and a zero-size stand-in."""
  env = package_env(JAX_PLATFORMS="cpu", **({"JAX_FLASH2_DECODE_QUANT": switch} if switch else {}))
  out = subprocess.run([sys.executable, "-c", _QUANT_PLAN_AND_LOWERING], env=env,
                       capture_output=True, text=True, timeout=300, check=True,
                       cwd=tmp_path).stdout.splitlines()
  kernel, reason = (x.strip() for x in out[0].split("|"))
  assert kernel == "sm80-decode", out
  if not switch:
    assert "copy" not in reason, out
  else:
    assert "bfloat16 copy" in reason and "JAX_FLASH2_DECODE_QUANT=0" in reason, out
  if jax_flash2._ext.cuda_ext is None:
    return
  operands = re.findall(r"tensor<[^>]*>", out[1].split("->")[0])
  if not switch:
    assert "tensor<64x16x8x128xi8>" in operands and "tensor<8x2x256x8xf32>" in operands, out
  else:
    assert "tensor<64x16x8x128xbf16>" in operands and "tensor<0xf32>" in operands, out


def test_vmap_of_contiguous_kernel_call():
  case = _case(31, seqlen_q=3, append=False, lengths=[3, 9, 20])
  q, kc, vc = (jnp.asarray(case[n]) for n in ("q", "k_cache", "v_cache"))
  lengths = jnp.asarray(case["lengths"])
  fn = lambda q, kc, vc, n: jax_flash2.flash_attention_with_kvcache(
      q[None], kc[None], vc[None], cache_seqlens=n[None])[0]
  batched = jax.vmap(fn)(q, kc, vc, lengths)
  direct = jax_flash2.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lengths)
  np.testing.assert_array_equal(np.asarray(batched), np.asarray(direct))


def _args(**over):
  case = _case(1, seqlen_q=2, append=True)
  kc, table = _paged(case["k_cache"], case["max_pages"], np.random.default_rng(0))
  args = dict(q=jnp.asarray(case["q"]), k_cache=jnp.asarray(kc), v_cache=jnp.asarray(kc),
              cache_seqlens=jnp.asarray([0, 5, 46], jnp.int32), k=jnp.asarray(case["k_new"]),
              v=jnp.asarray(case["v_new"]), block_table=jnp.asarray(table))
  args.update(over)
  return args


def _call(args):
  args = dict(args)
  return jax_flash2.flash_attention_with_kvcache(args.pop("q"), args.pop("k_cache"),
                                                 args.pop("v_cache"), **args)


@pytest.mark.parametrize("over,error,match", [
    (dict(cache_seqlens=jnp.asarray([0, 5, 47], jnp.int32)), ValueError,
     r"cache_seqlens must be in \[0, 46\]"),
    (dict(cache_seqlens=jnp.asarray([-1, 5, 4], jnp.int32)), ValueError, "cache_seqlens"),
    (dict(cache_seqlens=jnp.asarray([0, 5, 4], jnp.int16)), TypeError, "cache_seqlens.dtype"),
    (dict(cache_seqlens=jnp.asarray([0, 5], jnp.int32)), ValueError, "cache_seqlens.shape"),
    (dict(block_table=jnp.asarray([[0, 1, 2], [3, 4, 99], [5, 6, 7]], jnp.int32)), None, None),
    (dict(block_table=jnp.asarray([[0, 1, 2], [3, 4, 5], [6, 7, 99]], jnp.int32)), ValueError,
     r"block_table\[2, 2\] = 99"),
    (dict(block_table=jnp.asarray([[0, 1, 2], [-1, 4, 5], [6, 7, 8]], jnp.int32)), ValueError,
     r"block_table\[1, 0\] = -1"),
    (dict(block_table=jnp.zeros((3, 3), jnp.uint32)), TypeError, "block_table.dtype"),
    (dict(k_cache=jnp.zeros((12, 8, 2, 16)), v_cache=jnp.zeros((12, 8, 2, 16))), ValueError,
     "page_size"),
    (dict(k=None), ValueError, "k and v"),
    (dict(k_cache=jnp.zeros((12, 16, 2, 16), jnp.int8), v_cache=jnp.zeros((12, 16, 2, 16),
                                                                          jnp.int8)),
     ValueError, "needs k_scale"),
    (dict(k_scale=jnp.ones((2,))), ValueError, "k_scale / v_scale"),
    (dict(v_cache=jnp.zeros((12, 16, 2, 16), jnp.float16)), TypeError, "share one dtype"),
])
def test_bad_arguments_raise_clearly(over, error, match):
  args = _args(**over)
  if error is None:  # entry 2 of sequence 1 is past its 7 keys: never read, not checked
    _call(args)
    return
  with pytest.raises(error, match=match):
    _call(args)


@pytest.mark.parametrize("implementation", ["kernel", "reference"])
def test_forward_only(implementation):
  """Every route (the kernels, CUDA's gathered copy for float32, the
  reference) refuses a gradient alike, by name."""
  case = _case(2)
  q, kc, vc = (jnp.asarray(case[n]) for n in ("q", "k_cache", "v_cache"))
  fn = lambda q, kc: jax_flash2.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=jnp.asarray(case["lengths"]),
      implementation=implementation).sum()
  for argnum in (0, 1):
    with pytest.raises(NotImplementedError, match="flash_attention_with_kvcache is forward only"):
      jax.grad(fn, argnums=argnum)(q, kc)


@pytest.mark.parametrize("index", [0, 4, 6, 8, 9, 10])
def test_gathered_fallback_against_oracle(index):
  """The path CUDA takes where the decode kernel cannot serve a call
  (flash_attention over the right-aligned visible keys), run on the CPU
  kernels here."""
  seqlen_q, heads, kv_heads, append, options = CASES[index]
  case = _case(200 + index, seqlen_q=seqlen_q, heads=heads, kv_heads=kv_heads, append=False)
  expected_out, expected_lse = _oracle(
      case["q"], case["keys"], case["values"], case["lengths"],
      causal=options.get("causal", True), window_size=options.get("window_size", (-1, -1)),
      softcap=options.get("softcap", 0.0), softmax_scale=options.get("softmax_scale"),
      alibi_slopes=options.get("alibi_slopes"))
  pool, table = _paged(case["k_cache"], case["max_pages"], np.random.default_rng(1))
  vpool, _ = _paged(case["v_cache"], case["max_pages"], np.random.default_rng(1))
  q = jnp.asarray(case["q"])
  view = jax.ShapeDtypeStruct((3, case["max_pages"] * PAGE, kv_heads, q.shape[3]), q.dtype)
  config = jax_flash2.api.make_config(
      q, view, view, causal=options.get("causal", True),
      window_size=options.get("window_size", (-1, -1)), softcap=options.get("softcap", 0.0),
      softmax_scale=options.get("softmax_scale"), alibi_slopes=options.get("alibi_slopes"))
  layout = kvcache._Layout(3, seqlen_q, kv_heads, case["max_pages"] * PAGE, PAGE, pool.shape[0],
                           False, False)
  slopes = options.get("alibi_slopes")
  out, lse = jax.jit(lambda *a: kvcache._kernel_gathered(*a[:5], config, layout, a[5]))(
      q, jnp.asarray(pool), jnp.asarray(vpool), jnp.asarray(case["lengths"]), jnp.asarray(table),
      None if slopes is None else jnp.asarray(slopes))
  assert np.all(np.isfinite(np.asarray(out)))
  _close(np.asarray(out), expected_out)
  _close(np.asarray(lse), expected_lse)


def test_plan_names_the_decode_kernel():
  q = jax.ShapeDtypeStruct((8, 1, 32, 128), jnp.bfloat16)
  pool = jax.ShapeDtypeStruct((2048, 16, 8, 128), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((8, 256), jnp.int32)
  for cc in ((8, 0), (8, 6), (9, 0)):
    forward = kvcache.plan(q, pool, pool, block_table=table, compute_capability=cc)["forward"]
    assert forward.kernel == "sm80-decode" and "KV cache" in forward.reason
  # Lengths are known only on the device: splits of at most 2048 keys of the
  # 4096-key capacity here, at any batch, so that short sequences leave no SM idle.
  wide = jax.ShapeDtypeStruct((64, 1, 32, 128), jnp.bfloat16)
  wide_table = jax.ShapeDtypeStruct((64, 256), jnp.int32)
  forward = kvcache.plan(wide, pool, pool, block_table=wide_table)["forward"]
  assert forward.splits >= 2 and forward.grid == (forward.splits, 64, 8)
  # The small-smem tile (16-key warp steps, three blocks per SM) where it
  # holds the packed rows; a batch of one still gets 4 blocks per SM over
  # S_max (132 SMs, 8 K/V heads: 66 splits asked, whole 64-key shares of 4096).
  one = jax.ShapeDtypeStruct((1, 1, 32, 128), jnp.bfloat16)
  forward = kvcache.plan(one, pool, pool, block_table=jax.ShapeDtypeStruct((1, 256), jnp.int32))
  forward = forward["forward"]
  assert forward.tile["row"] == "small_smem" and forward.tile["warp_keys"] == 16, forward
  assert forward.splits == 4096 // (16 * 4) and forward.grid == (64, 1, 8), forward
  rows32 = jax.ShapeDtypeStruct((8, 8, 32, 128), jnp.bfloat16)  # 32 packed rows > 16
  forward = kvcache.plan(rows32, pool, pool, block_table=table)["forward"]
  assert forward.kernel == "sm80-decode" and forward.tile["row"] == "default", forward
  too_many = jax.ShapeDtypeStruct((8, 9, 32, 128), jnp.bfloat16)  # 36 packed rows > 32
  forward = kvcache.plan(too_many, pool, pool, block_table=table)["forward"]
  assert forward.kernel == "unsupported" and "packed rows" in forward.reason
  forward = kvcache.plan(q, pool, pool, block_table=table, softcap=2.0)["forward"]
  assert forward.kernel == "unsupported" and "softcap" in forward.reason
