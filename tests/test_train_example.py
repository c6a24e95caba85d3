"""examples/train_lm.py: a few steps of a tiny model; the loss falls, the
flash kernels run in the model's dtype, the loss curve keeps to the oracle rule
against jax.nn.dot_product_attention, and --compare finds the flash and jax.nn
loss curves in agreement.

The model computes in MODEL_DTYPE (conftest): float32 on CPU, bfloat16 on the
GPU (the CUDA kernels take 16-bit inputs; parameters stay float32).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

import jax_flash2  # noqa: E402
from conftest import MODEL_DTYPE  # noqa: E402
from oracle import ABS_SLACK  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_lm.py"
TINY = ["--batch", "4", "--seq-len", "32", "--layers", "1", "--dim", "32", "--heads", "4",
        "--kv-heads", "2", "--lr", "1e-2", "--log-every", "100"]


def load_example():
  spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


DTYPE = ["--dtype", MODEL_DTYPE.name]
HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[MODEL_DTYPE.name]


def test_loss_falls():
  result = load_example().main(["--steps", "8", *DTYPE, *TINY])
  losses = result["losses"]
  assert len(losses) == 8
  assert losses[-1] < losses[0] - 0.5, losses
  assert result["tokens_per_s"] > 0 and result["peak_memory_bytes"] > 0
  # The Flax module hands the kernels its compute dtype.
  assert result["flash_kernel_dtypes"] == [HLO_DTYPE], result["flash_kernel_dtypes"]


def test_loss_curve_oracle_rule():
  """Flash training in MODEL_DTYPE against the float32 jax.nn run: at each step
  its loss is off by at most 2x the jax.nn run's in MODEL_DTYPE, plus the slack."""
  example = load_example()

  def losses(attention, dtype):
    cfg = example.parse_args(["--steps", "6", "--dtype", dtype, *TINY])
    return np.asarray(example.train(cfg, attention, log=lambda _: None)["losses"])

  ours, plain = losses("flash", MODEL_DTYPE.name), losses("xla", MODEL_DTYPE.name)
  with jax.default_matmul_precision("highest"):
    expected = losses("xla", "float32")
  err, base = np.abs(ours - expected), np.abs(plain - expected)
  bound = 2 * base + ABS_SLACK[MODEL_DTYPE] * np.max(np.abs(expected))
  assert np.all(err <= bound), (ours, plain, expected)


def test_compare_agrees():
  env = dict(os.environ)
  root = str(pathlib.Path(jax_flash2.__file__).parent.parent)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  proc = subprocess.run(
      [sys.executable, str(EXAMPLE), "--steps", "4", *DTYPE, "--compare", *TINY],
      env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "loss curves agree" in proc.stdout, proc.stdout
  assert "tokens/s" in proc.stdout and "peak MiB" in proc.stdout


def test_context_parallel_matches_unsharded():
  """--context-parallel 4 on 4 CPU devices (sequence split, ring attention)
  trains to the losses of the data-parallel run on the same devices."""
  env = dict(os.environ)
  root = str(pathlib.Path(jax_flash2.__file__).parent.parent)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  env["JAX_PLATFORMS"] = "cpu"
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for n in (1, 4):
      path = pathlib.Path(tmp) / f"cp{n}.json"
      proc = subprocess.run(
          [sys.executable, str(EXAMPLE), "--steps", "3", "--dtype", "float32", *TINY,
           "--context-parallel", str(n), "--json-out", str(path)],
          env=env, capture_output=True, text=True, timeout=300)
      assert proc.returncode == 0, proc.stderr[-4000:]
      results[n] = json.loads(path.read_text())
  # n - 1 = 3 hops of K and of V per layer.
  assert results[4]["ring_hops"] == 2 * 3, results[4]["ring_hops"]
  np.testing.assert_allclose(results[4]["losses"], results[1]["losses"], rtol=1e-5)


def test_pack_separates_documents():
  """The model on a packed row (segment ids, positions restarting per
  document) gives each document the logits it gets alone in a row."""
  example = load_example()
  cfg = example.parse_args([*DTYPE, *TINY])
  model = example.LanguageModel(cfg, example.jf.dot_product_attention, example.nnx.Rngs(0))
  lengths = [5, 17, 1, 9]
  tokens = np.random.default_rng(0).integers(0, 256, size=sum(lengths)).astype(np.int32)
  ids = np.repeat(np.arange(len(lengths)), lengths).astype(np.int32)
  positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
  packed = np.asarray(model(tokens[None], ids[None], positions[None]))[0]
  start = 0
  tol = 2e-4 if MODEL_DTYPE == np.float32 else 5e-2
  for n in lengths:
    alone = np.asarray(model(tokens[None, start:start + n]))[0]
    np.testing.assert_allclose(packed[start:start + n], alone, atol=tol, rtol=tol)
    start += n
  # Without the ids the documents would see each other.
  mixed = np.asarray(model(tokens[None], None, positions[None]))[0]
  assert not np.allclose(mixed[5:22], packed[5:22], atol=tol)


def test_pack_run_reports_both_layouts():
  """--pack: packed rows hold several documents, every token useful; the
  padded run, one document per row, has a smaller useful share; both train
  (finite, falling loss) and report useful tokens/s."""
  result = load_example().main(["--pack", "--steps", "4", *DTYPE, *TINY, "--seq-len", "64",
                                "--min-doc-len", "4"])
  packed, padded = result["packed"], result["padded"]
  assert packed["documents_per_step"] > 4  # more documents than rows
  assert packed["useful_fraction"] == 1.0 and padded["useful_fraction"] < 0.8
  assert padded["documents_per_step"] == 4
  for r in (packed, padded):
    assert np.all(np.isfinite(r["losses"])) and r["losses"][-1] < r["losses"][0]
    assert r["useful_tokens_per_s"] > 0
  assert result["speedup"] > 0
