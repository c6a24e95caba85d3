"""Multi-device checks, run by tests/test_sharding.py in a fresh process.

The 8 CPU devices exist only if XLA_FLAGS is set before jax initializes, so this
file sets it and is run as a script; the rest of the suite keeps one device.
Each check prints one JSON line {"name", "ok", "detail"}; a check that raises
is reported as failed with the exception, and the others still run.

  PYTHONPATH=. python tests/multi_device_checks.py [name ...]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8")

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
TOL = dict(atol=1e-5, rtol=1e-5)
CHECKS = {}


def check(fn):
  CHECKS[fn.__name__] = fn
  return fn


def qkv(kv_heads, lead=(B,), seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], lead + (T, H, D), jnp.float32)
  k = jax.random.normal(keys[1], lead + (S, kv_heads, D), jnp.float32)
  v = jax.random.normal(keys[2], lead + (S, kv_heads, D), jnp.float32)
  return q, k, v


def loss(q, k, v):
  return jnp.sum(jnp.sin(jax_flash2.flash_attention(q, k, v, causal=True)))


value_and_grads = jax.value_and_grad(loss, argnums=(0, 1, 2))


def assert_close(actual, expected, tol=TOL):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), **tol)


def collectives(hlo: str) -> set[str]:
  return set(re.findall(r"all-gather|all-to-all|collective-permute", hlo))


def kernel_operand_shapes(hlo: str) -> list[str]:
  """Shapes of the first operand (q) of every flash custom call in the HLO."""
  targets = "|".join((_ext.FORWARD_TARGET, _ext.BACKWARD_TARGET))
  pattern = rf'custom_call_target="({targets})", operand_layout_constraints=\{{f32\[([\d,]+)\]'
  return [(shape, target) for target, shape in re.findall(pattern, hlo)]


def mesh(shape=(2, 4), names=("data", "model")):
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def sharded_run(fn, args, specs, out_specs=None):
  m = mesh()
  in_shardings = tuple(NamedSharding(m, s) for s in specs)
  out_shardings = None
  if out_specs is not None:
    out_shardings = jax.tree.map(lambda s: NamedSharding(m, s), out_specs,
                                 is_leaf=lambda s: isinstance(s, P))
  jitted = jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings)
  hlo = jitted.lower(*args).compile().as_text()
  return jitted(*args), hlo


def batch_and_head_sharded(kv_heads, kv_spec):
  """Forward and gradients on a (data=2, model=4) mesh against one device."""
  q, k, v = qkv(kv_heads)
  q_spec = P("data", None, "model", None)
  fwd = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True)  # noqa: E731
  out, hlo = sharded_run(fwd, (q, k, v), (q_spec, kv_spec, kv_spec), q_spec)
  assert_close(out, fwd(q, k, v))
  assert not collectives(hlo), collectives(hlo)
  # Each device runs the kernel on its own block: B/2 batch, H/4 heads.
  assert kernel_operand_shapes(hlo) == [(f"{B // 2},{T},{H // 4},{D}", _ext.FORWARD_TARGET)], (
      kernel_operand_shapes(hlo))

  grads, hlo = sharded_run(value_and_grads, (q, k, v), (q_spec, kv_spec, kv_spec))
  assert_close(grads, value_and_grads(q, k, v), dict(atol=1e-4, rtol=1e-5))
  assert not collectives(hlo), collectives(hlo)
  shapes = kernel_operand_shapes(hlo)
  assert {shape for shape, _ in shapes} == {f"{B // 2},{T},{H // 4},{D}"}, shapes
  return f"per-device kernel shapes {shapes}"


@check
def mha_batch_and_heads():
  return batch_and_head_sharded(H, P("data", None, "model", None))


@check
def gqa_batch_and_heads():
  # K = 4 over 4 devices: each holds one kv head and its group of 2 q heads.
  return batch_and_head_sharded(4, P("data", None, "model", None))


@check
def mqa_batch_and_heads():
  # K = 1: q heads split, k and v replicated; the backward sums dk, dv.
  return batch_and_head_sharded(1, P("data", None, None, None))


def packed_loss(q, k, v, slopes, q_ids, kv_ids):
  """Causal attention with ALiBi slopes and segment ids, reduced to a scalar."""
  out = jax_flash2.flash_attention(q, k, v, causal=True, alibi_slopes=slopes,
                                   segment_ids=(q_ids, kv_ids))
  return jnp.sum(jnp.sin(out))


@check
def segments_and_alibi_batch_and_heads():
  # Segment ids [B, T], [B, S] split along batch, [B, H] slopes along batch and
  # heads, next to q, k, v split along batch and heads: still no collective.
  q, k, v = qkv(4)
  ids = jax.random.randint(jax.random.key(2), (B, T + S), 0, 3)
  q_ids, kv_ids = jnp.sort(ids[:, :T], axis=1), jnp.sort(ids[:, T:], axis=1)
  slopes = jax.random.uniform(jax.random.key(3), (B, H), minval=0.05, maxval=0.5)

  fn = jax.value_and_grad(packed_loss, argnums=(0, 1, 2))
  spec = P("data", None, "model", None)
  args = (q, k, v, slopes, q_ids, kv_ids)
  specs = (spec, spec, spec, P("data", "model"), P("data"), P("data"))
  grads, hlo = sharded_run(fn, args, specs)
  assert_close(grads, fn(*args), dict(atol=1e-4, rtol=1e-5))
  assert not collectives(hlo), collectives(hlo)
  shapes = kernel_operand_shapes(hlo)
  assert {shape for shape, _ in shapes} == {f"{B // 2},{T},{H // 4},{D}"}, shapes
  # Shared [H] slopes (replicated) are split along heads locally.
  shared = lambda q, k, v, q_ids, kv_ids: packed_loss(q, k, v, slopes[0], q_ids, kv_ids)  # noqa: E731
  fn = jax.value_and_grad(shared, argnums=(0, 1, 2))
  grads, hlo = sharded_run(fn, (q, k, v, q_ids, kv_ids), (spec, spec, spec, P("data"), P("data")))
  assert_close(grads, fn(q, k, v, q_ids, kv_ids), dict(atol=1e-4, rtol=1e-5))
  assert not collectives(hlo), collectives(hlo)
  return f"per-device kernel shapes {shapes}"


@check
def shard_map_with_segments():
  # Per device: H/4 heads and the matching quarter of the [H] slopes, which
  # vary over "model" only while q varies over both axes (flash_attention makes
  # them vary alike).
  m = mesh()
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
  assert_close(per_device(*args), fn(*args), dict(atol=1e-4, rtol=1e-5))


@check
def gqa_heads_not_divisible_are_gathered():
  # K = 2 cannot be split 4 ways with whole groups: heads are gathered.
  q, k, v = qkv(2)
  specs = (P("data", None, "model"), P("data"), P("data"))
  grads, hlo = sharded_run(value_and_grads, (q, k, v), specs)
  assert_close(grads, value_and_grads(q, k, v), dict(atol=1e-4, rtol=1e-5))
  return f"collectives {sorted(collectives(hlo))}"


@check
def sequence_and_head_dim_sharding_is_correct():
  q, k, v = qkv(4)
  ref = value_and_grads(q, k, v)
  details = []
  for spec in (P("data", "model"), P(None, None, None, ("data", "model"))):
    grads, hlo = sharded_run(value_and_grads, (q, k, v), (spec, spec, spec))
    assert_close(grads, ref, dict(atol=1e-4, rtol=1e-5))
    details.append(f"{spec}: {sorted(collectives(hlo))}")
  return "; ".join(details)


@check
def vmap_under_sharded_jit():
  # The vmapped axis stays a separate leading axis, so a sharded B is kept.
  q, k, v = qkv(4, lead=(2, B // 2))
  spec = P(None, "data", None, "model", None)
  fn = jax.vmap(value_and_grads)
  grads, hlo = sharded_run(fn, (q, k, v), (spec, spec, spec))
  assert_close(grads, fn(q, k, v), dict(atol=1e-4, rtol=1e-5))
  assert not collectives(hlo), collectives(hlo)
  return f"per-device kernel shapes {kernel_operand_shapes(hlo)}"


@check
def gspmd_partitioner():
  # jax's older partitioner reads infer_sharding_from_operands instead of the
  # Shardy rule.
  jax.config.update("jax_use_shardy_partitioner", False)
  try:
    q, k, v = qkv(4)
    spec = P("data", None, "model", None)
    grads, hlo = sharded_run(value_and_grads, (q, k, v), (spec, spec, spec))
    assert_close(grads, value_and_grads(q, k, v), dict(atol=1e-4, rtol=1e-5))
    assert not collectives(hlo), collectives(hlo)
  finally:
    jax.config.update("jax_use_shardy_partitioner", True)


@check
def explicit_mesh_axes():
  # Sharding in types: results are typed with the batch and head sharding.
  m = jax.make_mesh((2, 4), ("data", "model"),
                    axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  q, k, v = qkv(4)
  spec = P("data", None, "model", None)
  args = [jax.device_put(x, NamedSharding(m, spec)) for x in (q, k, v)]
  fwd = jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True))
  out = fwd(*args)
  assert out.sharding.spec == spec, out.sharding
  assert not collectives(fwd.lower(*args).compile().as_text())
  assert_close(out, fwd(q, k, v))
  assert_close(jax.jit(value_and_grads)(*args), value_and_grads(q, k, v),
               dict(atol=1e-4, rtol=1e-5))


@check
def explicit_mesh_forward_ad():
  # Sharding in types: the tangent primitive types its results like (out, lse).
  m = jax.make_mesh((2, 4), ("data", "model"),
                    axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  q, k, v = qkv(4)
  spec = P("data", None, "model", None)
  args = [jax.device_put(x, NamedSharding(m, spec)) for x in (q, k, v)]
  f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True, return_lse=True)
  jvp = jax.jit(lambda q, k, v: jax.jvp(f, (q, k, v), (jnp.sin(q), k, v))[1])
  t_out, t_lse = jvp(*args)
  assert t_out.sharding.spec == spec, t_out.sharding
  assert t_lse.sharding.spec == P("data", "model", None), t_lse.sharding
  assert_close((t_out, t_lse), jvp(q, k, v), dict(atol=1e-5, rtol=1e-4))


@check
def shard_map_with_checks():
  m = mesh()
  q, k, v = qkv(4)
  spec = P("data", None, "model", None)

  @jax.jit
  @jax.shard_map(mesh=m, in_specs=(spec,) * 3, out_specs=(P(), (spec,) * 3))
  def per_device(q, k, v):
    value, grads = value_and_grads(q, k, v)
    return jax.lax.psum(value, ("data", "model")), grads

  assert_close(per_device(q, k, v), value_and_grads(q, k, v), dict(atol=1e-4, rtol=1e-5))


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
def shard_map_forward_ad():
  # jax.jvp per device with vma checks: the replicated slopes and ids vary
  # like q inside the tangent primitive too.
  m = mesh()
  args = packed_args()
  spec = P("data", None, "model", None)

  @jax.jit
  @jax.shard_map(mesh=m, in_specs=(spec,) * 3 + (P("model"), P("data"), P("data")),
                 out_specs=(spec, P("data", "model", None)))
  def per_device(*args):
    return jvp_of_packed(*args)

  assert_close(per_device(*args), jvp_of_packed(*args), dict(atol=1e-5, rtol=1e-4))


@check
def sharded_jit_forward_ad():
  # jit over a mesh: the forward kernel is partitioned along batch and heads,
  # and the plain-JAX tangents follow without gathering q, k, v.
  args = packed_args()
  spec = P("data", None, "model", None)
  specs = (spec,) * 3 + (P("model"), P("data"), P("data"))
  tangents, hlo = sharded_run(jvp_of_packed, args, specs)
  assert_close(tangents, jvp_of_packed(*args), dict(atol=1e-5, rtol=1e-4))
  assert not collectives(hlo), collectives(hlo)
  return f"per-device kernel shapes {kernel_operand_shapes(hlo)}"


@check
def pmap_training_step():
  # A data-parallel SGD step on a one-layer attention model.
  n = jax.device_count()
  keys = jax.random.split(jax.random.key(1), 4)
  params = {name: 0.2 * jax.random.normal(key, (D * 2, H, D))
            for name, key in zip(("wq", "wk", "wv"), keys)}
  params["wk"] = params["wk"][:, :2]
  params["wv"] = params["wv"][:, :2]
  x = jax.random.normal(keys[3], (n * 2, T, D * 2))

  def model_loss(params, x):
    q, k, v = (jnp.einsum("btf,fhd->bthd", x, params[w]) for w in ("wq", "wk", "wv"))
    out = jax_flash2.flash_attention(q, k, v, causal=True)
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
  assert_close(value, jnp.broadcast_to(ref_value, (n,)), dict(atol=1e-5, rtol=1e-4))
  assert_close(jax.tree.map(lambda p: p[0], new), ref_new, dict(atol=1e-5, rtol=1e-4))


@check
def sharded_export():
  # Exports are lowered without custom_partitioning (it cannot be serialized):
  # a sharded export runs, gathered.
  from jax import export

  import jax_flash2.export

  m = mesh()
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


def main(names):
  assert jax.device_count() == 8, jax.devices()
  for name in names or CHECKS:
    try:
      detail = CHECKS[name]() or ""
      ok = True
    except Exception:  # noqa: BLE001 - reported to the test, which fails on it
      detail, ok = traceback.format_exc(), False
    print(json.dumps({"name": name, "ok": ok, "detail": detail}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1:])
