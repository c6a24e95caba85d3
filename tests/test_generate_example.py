"""examples/generate.py at a tiny size: chunked prefill and greedy decoding
through a paged cache give the same tokens as a plain-JAX cache with
jax.nn.dot_product_attention."""

from __future__ import annotations

import importlib.util
import pathlib

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "generate.py"


def test_generate_matches_plain_cache():
  spec = importlib.util.spec_from_file_location("generate", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  cfg = module.parse_args(["--prompt-lens", "5,19,33", "--new-tokens", "6", "--layers", "1",
                           "--dim", "32", "--heads", "4", "--kv-heads", "2", "--compare",
                           "--dtype", "float32"])
  lines = []
  results = module.run_all(cfg, log=lines.append)
  tokens = np.asarray(results["flash"]["tokens"])
  assert tokens.shape == (3, 6)
  assert results["identical"], (results["flash"]["tokens"], results["plain"]["tokens"])
  assert results["flash"]["cache_bytes"] > 0
  assert any("greedy tokens identical: True" in line for line in lines)
