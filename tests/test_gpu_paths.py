"""Which CUDA forward and backward kernels serve a call: the Hopper (sm90a)
kernels on cc 9.0 for the shapes they support, the sm80 kernels otherwise.
The launch code runs what jax_flash2.plan says (src/plan.h), so each case
asserts the plan for this GPU and checks the call's results against the
float64 oracle. Runs only on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from jax_flash2 import _ext

from conftest import ON_GPU, device_plan, is_hopper, package_env, random_inputs
from oracle import assert_close_to_oracle, naive_same_dtype, oracle

pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")



# The plan's kernel names of the paths below.
_FWD_KERNEL = {"sm90": "sm90", "sm80": "sm80-prefill", "decode": "sm80-decode"}


# (B, T, S, H, K, D, causal, expected path on cc 9.0). The Hopper kernel takes
# grids that fill the GPU; small ones go to the sm80 split-KV path, and calls
# whose T * group size is at most 32 rows (16 at D 256) to the decode kernel
# (on every GPU; 17-32 rows take two m16 tiles per block).
PATH_CASES = [
    (8, 1000, 1000, 16, 16, 128, True, "sm90"),
    (8, 1025, 1500, 16, 4, 64, False, "sm90"),  # GQA by index, T != S
    (8, 1000, 1000, 16, 16, 96, False, "sm90"),  # D = 96 by the D = 128 tile (zero-filled)
    (4, 1000, 1111, 8, 2, 256, True, "sm90"),  # D = 256: its own tile (128 x 80)
    (4, 777, 700, 8, 8, 200, False, "sm90"),  # D = 200 by the D = 256 tile
    (8, 1000, 1000, 16, 4, 40, True, "sm90"),  # D = 40 by the D = 64 tile
    (8, 200, 200, 16, 4, 64, True, "sm90"),  # D 64 at <= 256 keys: the 128-row tile
    (64, 256, 256, 16, 16, 48, False, "sm90"),  # and D = 48 by it
    (2, 1024, 9000, 16, 16, 128, True, "sm90"),  # masked above 8192 keys: its own tile row
    (3, 700, 900, 24, 8, 128, False, "sm90"),  # 432 tiles: 2 whole rounds, then stream-K pieces
    (2, 300, 300, 4, 4, 128, False, "sm80"),  # a small grid: split-KV
    (1, 1, 4096, 8, 2, 128, False, "decode"),  # GQA group packed, split-KV
    (2, 2, 3001, 16, 2, 64, True, "decode"),  # 16 packed rows, causal, ragged tail
    (1, 3, 4097, 8, 2, 128, True, "decode"),  # 3 queries x 4 heads = 12 rows
    (2, 4, 5000, 32, 4, 128, True, "decode"),  # 32 rows, two m16 tiles a block, causal
    (1, 6, 2001, 16, 4, 64, False, "decode"),  # 24 rows at D 64
    (1, 5, 4096, 16, 2, 128, False, "sm80"),  # 40 packed rows: the prefill kernel
    (1, 5, 3000, 8, 2, 256, False, "sm80"),  # 20 rows at D 256: the prefill kernel
]


def _expected_path(expected: str) -> str:
  return expected if is_hopper() or expected == "decode" else "sm80"


@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: f"B{c[0]}T{c[1]}S{c[2]}D{c[5]}-{c[7]}")
def test_forward_path(rng, case):
  batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, expected = case
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
  fn = jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=causal,
                                                          return_lse=True))
  plan = device_plan(q, k, v, causal=causal)["forward"]
  assert plan.kernel == _FWD_KERNEL[_expected_path(expected)], plan
  out, lse = fn(q, k, v)
  (ref_out, ref_lse), _ = oracle(q, k, v, np.ones(q.shape), np.zeros(lse.shape), causal=causal)
  base_out, base_lse = naive_same_dtype(q, k, v, causal=causal)
  assert_close_to_oracle("out", out, ref_out, base_out, q.dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, q.dtype)


def test_hopper_forward_is_built():
  if not is_hopper():
    pytest.skip("not a cc 9.0 GPU")
  assert _ext.cuda_ext.has_sm90()
  assert "sm90a" in jax_flash2.kernel_info()["cuda"]


# (T, S, H, K, D, causal, expected backward path on cc 9.0)
BWD_PATH_CASES = [
    (300, 300, 4, 4, 128, True, "sm90"),
    (257, 1000, 8, 2, 128, False, "sm90"),  # GQA 4:1, T != S
    (1000, 257, 4, 4, 128, True, "sm90"),  # T > S causal: rows that see no key
    (257, 1000, 8, 2, 64, True, "sm90"),  # D = 64, GQA, causal with T < S
    # 144 tiles (key blocks x B x K): on 132 SMs a stream-K tail, after a
    # CTA per whole tile (D = 128) or persistent rounds (D = 64).
    (200, 1100, 16, 8, 128, False, "sm90"),
    (300, 1000, 9, 9, 64, False, "sm90"),
    # Head dims below a tile's: D = 96 by the D = 128 kernel, D = 40 by the
    # D = 64 one (the maps zero-fill the columns past D).
    (300, 257, 4, 4, 96, False, "sm90"),
    (257, 1000, 8, 2, 40, True, "sm90"),
    # D = 256: the D-split kernel; D = 200 by its tile.
    (300, 257, 4, 2, 256, True, "sm90"),
    (257, 700, 8, 8, 200, False, "sm90"),
]


def _grads_fn(causal):
  def grads(q, k, v, d_out, d_lse):
    _, vjp = jax.vjp(lambda q, k, v: jax_flash2.flash_attention(
        q, k, v, causal=causal, return_lse=True), q, k, v)
    return vjp((d_out, d_lse))
  return jax.jit(grads)


@pytest.mark.parametrize("case", BWD_PATH_CASES,
                         ids=lambda c: f"T{c[0]}S{c[1]}D{c[4]}-{c[6]}")
def test_backward_path(rng, case):
  seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal, expected = case
  batch = 2
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
                          jnp.bfloat16)
  d_out = jnp.asarray(rng.standard_normal((batch, seqlen_q, heads_q, head_dim)), jnp.bfloat16)
  d_lse = jnp.asarray(rng.standard_normal((batch, heads_q, seqlen_q)), jnp.float32)
  fn = _grads_fn(causal)
  # JAX_FLASH2_SM90_BACKWARD=0 turns the Hopper backward off for the process.
  hopper_backward = is_hopper() and os.environ.get("JAX_FLASH2_SM90_BACKWARD", "1") != "0"
  plan = device_plan(q, k, v, causal=causal)["backward"]
  assert plan.kernel == (expected if hopper_backward else "sm80"), plan
  grads = fn(q, k, v, d_out, d_lse)
  _, ref_grads = oracle(q, k, v, d_out, d_lse, causal=causal)
  _, naive_vjp = jax.vjp(lambda q, k, v: naive_same_dtype(q, k, v, causal=causal), q, k, v)
  base_grads = naive_vjp((d_out, d_lse.astype(q.dtype)))
  for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
    assert_close_to_oracle(name, g, r, bg, q.dtype)


# (B, T, S, H, K, D, causal): many key blocks per query block, GQA, each
# kernel; unmasked ones in the rotated dQ order (T1500 D128, T1000 D64) and
# in the descending one (S > T: more key blocks than query blocks).
DET_CASES = [
    (2, 1000, 2000, 8, 2, 128, True),
    (2, 1500, 1500, 8, 8, 128, False),
    (2, 1000, 1000, 8, 2, 64, True),
    (2, 1000, 1000, 4, 2, 64, False),
    (3, 777, 1500, 4, 4, 64, False),
    (2, 500, 700, 4, 2, 256, True),
]


@pytest.mark.parametrize("case", DET_CASES,
                         ids=lambda c: f"T{c[1]}S{c[2]}K{c[4]}D{c[5]}-{'causal' if c[6] else 'full'}")
def test_deterministic_backward_path(rng, case):
  """deterministic=True runs the Hopper backward (on cc 9.0): the same
  gradient bits in three runs, and the oracle's gradients."""
  batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, causal = case
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
                          jnp.bfloat16)
  d_out = jnp.asarray(rng.standard_normal((batch, seqlen_q, heads_q, head_dim)), jnp.bfloat16)
  d_lse = jnp.asarray(rng.standard_normal((batch, heads_q, seqlen_q)), jnp.float32)
  hopper_backward = is_hopper() and os.environ.get("JAX_FLASH2_SM90_BACKWARD", "1") != "0"
  plan = device_plan(q, k, v, causal=causal, deterministic=True)["backward"]
  assert plan.kernel == ("sm90" if hopper_backward else "sm80"), plan

  @jax.jit
  def grads(q, k, v, d_out, d_lse):
    _, vjp = jax.vjp(lambda q, k, v: jax_flash2.flash_attention(
        q, k, v, causal=causal, return_lse=True, deterministic=True), q, k, v)
    return vjp((d_out, d_lse))

  runs = [jax.device_get(grads(q, k, v, d_out, d_lse)) for _ in range(3)]
  for other in runs[1:]:
    for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
      assert np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16)), name
  _, ref_grads = oracle(q, k, v, d_out, d_lse, causal=causal)
  _, naive_vjp = jax.vjp(lambda q, k, v: naive_same_dtype(q, k, v, causal=causal), q, k, v)
  base_grads = naive_vjp((d_out, d_lse.astype(q.dtype)))
  for name, g, r, bg in zip(("dq", "dk", "dv"), runs[0], ref_grads, base_grads):
    assert_close_to_oracle(name, jnp.asarray(g), r, bg, q.dtype)


def test_hopper_backward_kill_switch():
  """JAX_FLASH2_SM90_BACKWARD=0 (read once per process) sends every backward
  to the sm80 kernels; checked in a fresh process."""
  if not is_hopper():
    pytest.skip("not a cc 9.0 GPU")
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp
      import jax_flash2
      q = jnp.ones((1, 128, 2, 128), jnp.bfloat16)
      g = jax.grad(lambda q: jax_flash2.flash_attention(q, q, q).astype(jnp.float32).sum())(q)
      assert bool(jnp.isfinite(g).all())
      print(jax_flash2.plan(q, q, q)["backward"])
  """)
  env = dict(os.environ, JAX_FLASH2_SM90_BACKWARD="0", XLA_PYTHON_CLIENT_PREALLOCATE="false")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, check=True).stdout
  assert "kernel='sm80'" in out and "JAX_FLASH2_SM90_BACKWARD=0" in out, out


def test_decode_with_score_options_uses_prefill_kernel(rng):
  """The decode kernel has no softcap/ALiBi/segments/dropout: such decode calls
  run the prefill kernel, with a workspace sized for either."""
  q, k, v = random_inputs(rng, 2, 1, 3001, 16, 2, 128, jnp.bfloat16)
  fn = jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v, softcap=5.0, return_lse=True))
  plan = device_plan(q, k, v, softcap=5.0)["forward"]
  assert plan.kernel == "sm80-prefill" and "decode kernel" in plan.reason, plan
  out, lse = fn(q, k, v)
  (ref_out, ref_lse), _ = oracle(q, k, v, np.ones(q.shape), np.zeros(lse.shape), softcap=5.0)
  base_out, base_lse = naive_same_dtype(q, k, v, softcap=5.0)
  assert_close_to_oracle("out", out, ref_out, base_out, q.dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, q.dtype)


def test_decode_kernel_kill_switch():
  """JAX_FLASH2_DECODE_KERNEL=0 (read once per process) sends decode shapes to
  the prefill kernel's split-KV path; checked in a fresh process."""
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp
      import jax_flash2
      q = jnp.ones((1, 1, 8, 128), jnp.bfloat16)
      k = jnp.ones((1, 4096, 2, 128), jnp.bfloat16)
      out = jax_flash2.flash_attention(q, k, k)
      assert bool(jnp.allclose(out.astype(jnp.float32), 1.0))
      print(jax_flash2.plan(q, k, k)["forward"])
  """)
  env = dict(os.environ, JAX_FLASH2_DECODE_KERNEL="0", XLA_PYTHON_CLIENT_PREALLOCATE="false")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, check=True).stdout
  assert "kernel='sm80-prefill'" in out and "JAX_FLASH2_DECODE_KERNEL=0" in out, out


def test_decode_waits_for_the_kernel_before_it(rng):
  """On cc 9.0 the decode kernel and its split combine are launched as
  programmatic dependents (scheduled while the kernel before them runs): they
  must still read the K/V that kernel writes. Each scan step rewrites the whole
  cache (an XLA kernel just before the decode kernel) and then attends to it;
  every step is checked against the oracle on that step's cache."""
  batch, seqlen_k, heads_q, heads_kv, head_dim, steps = 1, 4099, 32, 4, 128, 4
  q, k, v = random_inputs(rng, batch, steps, seqlen_k, heads_q, heads_kv, head_dim, jnp.bfloat16)
  shifts = jnp.asarray(rng.standard_normal((steps, 1, 1, heads_kv, head_dim)), jnp.bfloat16)

  def step(cache, x):
    k_cache, v_cache = cache
    q_t, shift = x
    k_cache = (k_cache * 0.5 + shift).astype(k_cache.dtype)
    v_cache = (v_cache * 0.5 - shift).astype(v_cache.dtype)
    out, lse = jax_flash2.flash_attention(q_t[:, None], k_cache, v_cache, return_lse=True)
    return (k_cache, v_cache), (out, lse, k_cache, v_cache)

  fn = jax.jit(lambda q, k, v, shifts: jax.lax.scan(step, (k, v), (jnp.swapaxes(q, 0, 1), shifts))[1])
  plan = device_plan(q[:, :1], k, v)["forward"]
  assert plan.kernel == "sm80-decode" and plan.splits > 1, plan
  outs, lses, k_steps, v_steps = fn(q, k, v, shifts)
  for t in range(steps):
    q_t = q[:, t:t + 1]
    (ref_out, ref_lse), _ = oracle(q_t, k_steps[t], v_steps[t], np.ones(q_t.shape),
                                   np.zeros(lses[t].shape))
    base_out, base_lse = naive_same_dtype(q_t, k_steps[t], v_steps[t])
    assert_close_to_oracle(f"out step {t}", outs[t], ref_out, base_out, q.dtype)
    assert_close_to_oracle(f"lse step {t}", lses[t], ref_lse, base_lse, q.dtype)


def test_small_shared_memory_tiles():
  """JAX_FLASH2_MAX_SMEM_PER_BLOCK=101376 (read once per process) plans as a
  99 KB GPU (cc 8.6 / 8.9) would: the sm80 kernels with their small tiles,
  checked against the oracle in a fresh process (d256 and d200 included: the
  backward's single-dO-buffer row), and the d256 forward with dropout (its
  keep bits in the Q rows' padding) against the reference's same mask."""
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp, numpy as np, jax_flash2
      from conftest import random_inputs
      from oracle import assert_close_to_oracle, naive_same_dtype, oracle
      rng = np.random.default_rng(0)
      for (t, s, h, kh, d, causal) in [(257, 1000, 8, 2, 64, True), (300, 257, 4, 4, 128, False),
                                       (1, 3001, 8, 2, 128, False), (70, 130, 2, 2, 32, True),
                                       (131, 197, 4, 2, 256, True), (77, 300, 2, 1, 200, False)]:
        q, k, v = random_inputs(rng, 2, t, s, h, kh, d, jnp.bfloat16)
        plan = jax_flash2.plan(q, k, v, causal=causal)
        assert plan["forward"].smem_bytes <= 101376 and plan["backward"].smem_bytes <= 101376
        assert plan["backward"].kernel == "sm80", plan
        assert d == 32 or plan["backward"].tile["row"] == "small_smem", plan
        if t == 1:  # the decode kernel's 16-key tile
          assert plan["forward"].kernel == "sm80-decode", plan
          assert plan["forward"].tile["row"] == "small_smem", plan
        d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
        d_lse = jnp.asarray(rng.standard_normal((2, h, t)), jnp.float32)
        (out, lse), vjp = jax.vjp(lambda q, k, v: jax_flash2.flash_attention(
            q, k, v, causal=causal, return_lse=True), q, k, v)
        grads = vjp((d_out, d_lse))
        (ref_out, ref_lse), ref_grads = oracle(q, k, v, d_out, d_lse, causal=causal)
        base_out, base_lse = naive_same_dtype(q, k, v, causal=causal)
        assert_close_to_oracle("out", out, ref_out, base_out, q.dtype)
        assert_close_to_oracle("lse", lse, ref_lse, base_lse, q.dtype)
        _, naive_vjp = jax.vjp(lambda q, k, v: naive_same_dtype(q, k, v, causal=causal), q, k, v)
        base_grads = naive_vjp((d_out, d_lse.astype(q.dtype)))
        for name, g, r, bg in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads):
          assert_close_to_oracle(name, g, r, bg, q.dtype)
        print("ok", t, s, h, kh, d, causal, plan["backward"].tile)
      q, k, v = random_inputs(rng, 1, 150, 203, 4, 2, 256, jnp.bfloat16)
      drop = dict(dropout_rate=0.2, dropout_rng=jax.random.key(5), causal=True)
      assert jax_flash2.plan(q, k, v, **drop)["forward"].kernel == "sm80-prefill"
      out = jax_flash2.flash_attention(q, k, v, **drop).astype(jnp.float32)
      ref = jax_flash2.flash_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                       implementation="reference", **drop)
      print("d256 dropout forward: max error", float(jnp.max(jnp.abs(out - ref))))
  """)
  # Run from tests/ (conftest, oracle) with this process's jax_flash2.
  env = package_env(JAX_FLASH2_MAX_SMEM_PER_BLOCK="101376", XLA_PYTHON_CLIENT_PREALLOCATE="false")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=600, cwd=os.path.dirname(__file__))
  assert out.returncode == 0, out.stdout + out.stderr
  assert out.stdout.count("ok ") == 6, out.stdout
  last = out.stdout.strip().splitlines()[-1]
  assert last.startswith("d256 dropout forward: max error"), out.stdout
  assert float(last.split()[-1]) < 3e-2, out.stdout  # bf16 rounding of out (|out| < 2)


# (B, T, S, H, K, D, options, the sm80 path, the NaN's (b, t, h))
NAN_CASES = [
    (1, 1, 4097, 8, 2, 128, {}, "decode", (0, 0, 3)),
    (2, 300, 300, 4, 4, 128, {}, "split prefill", (1, 17, 2)),
    (8, 1000, 1000, 16, 16, 128, {"deterministic": True, "dropout_rate": 0.1}, "prefill",
     (5, 999, 7)),
    (2, 300, 257, 4, 4, 64, {"causal": True, "dropout_rate": 0.1}, "prefill, empty rows",
     (0, 299, 1)),
]


@pytest.mark.parametrize("case", NAN_CASES, ids=lambda c: c[7])
def test_sm80_nan_row_propagates(rng, case):
  """A NaN in one query row gives that row NaN output and LSE (and NaN
  gradients), not the 0 / -inf of a row that sees no key; the other rows stay
  finite, and rows that see no key (causal, T > S) stay 0 / -inf."""
  batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, options, _, (b, t, h) = case
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim,
                          jnp.bfloat16)
  if "dropout_rate" in options:
    options = dict(options, dropout_rng=jax.random.key(0))
  plan = device_plan(q, k, v, **options)
  # The backward: either kernel. On cc 9.0 the Hopper forward serves the
  # dropout prefill case, so the NaN goes through its dropout path there.
  assert plan["forward"].kernel.startswith("sm80") or (
      "dropout_rate" in options and plan["forward"].kernel == "sm90"), plan
  q = q.at[b, t, h, 5].set(jnp.nan)
  fn = lambda q, k, v: jax_flash2.flash_attention(q, k, v, return_lse=True, **options)
  (out, lse), vjp = jax.vjp(fn, q, k, v)
  out, lse = np.asarray(out, np.float32), np.asarray(lse)
  assert np.isnan(out[b, t, h]).all() and np.isnan(lse[b, h, t]), (out[b, t, h], lse[b, h, t])
  bad = np.zeros(out.shape[:3], bool)
  bad[b, t, h] = True
  empty = np.isneginf(lse).transpose(0, 2, 1)  # [B, T, H]
  if options.get("causal") and seqlen_q > seqlen_k:
    assert empty[:, :seqlen_q - seqlen_k].all() and (out[:, :seqlen_q - seqlen_k] == 0).all()
  assert np.isfinite(out[~bad]).all() and np.isfinite(lse.transpose(0, 2, 1)[~bad & ~empty]).all()
  dq, dk, dv = vjp((jnp.ones(q.shape, q.dtype), jnp.zeros(lse.shape, jnp.float32)))
  assert np.isnan(np.asarray(dq, np.float32)[b, t, h]).any()
  assert np.isnan(np.asarray(dv, np.float32)[b, :, h // (heads_q // heads_kv)]).any()
