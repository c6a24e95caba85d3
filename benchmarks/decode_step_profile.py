"""Three decode steps over a paged KV cache (B 16, S 16k, H 32, K 8, D 128,
pages of 64), for a profiler to catch one: the bf16 cache, or an int8 one
with per-KV-head scales. benchmarks/results/h100.md quotes it under ncu:

  ncu --kernel-name regex:Decode --launch-skip 2 --launch-count 1 \\
      --section SpeedOfLight --section SchedulerStats --section WarpStateStats \\
      --section Occupancy python3 benchmarks/decode_step_profile.py int8
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jax_flash2


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("cache", choices=["bfloat16", "int8"])
  args = parser.parse_args()
  batch, heads, kv_heads, head_dim, page, seqlen = 16, 32, 8, 128, 64, 16384
  pages = batch * seqlen // page
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((batch, 1, heads, head_dim)), jnp.bfloat16)
  shape = (pages, page, kv_heads, head_dim)
  extra = {}
  if args.cache == "int8":
    k_cache = jnp.asarray(rng.integers(-127, 127, shape), jnp.int8)
    v_cache = jnp.asarray(rng.integers(-127, 127, shape), jnp.int8)
    extra = dict(k_scale=jnp.full((kv_heads,), 0.01, jnp.float32),
                 v_scale=jnp.full((kv_heads,), 0.01, jnp.float32))
  else:
    k_cache = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    v_cache = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  block_table = jnp.arange(pages, dtype=jnp.int32).reshape(batch, seqlen // page)
  lengths = jnp.full((batch,), seqlen - 7, jnp.int32)
  step = jax.jit(lambda q, k_cache, v_cache, lengths: jax_flash2.flash_attention_with_kvcache(
      q, k_cache, v_cache, cache_seqlens=lengths, block_table=block_table, **extra))
  for _ in range(3):
    step(q, k_cache, v_cache, lengths).block_until_ready()


if __name__ == "__main__":
  main()
