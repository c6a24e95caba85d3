"""Shared fixtures: the backends every test runs against, and the oracle."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from jax_flash2 import api, reference

ON_GPU = jax.default_backend() == "gpu"


def is_hopper() -> bool:
  return getattr(jax.devices()[0], "compute_capability", "") == "9.0"


def device_plan(q, k, v, **options):
  """jax_flash2.plan for this process's GPU (as the lowering sizes the call)."""
  device = jax.devices()[0]
  cc = tuple(int(x) for x in str(device.compute_capability).split("."))
  return jax_flash2.plan(q, k, v, compute_capability=cc, sm_count=device.core_count, **options)


# The directory holding the jax_flash2 under test (installed or in-tree).
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(jax_flash2.__file__)))


def package_env(drop=(), **overrides) -> dict:
  """os.environ for a subprocess that imports this process's jax_flash2
  (PACKAGE_ROOT first on PYTHONPATH), less the names in drop, with overrides."""
  env = {k: v for k, v in os.environ.items() if k not in drop}
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
  env.update(overrides)
  return env

def run_host_test(tmp_path, source: str) -> subprocess.CompletedProcess:
  """Builds tests/cuda/<source> (C++17, the repository root on the include
  path) with the host's C++ compiler and runs it; skips without one."""
  compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if compiler is None:
    pytest.skip("no C++ compiler")
  root = pathlib.Path(__file__).resolve().parents[1]
  binary = tmp_path / pathlib.Path(source).stem
  subprocess.run([compiler, "-std=c++17", "-O2", "-pthread", f"-I{root}",
                  str(root / "tests" / "cuda" / source), "-o", str(binary)], check=True)
  return subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)

# Compute dtype of the model-level tests (Flax layers, the training example):
# bfloat16 on the GPU (the CUDA kernels' dtypes; float32 there runs the
# blockwise plain-JAX path) and float32 on CPU.
# JAX_FLASH2_TEST_MODEL_DTYPE=bfloat16 runs the GPU variant on CPU.
MODEL_DTYPE = jnp.dtype(
    os.environ.get("JAX_FLASH2_TEST_MODEL_DTYPE") or ("bfloat16" if ON_GPU else "float32"))

# The dtype the compiled kernels (FFI custom calls) take on the default device,
# for tests that look for those calls.
KERNEL_DTYPE = jnp.dtype("bfloat16" if ON_GPU else "float32")

# backend name -> dtypes it serves on the default device. "kernel" serves
# float32 on the GPU by the blockwise path (see _lowering).
BACKENDS = {
    "kernel": (jnp.float16, jnp.bfloat16, jnp.float32),
    "reference": (jnp.float16, jnp.bfloat16, jnp.float32),
}


@pytest.fixture(autouse=True)
def _float32_matmuls_in_float32():
  """On a GPU, float32 matmuls default to TF32; the float32 tolerances here
  are float32's, so the tests run under 'highest' (the float32 path follows
  it). test_float32_blockwise checks the default (TF32) precision itself."""
  if not ON_GPU:
    yield
    return
  with jax.default_matmul_precision("highest"):
    yield


def supports(backend: str, dtype) -> bool:
  return jnp.dtype(dtype) in [jnp.dtype(d) for d in BACKENDS[backend]]


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
  return request.param


@pytest.fixture
def rng(request):
  """A fresh generator per test, seeded from the test's name: random inputs that
  a rerun reproduces. (Python's hash() of a string changes per process, so it
  is crc32.) JAX_FLASH2_TEST_SEED=N draws a different set for every test."""
  salt = int(os.environ.get("JAX_FLASH2_TEST_SEED", "0"))
  seed = zlib.crc32(request.node.nodeid.encode()) ^ salt
  return np.random.default_rng(seed)


def random_inputs(rng, batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim, dtype):
  """Random normal q, k, v (never zeros) in `dtype`."""
  q = rng.standard_normal((batch, seqlen_q, heads_q, head_dim))
  k = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
  v = rng.standard_normal((batch, seqlen_k, heads_kv, head_dim))
  return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def materialize_options(options, rng, batch, seqlen, heads):
  """`options` with its flags made arrays: "alibi": True -> slopes [B, H] in
  [0.01, 0.3); "segments": True -> sorted ids in [0, 3) over the T queries, the
  same ids for k/v (so T == S)."""
  options = dict(options)
  if options.pop("alibi", False):
    options["alibi_slopes"] = jnp.asarray(rng.uniform(0.01, 0.3, (batch, heads)), jnp.float32)
  if options.pop("segments", False):
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (batch, seqlen)), axis=1), jnp.int32)
    options["segment_ids"] = (ids, ids)
  return options


def keep_mask(key, batch, heads, seqlen_q, seqlen_k, rate):
  """[B, H, T, S] bool: the dropout mask flash_attention draws for `key` (via
  the seeds api.extra_operands derives from the batch and head counts, as every
  backend does)."""
  q = jnp.zeros((batch, seqlen_q, heads, 8))
  k = jnp.zeros((batch, seqlen_k, 1, 8))
  seeds = api.extra_operands(q, k, dropout_rng=key, dropout_rate=rate).dropout_seeds
  return np.asarray(reference.dropout_keep(seeds, seqlen_q, seqlen_k, rate))


def attention_fn(backend: str):
  return lambda q, k, v, **kw: jax_flash2.flash_attention(q, k, v, implementation=backend, **kw)
