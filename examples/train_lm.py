"""Train a small decoder-only transformer on the flash kernels.

A byte-level language model (GQA, causal, rotary embeddings in plain JAX) built
from jax_flash2.flax.MultiHeadAttention and trained with optax, data-parallel
over every visible device: the batch is sharded along a "data" mesh axis and
the attention kernels run per device on their batch slice. The text is the
repository's own Python source (shipped with it), so nothing is downloaded.

  python examples/train_lm.py --steps 200
  python examples/train_lm.py --steps 100 --compare      # vs jax.nn.dot_product_attention
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_lm.py
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/train_lm.py \
      --context-parallel 4    # sequence over 4 devices (ring attention), batch over 2
  python examples/train_lm.py --pack --seq-len 1024    # packed documents vs padded rows

Each step logs the loss; at the end, tokens/s (compilation excluded) and peak
memory (the device's peak_bytes_in_use where it reports one, else the process's
peak RSS). Before training, the compiled forward pass is searched for the flash
kernels' custom call and its input dtype, which the run reports (and a flash
run without it fails): on GPU with --dtype bfloat16 it is bf16. --compare trains the same model, from the same initial weights on
the same batches, once per attention implementation, each in its own process
so that peak memory is its own, and prints both loss curves side by side.

--pack trains on documents of mixed lengths (log-uniform between
--min-doc-len and --seq-len: many short ones, a few long), twice: packed into
rows of --seq-len tokens with segment ids (attention stays within each
document) and positions restarting at every document (rotary embeddings),
and unpacked, each document padded to a row of its own (the padding weighs
nothing in the loss). Both see the same document stream; the run reports
each one's useful (document) tokens/s and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flash2.export
import jax_flash2.flax as jf
from jax_flash2 import context_parallel

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB = 256  # bytes
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# Data


def corpus() -> np.ndarray:
  """The repository's Python source as one byte string."""
  files = sorted((ROOT / "jax_flash2").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py"))
  text = b"\n\n".join(f.read_bytes() for f in files)
  return np.frombuffer(text, dtype=np.uint8)


def batches(data: np.ndarray, batch: int, seq_len: int, seed: int):
  """Random windows: tokens [batch, seq_len + 1] (inputs and shifted targets)."""
  rng = np.random.default_rng(seed)
  while True:
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    yield np.stack([data[s:s + seq_len + 1] for s in starts]).astype(np.int32)


def documents(data: np.ndarray, min_len: int, max_len: int, seed: int):
  """An endless stream of documents: random windows of the corpus of
  log-uniform lengths in [min_len, max_len], plus one byte for the target."""
  rng = np.random.default_rng(seed)
  while True:
    n = int(np.exp(rng.uniform(np.log(min_len), np.log(max_len + 1))))
    n = min(max(n, min_len), max_len)
    start = rng.integers(0, len(data) - n - 1)
    yield data[start:start + n + 1].astype(np.int32)


def packed_batches(docs, batch: int, seq_len: int):
  """Rows of seq_len tokens filled with whole documents (the last one of a row
  cut to fit): dict of inputs, targets, segment_ids, positions (restarting
  at 0 in every document) and weights (all 1: every token is useful), each
  [batch, seq_len], and the number of documents."""
  while True:
    fields = {k: np.zeros((batch, seq_len), np.int32)
              for k in ("inputs", "targets", "segment_ids", "positions")}
    count = 0
    for b in range(batch):
      used = 0
      while used < seq_len:
        doc = next(docs)
        n = min(len(doc) - 1, seq_len - used)
        row = slice(used, used + n)
        fields["inputs"][b, row], fields["targets"][b, row] = doc[:n], doc[1:n + 1]
        fields["segment_ids"][b, row] = count
        fields["positions"][b, row] = np.arange(n)
        used, count = used + n, count + 1
    fields["weights"] = np.ones((batch, seq_len), np.float32)
    yield fields, count


def padded_batches(docs, batch: int, seq_len: int):
  """One document per row, padded at the end (weight 0; causal attention keeps
  the padding out of the document's tokens)."""
  while True:
    fields = {k: np.zeros((batch, seq_len), np.int32) for k in ("inputs", "targets")}
    fields["weights"] = np.zeros((batch, seq_len), np.float32)
    for b in range(batch):
      doc = next(docs)
      n = len(doc) - 1
      fields["inputs"][b, :n], fields["targets"][b, :n] = doc[:-1], doc[1:]
      fields["weights"][b, :n] = 1.0
    yield fields, batch


# Model


def rotary(x, positions, base: float = 10000.0):
  """Rotary position embedding of x [B, T, H, D] at positions [T] or [B, T]
  (halves layout)."""
  half = x.shape[-1] // 2
  freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[..., None] * freqs  # [(B,) T, D/2]
  sin, cos = jnp.sin(angles)[..., None, :], jnp.cos(angles)[..., None, :]  # [(B,) T, 1, D/2]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def xla_attention(q, k, v, *, is_causal):
  """The comparison: JAX's own attention on the same layout."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=is_causal)


class RotaryAttention(jf.MultiHeadAttention):
  """The flash layer with rotary embeddings between projection and attention.

  Reuses the layer's GQA projections (query to H heads, key and value to K);
  `attention_fn` takes Flax's layout, jax_flash2.flax.dot_product_attention by
  default.
  """

  def __init__(self, *args, attention_fn=jf.dot_product_attention, **kwargs):
    super().__init__(*args, **kwargs)
    self.attention_fn = attention_fn

  def __call__(self, x, segment_ids=None, positions=None):
    """x [B, T, F]; segment_ids [B, T] for packed documents (attention within
    each), positions [B, T] (default 0..T-1 in every row)."""
    positions = jnp.arange(x.shape[-2]) if positions is None else positions
    q = rotary(self.query(x), positions)
    k = rotary(self.key(x), positions)
    extra = {} if segment_ids is None else {"segment_ids": segment_ids}
    return self.out(self.attention_fn(q, k, self.value(x), is_causal=True, **extra))


class Block(nnx.Module):

  def __init__(self, cfg, attention_fn, rngs):
    dim, dtype = cfg.dim, DTYPES[cfg.dtype]
    self.attn_norm = nnx.RMSNorm(dim, dtype=dtype, rngs=rngs)
    self.attn = RotaryAttention(
        cfg.heads, dim, num_kv_heads=cfg.kv_heads, use_bias=False, dtype=dtype,
        attention_fn=attention_fn, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(dim, dtype=dtype, rngs=rngs)
    self.up = nnx.Linear(dim, 4 * dim, use_bias=False, dtype=dtype, rngs=rngs)
    self.down = nnx.Linear(4 * dim, dim, use_bias=False, dtype=dtype, rngs=rngs)

  def __call__(self, x, segment_ids=None, positions=None):
    x = x + self.attn(self.attn_norm(x), segment_ids, positions)
    return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class LanguageModel(nnx.Module):

  def __init__(self, cfg, attention_fn, rngs):
    dtype = DTYPES[cfg.dtype]
    self.embed = nnx.Embed(VOCAB, cfg.dim, dtype=dtype, rngs=rngs)
    self.blocks = nnx.List([Block(cfg, attention_fn, rngs) for _ in range(cfg.layers)])
    self.norm = nnx.RMSNorm(cfg.dim, dtype=dtype, rngs=rngs)

  def __call__(self, tokens, segment_ids=None, positions=None):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, segment_ids, positions)
    # Logits in float32 against the (tied) embedding.
    return self.embed.attend(self.norm(x)).astype(jnp.float32)


# Training


def peak_memory_bytes() -> tuple[int, str]:
  stats = [d.memory_stats() or {} for d in jax.local_devices()]
  peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
  if peaks:
    return max(peaks), "device peak_bytes_in_use"
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process peak RSS"


def forward_hlo(model, tokens) -> str:
  """The compiled forward pass."""
  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
  return forward.lower(state, tokens[:, :-1]).compile().as_text()


def flash_kernel_dtypes(model, tokens) -> list[str]:
  """Input dtypes of the flash forward kernels in the compiled forward pass
  (one per layer and device program); empty when none runs."""
  hlo = forward_hlo(model, tokens)
  target = jax_flash2.export.TARGETS[0]
  return re.findall(rf'custom_call_target="{target}", operand_layout_constraints=\{{(\w+)\[', hlo)


def context_parallel_attention_fn(mesh):
  """Flax-layout attention with the sequence split over mesh axis "seq":
  jax_flash2's ring attention (contiguous layout), the batch over "data"."""

  def attention(q, k, v, *, is_causal):
    return context_parallel.context_parallel_attention(
        q, k, v, mesh=mesh, axis_name="seq", batch_axis="data", causal=is_causal)

  return attention


def train(cfg, attention: str = "flash", log=print) -> dict:
  """Trains for cfg.steps; returns the losses, tokens/s and peak memory."""
  attention_fn = jf.dot_product_attention if attention == "flash" else xla_attention
  devices = jax.devices()
  seq = getattr(cfg, "context_parallel", 1)
  if seq < 1 or len(devices) % seq or cfg.seq_len % seq:
    raise ValueError(f"--context-parallel {seq} must divide the {len(devices)} devices and "
                     f"--seq-len {cfg.seq_len}")
  data = len(devices) // seq
  if cfg.batch % data:
    raise ValueError(f"--batch {cfg.batch} must be a multiple of the {data} data-parallel "
                     "devices")
  # Auto axes: the compiler propagates the batch (and sequence) sharding
  # through the model.
  mesh = jax.make_mesh((data, seq), ("data", "seq"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  data_sharding = NamedSharding(mesh, P("data"))
  # Context parallel: activations split along the sequence too, and attention
  # as a ring over the "seq" axis.
  activation_sharding = NamedSharding(mesh, P("data", "seq"))
  if seq > 1 and attention == "flash":
    attention_fn = context_parallel_attention_fn(mesh)
  replicated = NamedSharding(mesh, P())

  model = LanguageModel(cfg, attention_fn, nnx.Rngs(cfg.seed))
  optimizer = nnx.Optimizer(model, optax.adamw(cfg.lr, weight_decay=0.01), wrt=nnx.Param)
  # Data parallel: every device holds the whole model and a slice of the batch.
  state = jax.device_put(nnx.state((model, optimizer)), replicated)
  nnx.update((model, optimizer), state)

  @nnx.jit
  def step(model, optimizer, tokens):
    def loss_fn(model):
      inputs = jax.lax.with_sharding_constraint(tokens[:, :-1], activation_sharding)
      logits = model(inputs)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  data = batches(corpus(), cfg.batch, cfg.seq_len, cfg.seed)
  kernel_dtypes = []
  if attention == "flash":
    kernel_dtypes = flash_kernel_dtypes(model, jax.device_put(next(data), data_sharding))
    if not kernel_dtypes:
      raise RuntimeError("train_lm: the compiled model runs no flash kernel")
    log(f"[flash] flash kernels in the compiled forward: {len(kernel_dtypes)}, "
        f"input dtype {sorted(set(kernel_dtypes))}")
    data = batches(corpus(), cfg.batch, cfg.seq_len, cfg.seed)  # the same batches as xla
  ring_hops = 0
  if seq > 1 and attention == "flash":
    # K/V hops of the ring (collective-permutes) in the compiled forward.
    ring_hops = len(re.findall(r"collective-permute(?:-start)?\(",
                               forward_hlo(model, jax.device_put(next(data), data_sharding))))
    log(f"[flash] context parallel over {seq} devices: {ring_hops} K/V hops in the forward")
    data = batches(corpus(), cfg.batch, cfg.seq_len, cfg.seed)
  losses, times = [], []
  for i in range(cfg.steps):
    tokens = jax.device_put(next(data), data_sharding)
    start = time.perf_counter()
    loss = float(step(model, optimizer, tokens))  # float() waits for the step
    times.append(time.perf_counter() - start)
    losses.append(loss)
    if i % cfg.log_every == 0 or i == cfg.steps - 1:
      note = "  (includes compilation)" if i == 0 else ""
      log(f"[{attention}] step {i + 1:4d}/{cfg.steps}  loss {loss:.4f}  "
          f"{cfg.batch * cfg.seq_len / times[-1]:,.0f} tok/s{note}")
  # The first step compiles; leave it out of the throughput.
  timed = times[1:] or times
  peak, peak_source = peak_memory_bytes()
  tokens_per_s = cfg.batch * cfg.seq_len * len(timed) / sum(timed)
  return dict(attention=attention, losses=losses,
              tokens_per_s=tokens_per_s, tokens_per_s_per_device=tokens_per_s / len(devices),
              median_step_s=float(np.median(timed)), first_step_s=times[0],
              peak_memory_bytes=peak, peak_memory_source=peak_source,
              flash_kernel_dtypes=sorted(set(kernel_dtypes)), ring_hops=ring_hops,
              devices=len(devices), device_kind=devices[0].device_kind,
              platform=jax.default_backend(),
              config={k: v for k, v in vars(cfg).items() if k not in ("compare", "json_out")})


def train_documents(cfg, layout: str, log=print) -> dict:
  """--pack: trains on the document stream, packed into rows with segment ids
  and per-document positions (layout "packed") or one document per padded
  row ("padded"), data-parallel; returns the losses and useful tokens/s."""
  devices = jax.devices()
  if cfg.batch % len(devices):
    raise ValueError(f"--batch {cfg.batch} must be a multiple of the {len(devices)} devices")
  mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  data_sharding, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
  model = LanguageModel(cfg, jf.dot_product_attention, nnx.Rngs(cfg.seed))
  optimizer = nnx.Optimizer(model, optax.adamw(cfg.lr, weight_decay=0.01), wrt=nnx.Param)
  nnx.update((model, optimizer), jax.device_put(nnx.state((model, optimizer)), replicated))

  @nnx.jit
  def step(model, optimizer, batch):
    def loss_fn(model):
      logits = model(batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
      return jnp.sum(loss * batch["weights"]) / jnp.sum(batch["weights"])

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  docs = documents(corpus(), cfg.min_doc_len, cfg.seq_len, cfg.seed)
  make = packed_batches if layout == "packed" else padded_batches
  stream = make(docs, cfg.batch, cfg.seq_len)
  losses, times, useful, counts = [], [], [], []
  for i in range(cfg.steps):
    fields, count = next(stream)
    batch = jax.device_put(fields, data_sharding)
    start = time.perf_counter()
    loss = float(step(model, optimizer, batch))  # float() waits for the step
    times.append(time.perf_counter() - start)
    losses.append(loss)
    useful.append(float(fields["weights"].sum()))
    counts.append(count)
    if i % cfg.log_every == 0 or i == cfg.steps - 1:
      note = "  (includes compilation)" if i == 0 else ""
      log(f"[{layout}] step {i + 1:4d}/{cfg.steps}  loss {loss:.4f}  "
          f"{useful[-1] / times[-1]:,.0f} useful tok/s{note}")
  # The first step compiles; leave it out of the throughput.
  timed = slice(1, None) if cfg.steps > 1 else slice(None)
  peak, peak_source = peak_memory_bytes()
  return dict(layout=layout, losses=losses,
              useful_tokens_per_s=sum(useful[timed]) / sum(times[timed]),
              useful_fraction=sum(useful) / (cfg.steps * cfg.batch * cfg.seq_len),
              documents_per_step=float(np.mean(counts)),
              median_step_s=float(np.median(times[timed])), first_step_s=times[0],
              peak_memory_bytes=peak, peak_memory_source=peak_source,
              devices=len(devices), platform=jax.default_backend(),
              config={k: v for k, v in vars(cfg).items() if k not in ("compare", "json_out")})


def pack_compare(cfg) -> dict:
  """--pack: the packed and the padded run of the same document stream."""
  if cfg.context_parallel != 1 or cfg.compare:
    raise ValueError("--pack runs alone (not with --context-parallel or --compare)")
  if not 1 <= cfg.min_doc_len <= cfg.seq_len:
    raise ValueError(f"--min-doc-len {cfg.min_doc_len} must be in [1, --seq-len {cfg.seq_len}]")
  results = {layout: train_documents(cfg, layout) for layout in ("packed", "padded")}
  packed, padded = results["packed"], results["padded"]
  print(f"\ndocuments of {cfg.min_doc_len}..{cfg.seq_len} tokens (log-uniform), rows of "
        f"{cfg.seq_len}, batch {cfg.batch}:")
  print(f"{'':10s}{'useful tok/s':>14s}{'useful share':>14s}{'docs/step':>11s}{'final loss':>12s}")
  for name, r in results.items():
    print(f"{name:10s}{r['useful_tokens_per_s']:14,.0f}{r['useful_fraction']:14.2f}"
          f"{r['documents_per_step']:11.1f}{r['losses'][-1]:12.4f}")
  ratio = packed["useful_tokens_per_s"] / padded["useful_tokens_per_s"]
  print(f"packed / padded useful tokens/s: {ratio:.2f}x")
  results["speedup"] = ratio
  return results


def summary(result: dict) -> str:
  return (f"[{result['attention']}] {result['devices']} {result['platform']} device(s): "
          f"final loss {result['losses'][-1]:.4f}, {result['tokens_per_s']:,.0f} tok/s, "
          f"peak memory {result['peak_memory_bytes'] / 2**20:,.1f} MiB "
          f"({result['peak_memory_source']})")


def compare(cfg, argv) -> tuple[dict, dict]:
  """Runs each implementation in its own process and prints them side by side."""
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for attention in ("flash", "xla"):
      path = pathlib.Path(tmp) / f"{attention}.json"
      child = without_option([a for a in argv if a != "--compare"], "--json-out")
      subprocess.run([sys.executable, __file__, *child, "--attention", attention,
                      "--json-out", str(path)], check=True)
      results[attention] = json.loads(path.read_text())
  flash, xla = results["flash"], results["xla"]
  print("\nstep   loss flash   loss jax.nn    |diff|")
  for i in sorted(set(range(0, cfg.steps, cfg.log_every)) | {cfg.steps - 1}):
    a, b = flash["losses"][i], xla["losses"][i]
    print(f"{i + 1:4d}   {a:10.4f}   {b:11.4f}   {abs(a - b):.2e}")
  diff = max(abs(a - b) for a, b in zip(flash["losses"], xla["losses"]))
  tol = 1e-3 if cfg.dtype == "float32" else 5e-2
  agree = diff <= tol * max(1.0, max(flash["losses"]))
  print(f"\nloss curves {'agree' if agree else 'DIFFER'}: max |diff| {diff:.2e} over "
        f"{cfg.steps} steps")
  print(f"{'':14s}{'flash':>16s}{'jax.nn':>16s}")
  print(f"{'tokens/s':14s}{flash['tokens_per_s']:16,.0f}{xla['tokens_per_s']:16,.0f}")
  print(f"{'peak MiB':14s}{flash['peak_memory_bytes'] / 2**20:16,.1f}"
        f"{xla['peak_memory_bytes'] / 2**20:16,.1f}   ({flash['peak_memory_source']})")
  if cfg.json_out:
    pathlib.Path(cfg.json_out).write_text(json.dumps(
        dict(flash=flash, xla=xla, max_loss_diff=diff, loss_curves_agree=agree)))
  return flash, xla


def without_option(argv, name):
  """argv less `name VALUE` / `name=VALUE`."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
    elif a == name:
      skip = True
    elif not a.startswith(name + "="):
      out.append(a)
  return out


def parse_args(argv=None):
  gpu = jax.default_backend() == "gpu"
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--dtype", choices=sorted(DTYPES),
                 # The CUDA kernels take 16-bit inputs; the CPU ones any.
                 default="bfloat16" if gpu else "float32")
  p.add_argument("--batch", type=int, default=16, help="global batch, split over devices")
  p.add_argument("--seq-len", type=int, default=128)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--dim", type=int, default=128)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=2, help="K: 1 MQA, heads MHA, else GQA")
  p.add_argument("--lr", type=float, default=3e-3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--log-every", type=int, default=10)
  p.add_argument("--context-parallel", type=int, default=1, metavar="N",
                 help="split the sequence over N devices (ring attention; the batch goes "
                      "over the others)")
  p.add_argument("--pack", action="store_true",
                 help="train on documents of mixed lengths packed into rows (segment ids, "
                      "per-document positions) and, for comparison, one padded row per "
                      "document; report useful tokens/s of both")
  p.add_argument("--min-doc-len", type=int, default=32,
                 help="--pack: shortest document (the longest is --seq-len)")
  p.add_argument("--compare", action="store_true",
                 help="also train with jax.nn.dot_product_attention and compare")
  p.add_argument("--attention", choices=("flash", "xla"), default="flash",
                 help=argparse.SUPPRESS)
  p.add_argument("--json-out", help="write the results as JSON (with --compare: both runs, "
                 "the loss difference and the verdict)")
  return p.parse_args(argv)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  cfg = parse_args(argv)
  if cfg.pack:
    result = pack_compare(cfg)
    if cfg.json_out:
      pathlib.Path(cfg.json_out).write_text(json.dumps(result))
    return result
  if cfg.compare:
    return compare(cfg, argv)
  result = train(cfg, cfg.attention)
  print(summary(result))
  if cfg.json_out:
    pathlib.Path(cfg.json_out).write_text(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
