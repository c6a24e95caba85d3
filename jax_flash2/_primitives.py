"""The attention primitives: abstract evaluation and batching.

flash_fwd_p: (q, k, v, *ExtraOperands) -> (out, lse)
flash_bwd_p: (q, k, v, out, lse, d_out, d_lse, *ExtraOperands) -> (dq, dk, dv)
Both carry `config` (an AttentionConfig) as their only parameter. The extra
operands (slopes [B, H] float32, segment ids [B, T], [B, S] int32, dropout
seeds [B, H, 2] uint32) are always passed, flat and last, in the FFI
signature's order (zeros when the config leaves them off), so every operand
leads with B. vmap folds
every mapped axis into the batch axis B: one kernel launch, no loop; an
unbatched operand (say slopes shared by the vmapped examples) is broadcast
along the mapped axis first, so per-B slopes and ids stay lined up with q.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching

from jax_flash2 import _lowering
from jax_flash2._config import ExtraOperands


def _define(name: str, abstract_eval, batch_rule) -> Primitive:
  prim = Primitive(name)
  prim.multiple_results = True
  # Eager calls compile the primitive alone, like any jitted function.
  prim.def_impl(lambda *args, **params: jax.jit(functools.partial(prim.bind, **params))(*args))
  prim.def_abstract_eval(abstract_eval)
  batching.primitive_batchers[prim] = batch_rule
  return prim


def _fwd_abstract_eval(*avals, config):
  del config
  (q, _, _), _ = ExtraOperands.split(avals)
  batch, seqlen_q, num_heads, _ = q.shape
  return (
      jax.core.ShapedArray(q.shape, q.dtype),
      jax.core.ShapedArray((batch, num_heads, seqlen_q), jnp.float32),
  )


def _bwd_abstract_eval(*avals, config):
  del config
  (q, k, v, *_), _ = ExtraOperands.split(avals)
  return (
      jax.core.ShapedArray(q.shape, q.dtype),
      jax.core.ShapedArray(k.shape, k.dtype),
      jax.core.ShapedArray(v.shape, v.dtype),
  )


def _fold_batch(args, dims):
  """Moves every mapped axis to the front, broadcasts unmapped operands, and
  merges the mapped axis into B. Returns the folded args and the axis size."""
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  folded = []
  for x, d in zip(args, dims):
    if d is None:  # unmapped operand
      x = jnp.broadcast_to(x, (size,) + x.shape)
    else:
      x = jnp.moveaxis(x, d, 0)
    folded.append(x.reshape((size * x.shape[1],) + x.shape[2:]))
  return folded, size


def _unfold(results, size):
  return [r.reshape((size, r.shape[0] // size) + r.shape[1:]) for r in results], [0] * len(results)


def _fwd_batch(args, dims, *, config):
  if config.page_size > 0:  # folding would mix the page pools of the mapped entries
    raise NotImplementedError("flash_attention_with_kvcache: vmap of a paged KV-cache call is "
                              "not supported; give the batch as B with one page pool")
  folded, size = _fold_batch(args, dims)
  return _unfold(flash_fwd_p.bind(*folded, config=config), size)


def _bwd_batch(args, dims, *, config):
  folded, size = _fold_batch(args, dims)
  return _unfold(flash_bwd_p.bind(*folded, config=config), size)


flash_fwd_p = _define("jax_flash2_fwd", _fwd_abstract_eval, _fwd_batch)
flash_bwd_p = _define("jax_flash2_bwd", _bwd_abstract_eval, _bwd_batch)
_lowering.register(flash_fwd_p, flash_bwd_p)
