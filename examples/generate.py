"""Generate text with a paged KV cache and jax_flash2.flash_attention_with_kvcache.

The model is examples/train_lm.py's (GQA, rotary embeddings) with random
weights. A batch of prompts of different lengths
is prefilled in chunks of --chunk tokens (each chunk appended to the paged
cache and attended in one call), then --new-tokens tokens are decoded greedily,
one jitted step per token with the caches donated, so the append writes into
them in place. Prints tokens/s (compilation excluded) and the cache's memory.

  python examples/generate.py
  python examples/generate.py --compare   # vs a plain-JAX cache and jax.nn.dot_product_attention

--compare runs the same prompts through a contiguous cache updated with
.at[].set and attended with jax.nn.dot_product_attention under a length mask,
and checks that the greedy tokens are identical.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_flash2

ROOT = pathlib.Path(__file__).resolve().parent


def _train_lm():
  spec = importlib.util.spec_from_file_location("train_lm", ROOT / "train_lm.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


train_lm = _train_lm()


def rotary(x, positions, base: float = 10000.0):
  """train_lm.rotary with per-sequence positions [B, T] (each sequence is at
  its own place in its cache)."""
  half = x.shape[-1] // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, D/2]
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# The two caches: attend(q, k_cache, v_cache, lengths, k, v) -> (out, k_cache,
# v_cache) appends k, v [B, T, K, D] at positions lengths[b] ... and attends.


def flash_attend(block_table):
  def attend(q, k_cache, v_cache, lengths, k, v):
    return jax_flash2.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                                   k=k, v=v, block_table=block_table)
  return attend


def plain_attend(q, k_cache, v_cache, lengths, k, v):
  """The comparison: a contiguous [B, S_max, K, D] cache, .at[].set and
  jax.nn.dot_product_attention with query t of sequence b seeing keys
  j <= lengths[b] + t."""
  batch, seqlen_q = q.shape[:2]
  pos = lengths[:, None] + jnp.arange(seqlen_q)[None, :]  # [B, T]
  rows = jnp.arange(batch)[:, None]
  k_cache = k_cache.at[rows, pos].set(k, mode="drop")
  v_cache = v_cache.at[rows, pos].set(v, mode="drop")
  mask = jnp.arange(k_cache.shape[1])[None, None, :] <= pos[:, :, None]  # [B, T, S]
  out = jax.nn.dot_product_attention(q, k_cache, v_cache, mask=mask[:, None])
  return out, k_cache, v_cache


def step(model, tokens, lengths, caches, attend):
  """Logits [B, T, VOCAB] of tokens [B, T] at positions lengths[b] + t, and
  the caches (one (k, v) pair per layer) with the tokens' keys and values."""
  x = model.embed(tokens)
  positions = lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
  new_caches = []
  for block, (k_cache, v_cache) in zip(model.blocks, caches):
    attn, h = block.attn, block.attn_norm(x)
    q, k = rotary(attn.query(h), positions), rotary(attn.key(h), positions)
    out, k_cache, v_cache = attend(q, k_cache, v_cache, lengths, k, attn.value(h))
    new_caches.append((k_cache, v_cache))
    x = x + attn.out(out)
    x = x + block.down(jax.nn.gelu(block.up(block.mlp_norm(x))))
  return model.embed.attend(model.norm(x)).astype(jnp.float32), new_caches


def generate(model, prompts: list[np.ndarray], cfg, attend, cache_shape, log=print) -> dict:
  """Greedy generation of cfg.new_tokens tokens after each prompt."""
  batch = len(prompts)
  dtype = train_lm.DTYPES[cfg.dtype]
  caches = [(jnp.zeros(cache_shape, dtype), jnp.zeros(cache_shape, dtype))
            for _ in range(cfg.layers)]
  prompt_lens = np.array([len(p) for p in prompts], np.int32)
  chunks = -(-int(prompt_lens.max()) // cfg.chunk)
  padded = np.zeros((batch, chunks * cfg.chunk), np.int32)
  for b, p in enumerate(prompts):
    padded[b, :len(p)] = p
  graph, state = nnx.split(model)

  @functools.partial(jax.jit, donate_argnums=(3,))
  def run(state, tokens, lengths, caches):
    return step(nnx.merge(graph, state), tokens, lengths, caches, attend)

  # Chunked prefill: every sequence appends the same chunk positions; a short
  # prompt's padding lands past its length, where decoding overwrites it.
  last_logits = np.zeros((batch, train_lm.VOCAB), np.float32)
  for c in range(chunks):
    lengths = jnp.full((batch,), c * cfg.chunk, jnp.int32)
    logits, caches = run(state, jnp.asarray(padded[:, c * cfg.chunk:(c + 1) * cfg.chunk]),
                         lengths, caches)
    logits = np.asarray(logits)
    for b, n in enumerate(prompt_lens):
      if c * cfg.chunk <= n - 1 < (c + 1) * cfg.chunk:
        last_logits[b] = logits[b, n - 1 - c * cfg.chunk]
  token = jnp.asarray(last_logits.argmax(-1).astype(np.int32))[:, None]
  lengths = jnp.asarray(prompt_lens)
  out = [token]
  # The first decode step compiles; time the rest.
  start = time.perf_counter()
  for i in range(cfg.new_tokens - 1):
    if i == 1:
      jax.block_until_ready(token)
      start = time.perf_counter()
    logits, caches = run(state, token, lengths, caches)
    lengths = lengths + 1
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]
    out.append(token)
  jax.block_until_ready(token)
  timed = max(cfg.new_tokens - 2, 0)
  seconds = time.perf_counter() - start if timed else 0.0
  tokens = np.concatenate([np.asarray(t) for t in out], axis=1)
  cache_bytes = sum(k.size * k.dtype.itemsize + v.size * v.dtype.itemsize for k, v in caches)
  return dict(tokens=tokens.tolist(), tokens_per_s=batch * timed / seconds if seconds else None,
              cache_bytes=int(cache_bytes))


def make_prompts(cfg) -> list[np.ndarray]:
  data = train_lm.corpus()
  rng = np.random.default_rng(cfg.seed)
  lens = [int(x) for x in cfg.prompt_lens.split(",")]
  starts = rng.integers(0, len(data) - max(lens), size=len(lens))
  return [data[s:s + n].astype(np.int32) for s, n in zip(starts, lens)]


def build_model(cfg):
  return train_lm.LanguageModel(cfg, train_lm.jf.dot_product_attention, nnx.Rngs(cfg.seed))


def run_all(cfg, log=print) -> dict:
  model = build_model(cfg)
  prompts = make_prompts(cfg)
  batch = len(prompts)
  head_dim = cfg.dim // cfg.heads
  capacity = -(-(max(len(p) for p in prompts) + cfg.chunk + cfg.new_tokens) // cfg.page_size)
  capacity *= cfg.page_size  # per sequence, in whole pages
  max_pages = capacity // cfg.page_size
  # Pages handed out shuffled, as an allocator serving many requests would.
  table = np.random.default_rng(cfg.seed + 1).permutation(batch * max_pages).astype(np.int32)
  table = jnp.asarray(table.reshape(batch, max_pages))
  results = {}
  paged_shape = (batch * max_pages, cfg.page_size, cfg.kv_heads, head_dim)
  results["flash"] = generate(model, prompts, cfg, flash_attend(table), paged_shape, log)
  if cfg.compare:
    contiguous = (batch, capacity, cfg.kv_heads, head_dim)
    results["plain"] = generate(model, prompts, cfg, plain_attend, contiguous, log)
    results["identical"] = results["flash"]["tokens"] == results["plain"]["tokens"]
  for name in ("flash", "plain"):
    if name not in results:
      continue
    r = results[name]
    rate = f"{r['tokens_per_s']:.1f} tokens/s" if r["tokens_per_s"] else "n/a tokens/s"
    log(f"{name}: {rate}, cache {r['cache_bytes'] / 2**20:.2f} MiB "
        f"({'paged' if name == 'flash' else 'contiguous'})")
  for b, p in enumerate(prompts):
    text = bytes(int(t) for t in results["flash"]["tokens"][b]).decode("utf-8", "replace")
    log(f"[{b}] prompt {len(p)} bytes -> {text!r}")
  if cfg.compare:
    log("greedy tokens identical: " + str(results["identical"]))
  return results


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--prompt-lens", default="7,40,23,64", help="comma-separated prompt lengths")
  p.add_argument("--new-tokens", type=int, default=32)
  p.add_argument("--chunk", type=int, default=16, help="prefill chunk (tokens per call)")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--dtype", choices=sorted(train_lm.DTYPES),
                 default="bfloat16" if jax.default_backend() == "gpu" else "float32")
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--compare", action="store_true",
                 help="also run a plain-JAX cache with jax.nn.dot_product_attention")
  p.add_argument("--json-out", help="write the results as JSON")
  return p.parse_args(argv)


def main(argv=None):
  cfg = parse_args(argv)
  results = run_all(cfg)
  if cfg.json_out:
    pathlib.Path(cfg.json_out).write_text(json.dumps(results))
  if cfg.compare and not results["identical"]:
    sys.exit("generate.py: the greedy tokens differ between the flash and plain caches")
  return results


if __name__ == "__main__":
  main()
