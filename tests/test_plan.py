"""jax_flash2.plan: the CUDA kernels' choices (src/plan.h, through the CPU
extension) per compute capability, checked on CPU: the kernel and its reason,
the tile, the split counts and the shared-memory budget."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest

import jax_flash2
from jax_flash2 import _ext
from conftest import package_env
from jax_flash2._plan import MAX_SMEM_PER_BLOCK

CCS = [(8, 0), (8, 6), (8, 9), (9, 0)]
# Opt-in shared memory per block: A100 163 KB, cc 8.6 / 8.9 99 KB, H100 / H200 227 KB.
SMEM = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024}
HEAD_DIMS = list(range(8, 257, 8))


def _specs(b, t, s, h, kh, d, dtype=jnp.bfloat16):
  return (jax.ShapeDtypeStruct((b, t, h, d), dtype), jax.ShapeDtypeStruct((b, s, kh, d), dtype),
          jax.ShapeDtypeStruct((b, s, kh, d), dtype))


def _plan(b, t, s, h, kh, d, cc=(9, 0), sm_count=132, dtype=jnp.bfloat16, **options):
  return jax_flash2.plan(*_specs(b, t, s, h, kh, d, dtype), compute_capability=cc,
                         sm_count=sm_count, **options)


def test_default_shared_memory_per_compute_capability():
  assert {cc: MAX_SMEM_PER_BLOCK[cc] for cc in CCS} == SMEM
  assert SMEM[(8, 6)] == 101376


@pytest.mark.parametrize("cc", CCS, ids=lambda cc: f"cc{cc[0]}{cc[1]}")
@pytest.mark.parametrize("causal", [False, True])
def test_sm80_tiles_fit_the_shared_memory(cc, causal):
  """Every head dim gets sm80 tiles within the device's shared memory, or a
  clear refusal that names the bytes; never a tile that cannot launch."""
  for d in HEAD_DIMS:
    for shape in [(2, 1000, 1000, 8, 8), (1, 1, 4096, 8, 2), (1, 3, 3000, 16, 4)]:
      b, t, s, h, kh = shape
      for extra in [{}, {"softcap": 5.0}, {"dropout_rate": 0.1}]:
        plans = _plan(b, t, s, h, kh, d, cc=cc, causal=causal, **extra)
        for direction, p in plans.items():
          if p.kernel.startswith("sm80"):
            assert 0 < p.smem_bytes <= SMEM[cc], (d, shape, extra, direction, p)
            assert p.head_dim_bucket >= d
          elif p.kernel == "unsupported":
            assert "shared memory" in p.reason and str(SMEM[cc]) in p.reason, p
          else:
            assert p.kernel == "sm90" and cc == (9, 0), p


@pytest.mark.parametrize("cc", CCS, ids=lambda cc: f"cc{cc[0]}{cc[1]}")
def test_what_each_compute_capability_serves(cc):
  small = SMEM[cc] < 163 * 1024
  for d in HEAD_DIMS:
    plans = _plan(2, 1000, 1000, 8, 8, d, cc=cc, softcap=5.0)
    fwd, bwd = plans["forward"], plans["backward"]
    if cc == (9, 0):  # the Hopper kernels serve softcap (small grids still split on sm80)
      assert "softcap" not in fwd.reason and "softcap" not in bwd.reason, (d, fwd, bwd)
      continue
    assert fwd.kernel == "sm80-prefill", (d, fwd)
    # The 99 KB GPUs: above the d32 bucket the small-smem rows (the d256 one
    # with a single dO buffer).
    assert bwd.kernel == "sm80", (d, bwd)
    assert bwd.smem_bytes <= SMEM[cc], (d, bwd)
    if small and d > 32:
      assert bwd.tile["row"] == "small_smem", (d, bwd)
  # The forward's d256 prefill tile is exactly 99 KB; dropout's keep bits
  # live in its Q rows' padding, so it serves dropout there too.
  drop = _plan(2, 1000, 1000, 8, 8, 256, cc=cc, dropout_rate=0.1)["forward"]
  if cc != (9, 0):
    assert drop.kernel == "sm80-prefill" and drop.smem_bytes <= SMEM[cc], drop
    assert drop.smem_bytes == _plan(2, 1000, 1000, 8, 8, 256, cc=cc)["forward"].smem_bytes


@pytest.mark.parametrize("d,row,block_m,block_n", [
    (32, "default", 64, 128), (64, "small_smem", 32, 128), (128, "small_smem", 32, 64),
    (256, "small_smem", 32, 32), (200, "small_smem", 32, 32)])
@pytest.mark.parametrize("cc", [(8, 6), (8, 9)], ids=["cc86", "cc89"])
def test_backward_tiles_on_99kb_gpus(cc, d, row, block_m, block_n):
  bwd = _plan(2, 1000, 777, 8, 2, d, cc=cc)["backward"]
  assert bwd.kernel == "sm80" and bwd.tile["row"] == row, bwd
  assert (bwd.tile["block_m"], bwd.tile["block_n"]) == (block_m, block_n)
  assert bwd.grid == (math.ceil(777 / block_n), 2, 2)
  assert bwd.smem_bytes <= 101376
  assert bwd.tile["do_stages"] == (1 if d > 128 else 2), bwd


@pytest.mark.parametrize("d,row,smem", [
    (32, "default", 78848), (64, "default", 111616), (128, "default", 125440),
    (256, "default", 145920)])
def test_backward_tiles_on_a100(d, row, smem):
  bwd = _plan(2, 1000, 1000, 8, 8, d, cc=(8, 0))["backward"]
  assert bwd.kernel == "sm80" and bwd.tile["row"] == row and bwd.smem_bytes == smem, bwd
  assert "compute capability 8.0" in bwd.reason


def test_backward_tiles_on_hopper_when_sm80_runs():
  # Dropout above D 128: the Hopper D-split backward does not serve it; the
  # sm80 kernel's d256 row fits Hopper's shared memory.
  bwd = _plan(2, 1000, 1000, 8, 8, 256, dropout_rate=0.1)["backward"]
  assert bwd.kernel == "sm80" and bwd.tile["row"] == "default", bwd
  assert bwd.smem_bytes == 145920 and bwd.smem_bytes <= SMEM[(9, 0)]
  assert bwd.reason.startswith("dropout at D > 128")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_tiny_softcap_backward_runs_sm90_on_hopper(d):
  # The Hopper backward computes the cap's derivative from tanh itself, so no
  # cap is too small for it.
  for softcap in (1e-30, 0.05, 50.0):
    assert _plan(2, 1000, 1000, 8, 8, d, softcap=softcap)["backward"].kernel == "sm90"


@pytest.mark.parametrize("d", [40, 64, 96, 128, 200, 256])
def test_deterministic_backward_plan(d):
  # The Hopper backward serves it (one dQ accumulator, summed in a fixed
  # order), with causal, windows, GQA, the score options and segment ids.
  ids = (jnp.zeros((2, 1000), jnp.int32),) * 2
  for options in [{}, {"causal": True}, {"window_size": (128, 0)}, {"softcap": 5.0},
                  {"alibi_slopes": jnp.full((8,), 0.1, jnp.float32)}, {"segment_ids": ids}]:
    for kh in (8, 2):
      bwd = _plan(2, 1000, 1000, 8, kh, d, deterministic=True, **options)["backward"]
      assert bwd.kernel == "sm90" and bwd.reason == "" and bwd.splits == 1, (d, options, bwd)
  # With dropout: Hopper up to D 128, above it the sm80 kernel's dQ slices.
  bwd = _plan(2, 1000, 1000, 8, 8, d, deterministic=True, dropout_rate=0.1)["backward"]
  if d <= 128:
    assert bwd.kernel == "sm90" and bwd.splits == 1, bwd
  else:
    assert bwd.kernel == "sm80" and bwd.reason.startswith("dropout") and bwd.splits > 1, bwd
  bwd = _plan(2, 1000, 1000, 8, 8, d, cc=(8, 0), deterministic=True)["backward"]
  assert bwd.kernel == "sm80" and bwd.splits > 1, bwd


@pytest.mark.parametrize("d,bucket,block_m,block_n", [
    (8, 32, 128, 128), (40, 64, 128, 64), (96, 96, 128, 64), (128, 128, 128, 64),
    (136, 192, 64, 64), (200, 256, 64, 64)])
def test_forward_tile_per_head_dim(d, bucket, block_m, block_n):
  fwd = _plan(8, 1000, 1000, 8, 8, d, cc=(8, 0))["forward"]  # a grid that fills the GPU
  assert fwd.kernel == "sm80-prefill" and fwd.head_dim_bucket == bucket
  assert (fwd.tile["block_m"], fwd.tile["block_n"]) == (block_m, block_n)
  assert fwd.grid == (math.ceil(1000 / block_m), 8, 8) and fwd.splits == 1


def test_hopper_serves_plain_calls_and_says_why_not():
  assert _plan(8, 1000, 1000, 16, 16, 128)["forward"].kernel == "sm90"
  assert _plan(8, 1000, 1000, 16, 16, 128)["backward"].kernel == "sm90"
  for options in [{"softcap": 5.0}, {"alibi_slopes": jnp.full((16,), 0.1, jnp.float32)},
                  {"softcap": 5.0, "segment_ids": (jnp.zeros((8, 1000), jnp.int32),) * 2},
                  {"dropout_rate": 0.1}, {"dropout_rate": 0.1, "softcap": 5.0, "causal": True}]:
    for d in (64, 128):
      plans = _plan(8, 1000, 1000, 16, 16, d, **options)
      assert plans["forward"].kernel == "sm90" and plans["backward"].kernel == "sm90", plans
  # Dropout above D 128: the Hopper forward, the sm80 backward (the D-split
  # backward has no keep mask).
  plans = _plan(8, 1000, 1000, 16, 16, 256, dropout_rate=0.1)
  assert plans["forward"].kernel == "sm90", plans
  assert plans["backward"].kernel == "sm80", plans
  assert plans["backward"].reason == "dropout at D > 128: the Hopper backward does not serve it"
  assert _plan(8, 1000, 1000, 16, 16, 256)["backward"].kernel == "sm90"
  # A small grid: split-KV on the sm80 kernels.
  fwd = _plan(2, 300, 300, 4, 4, 128)["forward"]
  assert fwd.kernel == "sm80-prefill" and fwd.splits > 1 and "split-KV" in fwd.reason, fwd
  # Other GPUs: the reason names the compute capability.
  assert "compute capability 8.0" in _plan(8, 1000, 1000, 16, 16, 128, cc=(8, 0))["forward"].reason


@pytest.mark.parametrize("cc", CCS, ids=lambda cc: f"cc{cc[0]}{cc[1]}")
def test_decode_kernel_and_its_splits(cc):
  # B1 T1 S32k, GQA 32:4 at D64: 8 packed rows per K/V head (the decode tile
  # fits every GPU at D64: 68 KB).
  fwd = _plan(1, 1, 32768, 32, 4, 64, cc=cc, sm_count=108)["forward"]
  assert fwd.kernel == "sm80-decode", fwd
  warp_keys, warps = fwd.tile["warp_keys"], fwd.tile["warps"]
  block_steps = math.ceil(math.ceil(32768 / warp_keys) / warps)
  splits = _ext.cpu_ext.choose_num_splits(4, block_steps, 108 * 2, 128, 0.95)
  per_split = math.ceil(block_steps / splits) * warps
  assert fwd.splits == math.ceil(math.ceil(32768 / warp_keys) / per_split) > 1
  assert fwd.grid == (fwd.splits, 1, 4) and fwd.smem_bytes <= SMEM[cc]
  # D128: the decode tile needs 135,424 B; the 99 KB GPUs take the 16-key
  # tile (69,888 B). D256's 139,520 B have no smaller tile: the prefill kernel.
  fwd = _plan(1, 1, 32768, 32, 4, 128, cc=cc)["forward"]
  small = SMEM[cc] < 135424
  assert fwd.kernel == "sm80-decode" and fwd.smem_bytes <= SMEM[cc], fwd
  assert fwd.tile["row"] == ("small_smem" if small else "default")
  assert fwd.tile["warp_keys"] == (16 if small else 32) and fwd.splits > 1
  fwd = _plan(1, 1, 32768, 32, 4, 256, cc=cc)["forward"]
  if small:
    assert fwd.kernel == "sm80-prefill" and "decode kernel needs 139520" in fwd.reason, fwd
    assert fwd.tile["pack"] == 8 and fwd.splits > 1
  else:
    assert fwd.kernel == "sm80-decode", fwd
  # Score options: the decode kernel does not serve them.
  fwd = _plan(1, 1, 32768, 32, 4, 64, cc=cc, softcap=3.0)["forward"]
  assert fwd.kernel == "sm80-prefill" and "softcap: the decode kernel" in fwd.reason, fwd


def test_prefill_split_count_matches_the_heuristic():
  for (b, t, s, h, kh, d) in [(1, 100, 8000, 8, 8, 128), (2, 300, 300, 4, 4, 64),
                              (4, 4096, 4096, 16, 16, 128), (1, 7, 5000, 16, 2, 256)]:
    fwd = _plan(b, t, s, h, kh, d, cc=(8, 0), sm_count=108)["forward"]
    block_m, block_n, pack = fwd.tile["block_m"], fwd.tile["block_n"], fwd.tile["pack"]
    assert pack == (h // kh if h > kh and t < block_m else 1)
    m_blocks = math.ceil(t * pack / block_m)
    n_blocks = math.ceil(s / block_n)
    splits = _ext.cpu_ext.choose_num_splits(b * (h // pack) * m_blocks, n_blocks, 108 * 2, 128)
    expected = math.ceil(n_blocks / math.ceil(n_blocks / splits)) if splits > 1 else 1
    assert fwd.splits == expected and fwd.grid == (m_blocks * expected, b, h // pack), fwd
    # A second K/V stage for split or packed grids, where it fits (not d256 on 163 KB).
    two = (expected > 1 or pack > 1) and (block_m + 4 * block_n) * (d + 8) * 2 <= SMEM[(8, 0)]
    assert fwd.tile["kv_stages"] == (2 if two else 1) and fwd.smem_bytes <= SMEM[(8, 0)]


def test_unsupported_calls_say_why():
  f32 = _plan(1, 10, 10, 2, 2, 64, dtype=jnp.float32)["forward"]
  assert f32.kernel == "unsupported" and "float32" in f32.reason
  d12 = jax_flash2.plan(*_specs(1, 10, 10, 2, 2, 64), compute_capability=(7, 5),
                        max_smem_per_block=65536)["forward"]
  assert d12.kernel == "unsupported" and "compute capability 7.5" in d12.reason
  with pytest.raises(ValueError, match="max_smem_per_block"):
    jax_flash2.plan(*_specs(1, 10, 10, 2, 2, 64), compute_capability=(12, 0))


def test_cpu_and_bad_arguments():
  plans = jax_flash2.plan(*_specs(1, 10, 10, 2, 2, 64), compute_capability=None)
  assert plans["forward"].kernel == plans["backward"].kernel == "cpu"
  q, k, v = _specs(1, 10, 10, 3, 2, 64)  # H % K != 0: flash_attention's own check
  with pytest.raises(ValueError):
    jax_flash2.plan(q, k, v)


def test_max_smem_switch_runs_the_small_tiles(tmp_path):
  """JAX_FLASH2_MAX_SMEM_PER_BLOCK (read once per process) caps the shared
  memory the plan sees: on cc 9.0 the sm80 kernels then run, with the tiles of
  the 99 KB GPUs."""
  code = textwrap.dedent("""
      import jax, jax.numpy as jnp, jax_flash2
      q = jax.ShapeDtypeStruct((2, 1000, 8, 128), jnp.bfloat16)
      p = jax_flash2.plan(q, q, q)
      print(p["forward"].kernel, p["backward"].kernel, p["backward"].tile["row"])
  """)
  # The same jax_flash2 as this process's (installed or in-tree), from a
  # directory that shadows neither.
  env = package_env(JAX_FLASH2_MAX_SMEM_PER_BLOCK="101376", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300, check=True, cwd=tmp_path)
  assert out.stdout.split() == ["sm80-prefill", "sm80", "small_smem"], out
