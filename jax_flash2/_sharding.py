"""Partition-aware calls of the attention primitives.

_autodiff calls exactly `forward` and `backward`. They bind two wrapper primitives
whose lowering goes through `jax.experimental.custom_partitioning`, so that jit
over a mesh splits the kernels along batch and heads instead of gathering q, k
and v onto every device.

Why wrapper primitives rather than calling a custom_partitioning function
directly: custom_partitioning has no batching rule, so vmap of it fails. The
wrappers batch by taking the vmapped axis as one more leading batch axis (no
reshape, so a sharded B stays expressible), and reach custom_partitioning only
at lowering time, when nothing is left to batch. Inside it the per-device
function merges the leading axes into B and binds the core primitives
flash_fwd_p / flash_bwd_p on per-device shapes.

Operands here are [*L, T, H, D] for q, out, d_out, [*L, S, K, D] for k, v,
[*L, H, T] for lse, d_lse, and the ExtraOperands ([*L, H] ALiBi slopes,
[*L, T] and [*L, S] query and key segment ids, [*L, H, 2] dropout seeds),
with L the leading batch axes (B, plus one per vmap). The extra operands are
always passed (zeros when unused); the primitives take them flat, after the
others, and every function here names them through ExtraOperands.

What gets partitioned:
  * L: split freely; every batch entry is an independent attention problem.
    The slopes, segment ids and dropout seeds follow q's leading axes.
  * H and K together (and the H of the slopes and seeds with them): a shard holds whole GQA groups, H/n query heads and the
    K/n kv heads they read, which needs K % n == 0. With K == 1 (MQA) query
    heads may be split while k and v stay replicated; the backward then sums
    the partial dk, dv over the head axes. Any other head split is gathered.
  * T and S split over the same Auto mesh axes: jax_flash2.context_parallel's
    ring (or all-gather of K/V) serves the call when it can (no ALiBi, no
    dropout; causal or a window need T == S); otherwise T, S are gathered.
    D is gathered (correct, not fast): a split head_dim needs a cross-device
    softmax.

Two partitioners: Shardy (jax's default since 0.7) reads the einsum-like
`sharding_rule`; GSPMD (jax_use_shardy_partitioner=False) reads
`infer_sharding_from_operands`. Both then call `partition`, which settles the
final shardings and returns the per-device function. Under shard_map (all axes
manual) and pmap there is nothing to partition and custom_partitioning lowers
straight to the per-device function. jax.export lowers without
custom_partitioning (see `_define`).
"""

from __future__ import annotations

import math

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

# custom_partitioning needs the device assignment while lowering, and jit hands
# it down only for primitives listed in this registry. There is no public API
# for it (jax's own cuDNN attention registers its wrappers the same way).
from jax._src import dispatch as _dispatch

from jax_flash2 import _primitives
from jax_flash2._config import ExtraOperands


def forward(q, k, v, extras: ExtraOperands, config):
  """(out, lse) = flash forward of q [*L, T, H, D], k, v [*L, S, K, D]."""
  extras = [vary_like(x, q) for x in extras]
  return tuple(_fwd_p.bind(q, k, v, *extras, config=config))


def backward(q, k, v, out, lse, d_out, d_lse, extras: ExtraOperands, config):
  """(dq, dk, dv) from the forward's residuals and the output cotangents."""
  extras = [vary_like(x, q) for x in extras]
  return tuple(_bwd_p.bind(q, k, v, out, lse, d_out, d_lse, *extras, config=config))


def vary_like(x, ref):
  """x, made to vary over the shard_map axes `ref` varies over. The slopes,
  ids and seeds are often replicated (shared parameters, or the zeros standing in for an
  unused option) while q varies; the kernels need them typed alike."""
  missing = _varying(jax.typeof(ref)) - _varying(jax.typeof(x))
  if not missing:
    return x
  return jax.lax.pcast(x, tuple(sorted(missing)), to="varying")


# Sharding decisions, shared by the Shardy and GSPMD paths and by the types
# under Explicit mesh axes.


def _axes(entry) -> tuple:
  """A PartitionSpec entry as a tuple of mesh axis names."""
  if entry is None:
    return ()
  if isinstance(entry, str):
    return (entry,)
  return tuple(entry)


def _entry(axes: tuple):
  """The inverse of `_axes`."""
  if not axes:
    return None
  return axes[0] if len(axes) == 1 else axes


def _plan(mesh, q_sharding, q_ndim: int, num_heads: int, num_kv_heads: int):
  """Mesh axes (per leading axis, for q heads, for kv heads) from q's sharding.

  The leading axes keep q's sharding. Heads keep q's head axes when each shard
  can hold whole GQA groups (K divisible by the shard count), or when K == 1
  and k, v can simply be replicated; otherwise heads are gathered. Head axes of
  size 1 are kept: under Explicit axes the gradients must carry the operands'
  types, size-1 axes included.
  """
  spec = tuple(getattr(q_sharding, "spec", None) or ())
  spec = spec + (None,) * (q_ndim - len(spec))
  lead = tuple(_axes(e) for e in spec[:q_ndim - 3])
  heads = _axes(spec[q_ndim - 2])
  n = math.prod(mesh.shape[a] for a in heads)
  if num_heads % n:
    return lead, (), ()
  # K == 1 first: over a head axis of size 1 both rules apply, and MQA's k, v
  # are typically replicated.
  if num_kv_heads == 1:
    return lead, heads, ()
  if num_kv_heads % n == 0:
    return lead, heads, heads
  return lead, (), ()


def _specs(lead: tuple, heads: tuple, kv_heads: tuple, seq: tuple = ()):
  """PartitionSpecs for [*L, T, H, D], [*L, S, K, D] and [*L, H, T] arrays, and
  the ExtraOperands' specs: the slopes and seeds follow q's heads, the
  segment ids the leading axes (and T, S with them: `seq`, the axes of a
  context-parallel ring)."""
  lead = tuple(_entry(a) for a in lead)
  h, kh, s = _entry(heads), _entry(kv_heads), _entry(seq)
  extras = ExtraOperands(alibi_slopes=P(*lead, h), q_segment_ids=P(*lead, s),
                         kv_segment_ids=P(*lead, s), dropout_seeds=P(*lead, h, None),
                         kv_seqlens=P(*lead), block_table=P(*lead, None),
                         kv_scales=P(*lead, None, None, kh))
  return P(*lead, s, h, None), P(*lead, s, kh, None), P(*lead, h, s), extras


# What serves q, k, v split along the sequence: jax_flash2.context_parallel
# registers itself here when imported (it sits above this module); None
# gathers T and S.
sequence_parallel = None


def _ring_plan(config, mesh, arg_shapes):
  """(ring config, sequence axes) when q's T and k's S are split over the same
  Auto mesh axes and `sequence_parallel` serves the call; else (None, ()):
  T and S are gathered. Both partitioners hand `partition` the operands'
  sequence sharding (tests/cp_checks.py checks Shardy and GSPMD)."""
  q, k = arg_shapes[0], arg_shapes[1]
  specs = [tuple(getattr(x.sharding, "spec", None) or ()) + (None,) * x.ndim for x in (q, k)]
  seq = _axes(specs[0][q.ndim - 3])
  types = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ())))
  if (sequence_parallel is None or not seq or _axes(specs[1][k.ndim - 3]) != seq
      or any(types.get(a) == jax.sharding.AxisType.Explicit for a in seq)):
    return None, ()
  ring = sequence_parallel.sequence_config(config, mesh, seq, q.shape, k.shape)
  return (ring, seq) if ring is not None else (None, ())


def _plan_shardings(mesh, arg_shapes, seq=()):
  q, k = arg_shapes[0], arg_shapes[1]
  lead, heads, kv_heads = _plan(mesh, q.sharding, q.ndim, q.shape[-2], k.shape[-2])
  q_spec, kv_spec, lse_spec, extra_specs = _specs(lead, heads, kv_heads, seq)
  q_like, kv_like, lse_like = (NamedSharding(mesh, s) for s in (q_spec, kv_spec, lse_spec))
  extras = ExtraOperands(*(NamedSharding(mesh, s) for s in extra_specs))
  # MQA with split query heads: each shard's dk, dv covers only its own query
  # heads, so the full gradient is their sum over the head axes.
  reduce_axes = heads if heads and not kv_heads else ()
  return q_like, kv_like, lse_like, extras, reduce_axes


def _shardy_rule(backward: bool):
  """Leading axes and heads pass through; T, S and D stay whole.

  Query heads `h` and kv heads `kv` are separate factors on purpose: as one
  compound factor `(kv group)` Shardy splits a mesh axis that does not divide
  K into sub-axes (say model:(1)2 on kv, model:(2)2 on group), for which there
  is no NamedSharding to hand to `partition`. `partition` lines them up.
  """
  q, k, v, o, lse = "... t h d", "... s kv d", "... s kv e", "... t h e", "... h t"
  extras = ", ".join(ExtraOperands(alibi_slopes="... h", q_segment_ids="... t",
                                   kv_segment_ids="... s",
                                   dropout_seeds="... h w",  # a seed is 2 words
                                   kv_seqlens="...", block_table="... pg",
                                   kv_scales="... kw ps kv"))
  if backward:
    rule = f"{q}, {k}, {v}, {o}, {lse}, {o}, {lse}, {extras} -> {q}, {k}, {v}"
  else:
    rule = f"{q}, {k}, {v}, {extras} -> {o}, {lse}"
  # Shardy wants special factors in the order they first appear.
  return dict(sharding_rule=rule, need_replication_factors=("t", "d", "s", "e", "w", "pg", "kw", "ps"))


# The per-device functions: merge the leading axes into B, call the kernels.


def _merge_lead(x, trailing: int):
  return x.reshape((-1,) + x.shape[x.ndim - trailing:])


# Trailing (non-batch) rank of the operands before the extra ones: q, k, v for
# the forward; q, k, v, out, lse, d_out, d_lse for the backward.
_FWD_TRAILING = (3, 3, 3)
_BWD_TRAILING = (3, 3, 3, 3, 2, 3, 2)


def _trailing_ranks(backward: bool) -> tuple:
  return (_BWD_TRAILING if backward else _FWD_TRAILING) + tuple(ExtraOperands.trailing_ranks())


def _local(prim, backward: bool):
  """The per-device function: merge the leading axes into B, bind the core
  primitive, split them again. config comes first (a static argument)."""

  def local(config, *args):
    lead = args[0].shape[:-3]
    merged = [_merge_lead(x, n) for x, n in zip(args, _trailing_ranks(backward), strict=True)]
    results = prim.bind(*merged, config=config)
    return tuple(r.reshape(lead + r.shape[1:]) for r in results)

  return local


_fwd_local = _local(_primitives.flash_fwd_p, backward=False)
_bwd_local = _local(_primitives.flash_bwd_p, backward=True)
_fwd_partitioned = custom_partitioning(_fwd_local, static_argnums=(0,))
_bwd_partitioned = custom_partitioning(_bwd_local, static_argnums=(0,))


def _fwd_infer(config, mesh, arg_shapes, result_shape):
  del result_shape
  _, seq = _ring_plan(config, mesh, arg_shapes)
  q_like, _, lse_like, _, _ = _plan_shardings(mesh, arg_shapes, seq)
  return q_like, lse_like


def _fwd_partition(config, mesh, arg_shapes, result_shape):
  del result_shape
  ring, seq = _ring_plan(config, mesh, arg_shapes)
  q_like, kv_like, lse_like, extras, _ = _plan_shardings(mesh, arg_shapes, seq)

  def per_device(*args):
    if ring is not None:
      return sequence_parallel.sequence_forward(ring, config, *args[:3],
                                               ExtraOperands(*args[3:]))
    return _fwd_local(config, *args)

  return mesh, per_device, (q_like, lse_like), (q_like, kv_like, kv_like, *extras)


def _bwd_infer(config, mesh, arg_shapes, result_shape):
  del result_shape
  _, seq = _ring_plan(config, mesh, arg_shapes)
  q_like, kv_like, _, _, _ = _plan_shardings(mesh, arg_shapes, seq)
  return q_like, kv_like, kv_like


def _bwd_partition(config, mesh, arg_shapes, result_shape):
  del result_shape
  ring, seq = _ring_plan(config, mesh, arg_shapes)
  q_like, kv_like, lse_like, extras, reduce_axes = _plan_shardings(mesh, arg_shapes, seq)

  def per_device(*args):
    if ring is not None:
      dq, dk, dv = sequence_parallel.sequence_backward(ring, config, *args[:7],
                                                      ExtraOperands(*args[7:]))
    else:
      dq, dk, dv = _bwd_local(config, *args)
    if reduce_axes:
      dk = jax.lax.psum(dk, reduce_axes)
      dv = jax.lax.psum(dv, reduce_axes)
    return dq, dk, dv

  arg_shardings = (q_like, kv_like, kv_like, q_like, lse_like, q_like, lse_like, *extras)
  return mesh, per_device, (q_like, kv_like, kv_like), arg_shardings


_fwd_partitioned.def_partition(
    partition=_fwd_partition, infer_sharding_from_operands=_fwd_infer,
    **_shardy_rule(backward=False))
_bwd_partitioned.def_partition(
    partition=_bwd_partition, infer_sharding_from_operands=_bwd_infer,
    **_shardy_rule(backward=True))


# The wrapper primitives.


def _varying(aval) -> frozenset:
  """Mesh axes a value varies over inside shard_map (empty elsewhere)."""
  mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if mat is not None:
    return mat.varying
  return getattr(aval, "vma", frozenset())  # jax 0.7 to 0.9


def result_types(outs, avals, backward: bool):
  """Puts mesh typing on the core primitive's result types.

  A core abstract eval leaves out two things:
    * sharding in types (jit over a mesh with Explicit axes): results carry the
      batch and head sharding `partition` gives them, so that jit does not
      gather them back to a replicated type;
    * manual axes (shard_map with check_vma): results vary over the axes the
      operands vary over; custom_jvp and shard_map compare these types.
  """
  q, k = avals[0], avals[1]
  mesh = getattr(getattr(q, "sharding", None), "mesh", None)
  if mesh is None or mesh.empty:
    return outs
  varying = _varying(q)
  if any(_varying(a) != varying for a in avals):
    raise ValueError(
        "flash_attention inside shard_map: the operands vary over different mesh "
        f"axes {[sorted(_varying(a)) for a in avals]}; make them vary alike, "
        "e.g. with jax.lax.pcast(x, axes, to=\"varying\")")
  q_like, kv_like, lse_like, _ = _specs(
      *_plan(mesh, q.sharding, q.ndim, q.shape[-2], k.shape[-2]))
  specs = (q_like, kv_like, kv_like) if backward else (q_like, lse_like)
  manual = {}
  if varying:
    manual = ({"manual_axis_type": q.manual_axis_type}
              if hasattr(q, "manual_axis_type") else {"vma": varying})
  return [o.update(sharding=NamedSharding(mesh, spec), **manual)
          for o, spec in zip(outs, specs)]


def _merged_aval(aval, trailing: int):
  return jax.core.ShapedArray(
      (math.prod(aval.shape[:aval.ndim - trailing]),) + aval.shape[aval.ndim - trailing:],
      aval.dtype)


def _define(name: str, inner: Primitive, local, partitioned, backward: bool):
  prim = Primitive(name)
  prim.multiple_results = True
  trailing = _trailing_ranks(backward)

  def impl(*args, config):
    return jax.jit(local, static_argnums=0)(config, *args)

  def abstract_eval(*avals, config):
    merged = [_merged_aval(a, n) for a, n in zip(avals, trailing, strict=True)]
    outs, effects = inner.abstract_eval(*merged, config=config)
    lead = avals[0].shape[:-3]
    outs = [o.update(shape=lead + o.shape[1:]) for o in outs]
    return result_types(outs, avals, backward), effects

  def batch_rule(args, dims, *, config):
    # The vmapped axis becomes one more leading batch axis. An unbatched
    # operand has dim None; bdim_at_front broadcasts it.
    size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
    args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
    outs = prim.bind(*args, config=config)
    return outs, [0] * len(outs)

  def lowering(ctx, *args, config):
    # jax.export cannot serialize custom_partitioning (its callbacks live in
    # this process), so an exported function calls the kernels unpartitioned:
    # a sharded export gathers q, k and v (correct, not fast).
    if getattr(ctx.module_context.lowering_parameters, "for_export", False):
      fn = local
    else:
      fn = partitioned
    return mlir.lower_fun(lambda *xs: fn(config, *xs), multiple_results=True)(ctx, *args)

  prim.def_impl(impl)
  prim.def_effectful_abstract_eval(abstract_eval)
  batching.primitive_batchers[prim] = batch_rule
  mlir.register_lowering(prim, lowering)
  _dispatch.prim_requires_devices_during_lowering.add(prim)
  return prim


_fwd_p = _define("jax_flash2_fwd_partitioned", _primitives.flash_fwd_p,
                 _fwd_local, _fwd_partitioned, backward=False)
_bwd_p = _define("jax_flash2_bwd_partitioned", _primitives.flash_bwd_p,
                 _bwd_local, _bwd_partitioned, backward=True)
