"""attention as a custom_jvp whose tangent map transposes into the backward kernel.

Forward mode (jax.jvp, jax.jacfwd): the forward kernel gives (out, lse), and
the linear primitive flash_jvp_p gives their tangents in plain JAX,
blockwise over query rows (_blockwise.tangents; not with dropout:
NotImplementedError).

  flash_jvp_p: (q, k, v, out, lse, tq, tk, tv, *ExtraOperands) -> (t_out, t_lse)

is linear in the tangents (tq, tk, tv); the rest are the forward's operands
and results. Operands lead with batch axes [*L] as in _sharding: [*L, T, H, D]
for q, out, tq; [*L, S, K, D] for k, v, tk, tv; [*L, H, T] for lse.

Reverse mode (jax.grad, jax.vjp): JAX linearizes the jvp rule into
flash_jvp_p and transposes it. The transpose of a map (tq, tk, tv) -> (t_out,
t_lse) is the map from cotangents (d_out, d_lse) to (dq, dk, dv), which is
exactly the backward kernel; so jax.grad runs one forward and one backward
kernel. The residuals are q, k, v, out and lse only (nothing T x S), plus the
small extra operands, and the backward recomputes P from the LSE, as
FlashAttention-2 does. The LSE output is differentiable too: its cotangent
enters the backward's preprocess as D = rowsum(dO * O) - dLSE. The extra
operands get no tangent and no cotangent: the ALiBi slopes are treated as
constants, the ids and seeds are integers. The dropout mask is regenerated
from the seeds in the backward, never saved.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.interpreters import batching
from jax.interpreters import mlir

from jax_flash2 import _blockwise, _sharding
from jax_flash2._config import AttentionConfig, ExtraOperands


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def attention(q, k, v, extras: ExtraOperands, config: AttentionConfig):
  """(out [B, T, H, D], lse [B, H, T] float32) for the kernels of the platform.

  extras are always passed (_config.extra_operands); config says which are used.
  """
  return _sharding.forward(q, k, v, extras, config)


@attention.defjvp
def _attention_jvp(config, primals, tangents):
  q, k, v, extras = primals
  tq, tk, tv = tangents[:3]
  # Calling attention itself (not the kernel) keeps the primal differentiable
  # by an outer jvp: nested forward mode sees this custom_jvp again.
  out, lse = attention(q, k, v, extras, config)
  args = (q, k, v, out, lse, tq, tk, tv, *extras)
  # Inside shard_map every operand must vary like q (the slopes, ids and
  # instantiated zero tangents may be replicated), as in _sharding.forward.
  args = [_sharding.vary_like(x, q) for x in args]
  t_out, t_lse = flash_jvp_p.bind(*args, config=config)
  return (out, lse), (t_out, t_lse)


# Positions of the tangent operands in flash_jvp_p's operand list.
_TANGENTS = slice(5, 8)


def _impl(*args, config):
  """flash_jvp_p on [*L] leading axes: merge them into B, compute, split them."""
  (q, k, v, out, lse, tq, tk, tv), extras = ExtraOperands.split(args)
  del out  # only the transpose (the backward kernel) reads it
  # Raised here, where tangents are computed, not in the custom_jvp rule:
  # jax.grad traces that rule too and never evaluates this.
  if config.dropout_rate > 0:
    raise NotImplementedError(
        "flash_attention: forward-mode AD (jax.jvp, jax.jacfwd, jax.hessian) with "
        f"dropout_rate > 0 is not implemented (got dropout_rate={config.dropout_rate}); "
        "reverse mode (jax.grad) is, or use implementation=\"reference\"")
  lead = q.shape[:-3]

  def merged(x, trailing):
    return x.reshape((-1,) + x.shape[x.ndim - trailing:])

  core = [merged(x, 3) for x in (q, k, v)] + [merged(lse, 2)]
  core += [merged(x, 3) for x in (tq, tk, tv)]
  extras = ExtraOperands(*(merged(x, n) for x, n in zip(extras, ExtraOperands.trailing_ranks())))
  t_out, t_lse = _blockwise.tangents(*core, extras, config)
  return [t_out.reshape(lead + t_out.shape[1:]), t_lse.reshape(lead + t_lse.shape[1:])]


def _abstract_eval(*avals, config):
  del config
  q, k, v, _, lse = avals[:5]
  outs = [jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(lse.shape, jnp.float32)]
  # Same mesh typing as the forward's (out, lse): sharding in types, and the
  # shard_map axes the operands vary over.
  return _sharding.result_types(outs, (q, k, v, lse), backward=False)


def _batch(args, dims, *, config):
  # The vmapped axis becomes one more leading batch axis, as in _sharding.
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  args = [batching.bdim_at_front(x, d, size) for x, d in zip(args, dims)]
  return flash_jvp_p.bind(*args, config=config), [0, 0]


def _jvp(primals, tangents_in, *, config):
  # The primitive is nonlinear in q, k, v and lse (for second-order forward
  # mode): differentiate its plain-JAX definition.
  tangents_in = tuple(ad.instantiate_zeros(t) for t in tangents_in)
  return jax.jvp(functools.partial(_impl, config=config), tuple(primals), tangents_in)


def _transpose(cotangents, *args, config):
  """(d_out, d_lse) -> (dq, dk, dv) on the tangent operands: the backward."""
  (q, k, v, out, lse, tq, tk, tv), extras = ExtraOperands.split(args)
  d_out, d_lse = cotangents
  result = [None] * len(args)  # no cotangent for the operands other than tq, tk, tv
  if type(d_out) is ad.Zero and type(d_lse) is ad.Zero:
    return result
  d_out, d_lse = (_sharding.vary_like(ad.instantiate_zeros(c), q) for c in (d_out, d_lse))
  grads = _backward(q, k, v, out, lse, d_out.astype(out.dtype), d_lse, extras, config)
  positions = range(len(args))[_TANGENTS]
  for i, operand, grad in zip(positions, (tq, tk, tv), grads):
    if ad.is_undefined_primal(operand):
      result[i] = grad
  return result


@functools.partial(jax.custom_jvp, nondiff_argnums=(8,))
def _backward(q, k, v, out, lse, d_out, d_lse, extras, config):
  """The backward kernel, differentiable once more in forward mode (for
  jax.hessian, jvp-of-grad)."""
  return _sharding.backward(q, k, v, out, lse, d_out, d_lse, extras, config)


@_backward.defjvp
def _backward_jvp(config, primals, tangents_in):
  # The backward is the transpose of `_impl` in (tq, tk, tv); differentiate
  # that plain-JAX transpose. The tangent of `out` is not needed: the plain
  # backward reads P v where the kernel reads out, equal as functions of q, k, v.
  q, k, v, out, lse, d_out, d_lse, extras = primals

  def plain(q, k, v, lse, d_out, d_lse, extras):
    def linear(tq, tk, tv):
      return _impl(q, k, v, out, lse, tq, tk, tv, *extras, config=config)
    return jax.linear_transpose(linear, q, k, v)([d_out, d_lse])

  tangents_in = [ad.instantiate_zeros(t) if not isinstance(t, ExtraOperands) else t
                 for t in tangents_in]
  del tangents_in[3]  # out
  return jax.jvp(plain, (q, k, v, lse, d_out, d_lse, extras), tuple(tangents_in))


flash_jvp_p = Primitive("jax_flash2_jvp")
flash_jvp_p.multiple_results = True
flash_jvp_p.def_impl(lambda *args, config: jax.jit(functools.partial(_impl, config=config))(*args))
flash_jvp_p.def_abstract_eval(_abstract_eval)
batching.primitive_batchers[flash_jvp_p] = _batch
ad.primitive_jvps[flash_jvp_p] = _jvp
ad.primitive_transposes[flash_jvp_p] = _transpose
mlir.register_lowering(flash_jvp_p, mlir.lower_fun(_impl, multiple_results=True))
