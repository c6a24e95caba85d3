"""examples/train_lm.py: a few steps of a tiny model; the loss falls, and
--compare finds the flash and jax.nn loss curves in agreement."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

import jax_flash2  # noqa: E402

# These compare float32 models with plain Flax / jax.nn; the CUDA kernels take
# float16/bfloat16 only (float32 on the GPU raises NotImplementedError).
pytestmark = pytest.mark.skipif(
    __import__("jax").default_backend() == "gpu", reason="float32 models; CUDA kernels are fp16/bf16")

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_lm.py"
TINY = ["--batch", "4", "--seq-len", "32", "--layers", "1", "--dim", "32", "--heads", "4",
        "--kv-heads", "2", "--lr", "1e-2", "--log-every", "100"]


def load_example():
  spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_loss_falls():
  result = load_example().main(["--steps", "8", "--dtype", "float32", *TINY])
  losses = result["losses"]
  assert len(losses) == 8
  assert losses[-1] < losses[0] - 0.5, losses
  assert result["tokens_per_s"] > 0 and result["peak_memory_bytes"] > 0


def test_compare_agrees():
  env = dict(os.environ)
  root = str(pathlib.Path(jax_flash2.__file__).parent.parent)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
  proc = subprocess.run(
      [sys.executable, str(EXAMPLE), "--steps", "4", "--dtype", "float32", "--compare", *TINY],
      env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "loss curves agree" in proc.stdout, proc.stdout
  assert "tokens/s" in proc.stdout and "peak MiB" in proc.stdout
