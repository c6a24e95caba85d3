"""Multi-device checks: sharded jit, shard_map, pmap and export of the kernels.

On CPU, tests/test_sharding.py runs this in a fresh process with 8 forced host
devices (the count is fixed when jax initializes, so the rest of the suite keeps
one device). On a GPU host it runs directly on the visible GPUs:

  PYTHONPATH=. python3 tests/multi_device_checks.py [--platform cpu|gpu]
      [--devices N] [--dtype float32|bfloat16|float16] [--json] [name ...]

Meshes are built from the device count: 8 -> (data=2, model=4), 4 -> (2, 2),
2 -> both (data=1, model=2) and (data=2, model=1), 1 -> (1, 1); every check runs
on each. Inputs are float32 on CPU and bfloat16 on GPU (the CUDA kernels take
16-bit inputs). Each check prints one line, PASS/FAIL/SKIP (or with --json
{"name", "ok", "skipped", "detail"}); a check that raises is reported as failed
with the exception and the others still run; the exit status is 1 if any
failed. SKIP: a check whose layout the device count cannot form, or, on GPU
only, a feature the CUDA kernels do not serve yet (NotImplementedError).
"""

from __future__ import annotations

import argparse
import os


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("names", nargs="*", help="checks to run (default: all)")
  p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
  p.add_argument("--devices", type=int, default=None,
                 help="CPU: forced host device count (default 8); GPU: expected count "
                      "(default: all visible)")
  p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                 help="input dtype (default: float32 on CPU, bfloat16 on GPU)")
  p.add_argument("--json", action="store_true", help="one JSON object per check")
  return p.parse_args(argv)


# Before jax initializes: the platform, and on CPU the forced device count.
ARGS = parse_args() if __name__ == "__main__" else parse_args([])
os.environ["JAX_PLATFORMS"] = {"cpu": "cpu", "gpu": "cuda"}[ARGS.platform]
if ARGS.platform == "cpu":
  os.environ["XLA_FLAGS"] = (
      os.environ.get("XLA_FLAGS", "") +
      f" --xla_force_host_platform_device_count={ARGS.devices or 8}")

import inspect  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_flash2  # noqa: E402
from jax_flash2 import _ext  # noqa: E402

B, T, S, H, D = 8, 32, 48, 8, 16
DTYPE = jnp.dtype(ARGS.dtype or ("bfloat16" if ARGS.platform == "gpu" else "float32"))
HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[DTYPE.name]
# Sharded and single-device runs do the same arithmetic per block: float32 agrees
# to rounding. In 16 bits a different summation order (dq's atomics on CUDA,
# dk/dv of shared heads summed across devices) can flip the last bit of a
# result, about 0.4% (bf16) of its size, and a loss summed from such values
# moves by more than a float32 one.
if DTYPE == jnp.float32:
  FWD_TOL, GRAD_TOL, STEP_TOL = (dict(atol=1e-5, rtol=1e-5), dict(atol=1e-4, rtol=1e-5),
                                 dict(atol=1e-5, rtol=1e-4))
else:
  FWD_TOL, GRAD_TOL, STEP_TOL = (dict(atol=2e-2, rtol=2e-2), dict(atol=5e-2, rtol=2e-2),
                                 dict(atol=1e-3, rtol=1e-2))
CHECKS = {}


class Skip(Exception):
  """The device count cannot form what the check needs."""


def layouts(n: int) -> list[tuple[int, int]]:
  """(data, model) mesh shapes for n devices; B, H and the K of the checks divide them."""
  if n == 1:
    return [(1, 1)]
  if n == 2:
    return [(1, 2), (2, 1)]
  if n in (4, 8):
    return [(2, n // 2)]
  raise SystemExit(f"multi_device_checks: {n} devices; the checks are laid out for 1, 2, 4 or 8")


def check(fn):
  """Registers a check. One that takes (data, model) runs on every mesh layout."""
  if not inspect.signature(fn).parameters:
    CHECKS[fn.__name__] = fn
    return fn

  def on_every_layout():
    done, skipped = [], []
    for data, model in layouts(jax.device_count()):
      where = f"(data={data}, model={model})"
      try:
        done.append(f"{where}: {fn(data, model) or 'ok'}")
      except Skip as e:
        skipped.append(f"{where}: skipped, {e}")
    if not done:
      raise Skip("; ".join(skipped))
    return "; ".join(done + skipped)

  CHECKS[fn.__name__] = on_every_layout
  return fn


def qkv(kv_heads, lead=(B,), seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], lead + (T, H, D), DTYPE)
  k = jax.random.normal(keys[1], lead + (S, kv_heads, D), DTYPE)
  v = jax.random.normal(keys[2], lead + (S, kv_heads, D), DTYPE)
  return q, k, v


def loss(q, k, v):
  # Summed in float32: a 16-bit sum of B*T*H*D terms would round the loss itself.
  return jnp.sum(jnp.sin(jax_flash2.flash_attention(q, k, v, causal=True).astype(jnp.float32)))


value_and_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))


def assert_close(actual, expected, tol=FWD_TOL):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), **tol)


def collectives(hlo: str) -> set[str]:
  return set(re.findall(r"all-gather|all-to-all|collective-permute", hlo))


def kernel_operand_shapes(hlo: str) -> list[str]:
  """Shapes of the first operand (q) of every flash custom call in the HLO."""
  targets = "|".join((_ext.FORWARD_TARGET, _ext.BACKWARD_TARGET))
  pattern = (rf'custom_call_target="({targets})", '
             rf'operand_layout_constraints=\{{{HLO_DTYPE}\[([\d,]+)\]')
  return [(shape, target) for target, shape in re.findall(pattern, hlo)]


def mesh(data, model, axis_type=jax.sharding.AxisType.Auto):
  return jax.make_mesh((data, model), ("data", "model"), axis_types=(axis_type,) * 2)


def sharded_run(m, fn, args, specs, out_specs=None):
  in_shardings = tuple(NamedSharding(m, s) for s in specs)
  out_shardings = None
  if out_specs is not None:
    out_shardings = jax.tree.map(lambda s: NamedSharding(m, s), out_specs,
                                 is_leaf=lambda s: isinstance(s, P))
  jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
  hlo = jitted.lower(*args).compile().as_text()
  return jitted(*args), hlo


def batch_and_head_sharded(data, model, kv_heads, kv_spec):
  """Forward and gradients on a (data, model) mesh against one device."""
  m = mesh(data, model)
  q, k, v = qkv(kv_heads)
  q_spec = P("data", None, "model", None)
  fwd = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True)  # noqa: E731
  out, hlo = sharded_run(m, fwd, (q, k, v), (q_spec, kv_spec, kv_spec), q_spec)
  assert_close(out, fwd(q, k, v))
  assert not collectives(hlo), collectives(hlo)
  # Each device runs the kernel on its own block: B/data batch, H/model heads.
  block = f"{B // data},{T},{H // model},{D}"
  assert kernel_operand_shapes(hlo) == [(block, _ext.FORWARD_TARGET)], kernel_operand_shapes(hlo)

  grads, hlo = sharded_run(m, value_and_grads, (q, k, v), (q_spec, kv_spec, kv_spec))
  assert_close(grads, value_and_grads(q, k, v), GRAD_TOL)
  assert not collectives(hlo), collectives(hlo)
  shapes = kernel_operand_shapes(hlo)
  assert {shape for shape, _ in shapes} == {block}, shapes
  return f"per-device kernel shapes {shapes}"


@check
def mha_batch_and_heads(data, model):
  return batch_and_head_sharded(data, model, H, P("data", None, "model", None))


@check
def gqa_batch_and_heads(data, model):
  # K = 4 over `model` devices: each holds 4/model kv heads and their groups of q heads.
  return batch_and_head_sharded(data, model, 4, P("data", None, "model", None))


@check
def mqa_batch_and_heads(data, model):
  # K = 1: q heads split, k and v replicated; the backward sums dk, dv.
  return batch_and_head_sharded(data, model, 1, P("data", None, None, None))


def packed_loss(q, k, v, slopes, q_ids, kv_ids):
  """Causal attention with ALiBi slopes and segment ids, reduced to a scalar."""
  out = jax_flash2.flash_attention(q, k, v, causal=True, alibi_slopes=slopes,
                                   segment_ids=(q_ids, kv_ids))
  return jnp.sum(jnp.sin(out.astype(jnp.float32)))


@check
def segments_and_alibi_batch_and_heads(data, model):
  # Segment ids [B, T], [B, S] split along batch, [B, H] slopes along batch and
  # heads, next to q, k, v split along batch and heads: still no collective.
  m = mesh(data, model)
  q, k, v = qkv(4)
  ids = jax.random.randint(jax.random.key(2), (B, T + S), 0, 3)
  q_ids, kv_ids = jnp.sort(ids[:, :T], axis=1), jnp.sort(ids[:, T:], axis=1)
  slopes = jax.random.uniform(jax.random.key(3), (B, H), minval=0.05, maxval=0.5)

  fn = jax.value_and_grad(packed_loss, argnums=(0, 1, 2))
  spec = P("data", None, "model", None)
  args = (q, k, v, slopes, q_ids, kv_ids)
  specs = (spec, spec, spec, P("data", "model"), P("data"), P("data"))
  grads, hlo = sharded_run(m, fn, args, specs)
  assert_close(grads, fn(*args), GRAD_TOL)
  assert not collectives(hlo), collectives(hlo)
  shapes = kernel_operand_shapes(hlo)
  assert {shape for shape, _ in shapes} == {f"{B // data},{T},{H // model},{D}"}, shapes
  # Shared [H] slopes (replicated) are split along heads locally.
  shared = lambda q, k, v, q_ids, kv_ids: packed_loss(q, k, v, slopes[0], q_ids, kv_ids)  # noqa: E731
  fn = jax.value_and_grad(shared, argnums=(0, 1, 2))
  grads, hlo = sharded_run(m, fn, (q, k, v, q_ids, kv_ids),
                           (spec, spec, spec, P("data"), P("data")))
  assert_close(grads, fn(q, k, v, q_ids, kv_ids), GRAD_TOL)
  assert not collectives(hlo), collectives(hlo)
  return f"per-device kernel shapes {shapes}"


@check
def dropout_batch_and_heads(data, model):
  # The [B, H, 2] dropout seeds are drawn from one replicated key and split
  # with q along batch and heads: the same masks as on one device.
  m = mesh(data, model)
  q, k, v = qkv(4)
  key = jax.random.key(3)
  spec = P("data", None, "model", None)

  def dropout_loss(q, k, v):
    out = jax_flash2.flash_attention(q, k, v, causal=True, dropout_rate=0.3, dropout_rng=key)
    return jnp.sum(jnp.sin(out.astype(jnp.float32)))

  fn = jax.value_and_grad(dropout_loss, argnums=(0, 1, 2))
  grads, hlo = sharded_run(m, fn, (q, k, v), (spec, spec, spec))
  assert_close(grads, fn(q, k, v), GRAD_TOL)
  assert not collectives(hlo), collectives(hlo)
  shapes = kernel_operand_shapes(hlo)
  assert {shape for shape, _ in shapes} == {f"{B // data},{T},{H // model},{D}"}, shapes
  return f"per-device kernel shapes {shapes}"


@check
def shard_map_with_segments(data, model):
  # Per device: H/model heads and the matching part of the [H] slopes, which
  # vary over "model" only while q varies over both axes (flash_attention makes
  # them vary alike).
  m = mesh(data, model)
  q, k, v = qkv(4)
  q_ids = jnp.broadcast_to(jnp.arange(T) // 10, (B, T)).astype(jnp.int32)
  kv_ids = jnp.broadcast_to(jnp.arange(S) // 15, (B, S)).astype(jnp.int32)
  slopes = jnp.linspace(0.1, 0.8, H, dtype=jnp.float32)

  fn = jax.value_and_grad(packed_loss, argnums=(0, 1, 2))
  spec = P("data", None, "model", None)

  @jax.jit
  @jax.shard_map(mesh=m, in_specs=(spec,) * 3 + (P("model"), P("data"), P("data")),
                 out_specs=(P(), (spec,) * 3))
  def per_device(q, k, v, slopes, q_ids, kv_ids):
    value, grads = fn(q, k, v, slopes, q_ids, kv_ids)
    return jax.lax.psum(value, ("data", "model")), grads

  args = (q, k, v, slopes, q_ids, kv_ids)
  assert_close(per_device(*args), fn(*args), GRAD_TOL)


@check
def gqa_heads_not_divisible_are_gathered(data, model):
  # K kv heads that `model` devices cannot split into whole groups: heads are
  # gathered (K = 2 over 4 devices).
  kv_heads = next((k for k in (2, 4, 8) if H % k == 0 and k % model), None)
  if kv_heads is None:
    raise Skip(f"every K > 1 dividing H={H} splits over model={model}")
  m = mesh(data, model)
  q, k, v = qkv(kv_heads)
  specs = (P("data", None, "model"), P("data"), P("data"))
  grads, hlo = sharded_run(m, value_and_grads, (q, k, v), specs)
  assert_close(grads, value_and_grads(q, k, v), GRAD_TOL)
  return f"K={kv_heads}, collectives {sorted(collectives(hlo))}"


@check
def sequence_and_head_dim_sharding_is_correct(data, model):
  m = mesh(data, model)
  q, k, v = qkv(4)
  ref = value_and_grads(q, k, v)
  details = []
  for spec in (P("data", "model"), P(None, None, None, ("data", "model"))):
    grads, hlo = sharded_run(m, value_and_grads, (q, k, v), (spec, spec, spec))
    assert_close(grads, ref, GRAD_TOL)
    details.append(f"{spec}: {sorted(collectives(hlo))}")
  return "; ".join(details)


@check
def vmap_under_sharded_jit(data, model):
  # The vmapped axis stays a separate leading axis, so a sharded B is kept.
  m = mesh(data, model)
  q, k, v = qkv(4, lead=(2, B // 2))
  spec = P(None, "data", None, "model", None)
  fn = jax.vmap(value_and_grads)
  grads, hlo = sharded_run(m, fn, (q, k, v), (spec, spec, spec))
  assert_close(grads, fn(q, k, v), GRAD_TOL)
  assert not collectives(hlo), collectives(hlo)
  return f"per-device kernel shapes {kernel_operand_shapes(hlo)}"


@check
def gspmd_partitioner(data, model):
  # jax's older partitioner reads infer_sharding_from_operands instead of the
  # Shardy rule.
  jax.config.update("jax_use_shardy_partitioner", False)
  try:
    m = mesh(data, model)
    q, k, v = qkv(4)
    spec = P("data", None, "model", None)
    grads, hlo = sharded_run(m, value_and_grads, (q, k, v), (spec, spec, spec))
    assert_close(grads, value_and_grads(q, k, v), GRAD_TOL)
    assert not collectives(hlo), collectives(hlo)
  finally:
    jax.config.update("jax_use_shardy_partitioner", True)


@check
def explicit_mesh_axes(data, model):
  # Sharding in types: results are typed with the batch and head sharding,
  # for GQA (k, v split along heads) and MQA (k, v replicated).
  m = mesh(data, model, jax.sharding.AxisType.Explicit)
  spec = P("data", None, "model", None)
  for kv_heads, kv_spec in ((4, spec), (1, P("data", None, None, None))):
    q, k, v = qkv(kv_heads)
    args = [jax.device_put(x, NamedSharding(m, s))
            for x, s in zip((q, k, v), (spec, kv_spec, kv_spec))]
    fwd = jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True))
    out = fwd(*args)
    # Equivalence, not spec equality: jax drops mesh axes of size 1 from the spec.
    assert out.sharding.is_equivalent_to(NamedSharding(m, spec), out.ndim), out.sharding
    assert not collectives(fwd.lower(*args).compile().as_text())
    assert_close(out, fwd(q, k, v))
    assert_close(jax.jit(value_and_grads)(*args), value_and_grads(q, k, v), GRAD_TOL)


@check
def explicit_mesh_forward_ad(data, model):
  # Sharding in types: the tangent primitive types its results like (out, lse).
  m = mesh(data, model, jax.sharding.AxisType.Explicit)
  q, k, v = qkv(4)
  spec = P("data", None, "model", None)
  args = [jax.device_put(x, NamedSharding(m, spec)) for x in (q, k, v)]
  f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True, return_lse=True)
  jvp = jax.jit(lambda q, k, v: jax.jvp(f, (q, k, v), (jnp.sin(q), k, v))[1])
  t_out, t_lse = jvp(*args)
  # Equivalence, not spec equality: jax drops mesh axes of size 1 from the spec.
  assert t_out.sharding.is_equivalent_to(NamedSharding(m, spec), t_out.ndim), t_out.sharding
  lse_sharding = NamedSharding(m, P("data", "model", None))
  assert t_lse.sharding.is_equivalent_to(lse_sharding, t_lse.ndim), t_lse.sharding
  assert_close((t_out, t_lse), jvp(q, k, v), GRAD_TOL)


@check
def shard_map_with_checks(data, model):
  m = mesh(data, model)
  q, k, v = qkv(4)
  spec = P("data", None, "model", None)

  @jax.jit
  @jax.shard_map(mesh=m, in_specs=(spec,) * 3, out_specs=(P(), (spec,) * 3))
  def per_device(q, k, v):
    value, grads = value_and_grads(q, k, v)
    return jax.lax.psum(value, ("data", "model")), grads

  assert_close(per_device(q, k, v), value_and_grads(q, k, v), GRAD_TOL)


def jvp_of_packed(q, k, v, slopes, q_ids, kv_ids):
  """Tangents of (out, lse) with segment ids and slopes, for tangents
  (sin q, cos k, v)."""
  f = lambda q, k, v: jax_flash2.flash_attention(
      q, k, v, causal=True, return_lse=True, alibi_slopes=slopes, segment_ids=(q_ids, kv_ids))
  return jax.jvp(f, (q, k, v), (jnp.sin(q), jnp.cos(k), v))[1]


def packed_args():
  q, k, v = qkv(4)
  q_ids = jnp.broadcast_to(jnp.arange(T) // 10, (B, T)).astype(jnp.int32)
  kv_ids = jnp.broadcast_to(jnp.arange(S) // 15, (B, S)).astype(jnp.int32)
  return q, k, v, jnp.linspace(0.1, 0.8, H, dtype=jnp.float32), q_ids, kv_ids


@check
def shard_map_forward_ad(data, model):
  # jax.jvp per device with vma checks: the replicated slopes and ids vary
  # like q inside the tangent primitive too.
  m = mesh(data, model)
  args = packed_args()
  spec = P("data", None, "model", None)

  @jax.jit
  @jax.shard_map(mesh=m, in_specs=(spec,) * 3 + (P("model"), P("data"), P("data")),
                 out_specs=(spec, P("data", "model", None)))
  def per_device(*args):
    return jvp_of_packed(*args)

  assert_close(per_device(*args), jvp_of_packed(*args), GRAD_TOL)


@check
def sharded_jit_forward_ad(data, model):
  # jit over a mesh: the forward kernel is partitioned along batch and heads,
  # and the plain-JAX tangents follow without gathering q, k, v.
  args = packed_args()
  spec = P("data", None, "model", None)
  specs = (spec,) * 3 + (P("model"), P("data"), P("data"))
  tangents, hlo = sharded_run(mesh(data, model), jvp_of_packed, args, specs)
  assert_close(tangents, jvp_of_packed(*args), GRAD_TOL)
  assert not collectives(hlo), collectives(hlo)
  return f"per-device kernel shapes {kernel_operand_shapes(hlo)}"


@check
def pmap_training_step():
  # A data-parallel SGD step on a one-layer attention model: float32 weights,
  # attention in DTYPE.
  n = jax.device_count()
  keys = jax.random.split(jax.random.key(1), 4)
  params = {name: 0.2 * jax.random.normal(key, (D * 2, H, D))
            for name, key in zip(("wq", "wk", "wv"), keys)}
  params["wk"] = params["wk"][:, :2]
  params["wv"] = params["wv"][:, :2]
  x = jax.random.normal(keys[3], (n * 2, T, D * 2))

  def model_loss(params, x):
    q, k, v = (jnp.einsum("btf,fhd->bthd", x, params[w]).astype(DTYPE)
               for w in ("wq", "wk", "wv"))
    out = jax_flash2.flash_attention(q, k, v, causal=True).astype(jnp.float32)
    return jnp.mean((out.sum(axis=2) - x[..., :D]) ** 2)

  def step(params, x, axis_name=None):
    value, grads = jax.value_and_grad(model_loss)(params, x)
    if axis_name:
      value, grads = jax.lax.pmean((value, grads), axis_name)
    return value, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

  replicated = jax.tree.map(lambda p: jnp.broadcast_to(p, (n,) + p.shape), params)
  pmapped = jax.pmap(lambda p, x: step(p, x, "batch"), axis_name="batch")
  value, new = pmapped(replicated, x.reshape(n, 2, T, D * 2))
  ref_value, ref_new = step(params, x)
  assert_close(value, jnp.broadcast_to(ref_value, (n,)), STEP_TOL)
  assert_close(jax.tree.map(lambda p: p[0], new), ref_new, STEP_TOL)
  return f"{n} device(s), loss {float(value[0]):.5f}"


@check
def sharded_export(data, model):
  # Exports are lowered without custom_partitioning (it cannot be serialized):
  # a sharded export runs, gathered.
  from jax import export

  import jax_flash2.export

  m = mesh(data, model)
  q, k, v = qkv(4)
  sharding = NamedSharding(m, P("data", None, "model", None))
  fwd = jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True),
                in_shardings=(sharding,) * 3, out_shardings=sharding)
  exported = export.export(fwd, disabled_checks=jax_flash2.export.disabled_checks())(q, k, v)
  restored = export.deserialize(exported.serialize())
  args = [jax.device_put(x, sharding) for x in (q, k, v)]
  out = restored.call(*args)
  assert out.sharding.spec == sharding.spec, out.sharding
  assert_close(out, fwd(q, k, v))


def run(name):
  """(status, detail) of one check: PASS, SKIP or FAIL."""
  try:
    return "PASS", CHECKS[name]() or ""
  except Skip as e:
    return "SKIP", str(e)
  except NotImplementedError as e:
    # A valid request the CUDA kernels do not serve yet (segment ids, ALiBi):
    # not a failure there. On CPU every check must run.
    if ARGS.platform == "gpu":
      return "SKIP", f"NotImplementedError: {e}"
    return "FAIL", traceback.format_exc()
  except Exception:  # noqa: BLE001 - reported as failed, the other checks still run
    return "FAIL", traceback.format_exc()


def main(args):
  devices = jax.devices()
  expected = args.devices or (8 if args.platform == "cpu" else len(devices))
  assert len(devices) == expected, f"expected {expected} devices, found {devices}"
  unknown = sorted(set(args.names) - set(CHECKS))
  if unknown:
    raise SystemExit(f"unknown checks {unknown}; known: {sorted(CHECKS)}")
  if not args.json:
    print(f"{len(devices)} x {devices[0].device_kind} ({args.platform}), inputs {DTYPE.name}, "
          f"mesh layouts (data, model) {layouts(len(devices))}", flush=True)
  counts = {"PASS": 0, "SKIP": 0, "FAIL": 0}
  for name in args.names or CHECKS:
    status, detail = run(name)
    counts[status] += 1
    if args.json:
      print(json.dumps({"name": name, "ok": status != "FAIL", "skipped": status == "SKIP",
                        "detail": detail}), flush=True)
    else:
      print(f"{status} {name}: {detail.strip()}", flush=True)
  if not args.json:
    print(f"{counts['PASS']} passed, {counts['SKIP']} skipped, {counts['FAIL']} failed")
  return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
  sys.exit(main(ARGS))
