"""Forward-mode AD (jax.jvp, jax.jacfwd) through flash_attention, against the
float64 oracle's jvp; second order; and that reverse mode still runs one
forward and one backward kernel."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from jax_flash2 import _blockwise, _ext, reference
from conftest import KERNEL_DTYPE, attention_fn, random_inputs, supports
from oracle import assert_close_to_oracle, naive_same_dtype, oracle


def _dtype(backend):
  # The compiled kernels' dtype for "kernel" (bfloat16 on the GPU, where
  # float32 runs the blockwise path that test_float32_blockwise covers).
  return KERNEL_DTYPE if backend == "kernel" else jnp.float32


def _options(rng, case, batch, seqlen_q, seqlen_k, num_heads):
  """flash_attention keyword arguments for a named combination of options."""
  kw = {}
  if "causal" in case:
    kw["causal"] = True
  if "window" in case:
    kw["window_size"] = (9, 4)
  if "softcap" in case:
    kw["softcap"] = 2.5
  if "alibi" in case:
    kw["alibi_slopes"] = jnp.asarray(rng.uniform(0.05, 0.5, (num_heads,)), jnp.float32)
  if "segments" in case:
    # Sorted ids from one draw: T == S packed self-attention, every query sees
    # at least its own key.
    ids = jnp.asarray(np.sort(rng.integers(0, 3, (batch, seqlen_q)), axis=-1), jnp.int32)
    kw["segment_ids"] = (ids, ids)
  return kw


def _jvp64(q, k, v, tq, tk, tv, kw):
  """((out, lse), (t_out, t_lse)) of the float64 plain reference, as numpy."""
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, tq, tk, tv)]
    f = lambda q, k, v: reference.attention(q, k, v, return_lse=True, **kw)
    primal, tangent = jax.jit(lambda *a: jax.jvp(f, a[:3], a[3:]))(*args)
    return jax.tree.map(np.asarray, (primal, tangent))


# name: (B, T, S, H, K, D, options). Lengths are odd; no case has a row that
# sees no key (tested apart: the same-dtype baseline's LSE tangent is NaN there).
CASES = {
    "mha": (2, 37, 45, 4, 4, 32, ""),
    "gqa_causal": (2, 33, 50, 4, 2, 16, "causal"),
    "mqa_t_gt_s": (1, 53, 21, 2, 1, 8, ""),
    "window": (1, 40, 61, 4, 2, 16, "window"),
    "window_causal": (1, 47, 47, 2, 1, 16, "window causal"),
    "softcap": (1, 29, 29, 2, 1, 32, "softcap causal"),
    "alibi": (2, 23, 40, 4, 2, 16, "alibi causal"),
    "segments": (2, 50, 50, 4, 2, 16, "segments causal"),
    "combined": (2, 70, 70, 4, 2, 16, "window causal softcap alibi segments"),
    "query_blocks": (1, 601, 64, 2, 1, 8, "alibi"),  # 2 blocks of 304 rows, padded
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_jvp_matches_oracle(backend, rng, case, dtype):
  if not supports(backend, dtype):
    pytest.skip(f"{backend} does not serve {jnp.dtype(dtype).name} here")
  batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim, names = CASES[case]
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, num_heads, num_kv_heads, head_dim,
                          dtype)
  tq, tk, tv = random_inputs(rng, batch, seqlen_q, seqlen_k, num_heads, num_kv_heads,
                             head_dim, dtype)
  kw = _options(rng, names, batch, seqlen_q, seqlen_k, num_heads)
  f = lambda q, k, v: attention_fn(backend)(q, k, v, return_lse=True, **kw)
  (out, lse), (t_out, t_lse) = jax.jvp(f, (q, k, v), (tq, tk, tv))
  assert t_out.dtype == dtype and t_lse.dtype == jnp.float32
  (want_out, want_lse), (want_t_out, want_t_lse) = _jvp64(q, k, v, tq, tk, tv, kw)
  naive = lambda q, k, v: naive_same_dtype(q, k, v, **kw)
  _, (base_t_out, base_t_lse) = jax.jvp(naive, (q, k, v), (tq, tk, tv))
  assert_close_to_oracle("t_out", t_out, want_t_out, base_t_out, dtype)
  assert_close_to_oracle("t_lse", t_lse, want_t_lse, base_t_lse, dtype)
  # The kernels' primal is the forward's, unchanged by differentiation (the
  # reference's is recompiled along with its tangent, so may round apart by
  # an ulp of the dtype).
  plain_out, plain_lse = f(q, k, v)
  ulp = float(jnp.finfo(dtype).eps)
  check = (np.testing.assert_array_equal if backend == "kernel" else
           lambda a, b: np.testing.assert_allclose(a, b, rtol=ulp, atol=1e-6))
  check(np.asarray(out, np.float32), np.asarray(plain_out, np.float32))
  check(np.asarray(lse), np.asarray(plain_lse))


def test_many_query_blocks(backend, rng, monkeypatch):
  """Blocks of 16 rows over T = 75 (a ragged tail of 11) with every option:
  equal to the oracle, so the block offsets reach the mask, ALiBi and ids."""
  monkeypatch.setattr(_blockwise, "_MAX_ROWS", 16)
  assert _blockwise.block_rows(2, 4, 75, 75) == (16, 5)
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 2, 75, 75, 4, 2, 16, dtype)
  tq, tk, tv = random_inputs(rng, 2, 75, 75, 4, 2, 16, dtype)
  kw = _options(rng, "window causal softcap alibi segments", 2, 75, 75, 4)
  f = jax.jit(lambda *a: jax.jvp(
      lambda q, k, v: attention_fn(backend)(q, k, v, return_lse=True, **kw), a[:3], a[3:])[1])
  t_out, t_lse = f(q, k, v, tq, tk, tv)
  _, (want_t_out, want_t_lse) = _jvp64(q, k, v, tq, tk, tv, kw)
  _, (base_t_out, base_t_lse) = jax.jvp(lambda q, k, v: naive_same_dtype(q, k, v, **kw),
                                        (q, k, v), (tq, tk, tv))
  assert_close_to_oracle("t_out", t_out, want_t_out, base_t_out, dtype)
  assert_close_to_oracle("t_lse", t_lse, want_t_lse, base_t_lse, dtype)


def test_block_rows_heuristic():
  # Small problems: one block of all rows.
  assert _blockwise.block_rows(1, 2, 100, 64) == (100, 1)
  # Capped at 512 rows, split evenly in multiples of 8: 1100 -> 3 x 368.
  assert _blockwise.block_rows(1, 2, 1100, 64) == (368, 3)
  # A large B * H * S shrinks the block to the score budget, not below 16 rows.
  rows, count = _blockwise.block_rows(8, 32, 8192, 8192)
  assert rows == 16 and count == 512
  rows, count = _blockwise.block_rows(1, 16, 8192, 8192)
  assert 8 * 16 * 8192 * rows <= 8 * _blockwise._SCORE_BUDGET and rows * count >= 8192


def test_rows_that_see_no_key(backend, rng):
  """Causal with T > S: the first T - S queries see nothing; their tangents
  are exactly 0 (the LSE stays -inf), the others finite."""
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 1, 20, 5, 2, 1, 16, dtype)
  tangents = random_inputs(rng, 1, 20, 5, 2, 1, 16, dtype)
  f = lambda q, k, v: attention_fn(backend)(q, k, v, causal=True, return_lse=True)
  _, (t_out, t_lse) = jax.jvp(f, (q, k, v), tangents)
  assert np.all(np.asarray(t_out[:, :15], np.float32) == 0)
  assert np.all(np.asarray(t_lse[:, :, :15]) == 0)
  assert np.all(np.isfinite(np.asarray(t_out, np.float32)))
  assert np.all(np.isfinite(np.asarray(t_lse)))
  assert np.any(np.asarray(t_lse[:, :, 15:]) != 0)


def test_jacfwd_equals_jacrev(backend, rng):
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 1, 5, 7, 2, 1, 8, dtype)
  kw = dict(causal=True, softcap=3.0)
  f = lambda q, k, v: attention_fn(backend)(q, k, v, return_lse=True, **kw)
  fwd = jax.jacfwd(f, argnums=(0, 1, 2))(q, k, v)
  rev = jax.jacrev(f, argnums=(0, 1, 2))(q, k, v)
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  assert np.any(np.asarray(fwd[0][0], np.float32) != 0)  # d out / d q
  for a, b in zip(jax.tree.leaves(fwd), jax.tree.leaves(rev)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol)


def test_jvp_under_jit_and_vmap(backend, rng):
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 3, 19, 26, 4, 2, 16, dtype)
  tq, tk, tv = random_inputs(rng, 3, 19, 26, 4, 2, 16, dtype)
  slopes = jnp.asarray(rng.uniform(0.05, 0.5, (4,)), jnp.float32)  # shared by the vmapped calls

  def jvp(q, k, v, tq, tk, tv):
    f = lambda q, k, v: attention_fn(backend)(q, k, v, causal=True, return_lse=True,
                                              alibi_slopes=slopes)
    return jax.jvp(f, (q, k, v), (tq, tk, tv))[1]

  eager = jvp(q, k, v, tq, tk, tv)
  jitted = jax.jit(jvp)(q, k, v, tq, tk, tv)
  # vmap over the batch axis: each example is a batch of one.
  mapped = jax.jit(jax.vmap(jvp))(*(x[:, None] for x in (q, k, v, tq, tk, tv)))
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  for e, j, m in zip(eager, jitted, mapped):
    np.testing.assert_allclose(np.asarray(j, np.float32), np.asarray(e, np.float32), atol=tol)
    np.testing.assert_allclose(np.asarray(m, np.float32).reshape(e.shape),
                               np.asarray(e, np.float32), atol=tol)


@pytest.mark.parametrize("order", ["hessian", "rev_of_fwd", "fwd_of_fwd"])
def test_second_order(rng, order):
  """Second derivatives of a scalar on a tiny shape, against the float64
  reference's. jax.hessian (forward over reverse) differentiates the backward
  kernel through its plain-JAX form. (The reference backend is plain JAX:
  nothing of ours to test here.)"""
  backend = "kernel"
  dtype = _dtype(backend)
  q, k, v = random_inputs(rng, 1, 5, 6, 2, 1, 8, dtype)
  kw = dict(causal=True, softcap=3.0, alibi_slopes=jnp.asarray([0.3, 0.1], jnp.float32))

  def scalar(attention):
    def loss(q, k, v):
      out, lse = attention(q, k, v, return_lse=True, **kw)
      return jnp.sum(jnp.sin(out.astype(jnp.float32))) + jnp.sum(jnp.cos(lse))
    return loss

  second = {"hessian": jax.hessian,
            "rev_of_fwd": lambda f, argnums: jax.jacrev(jax.jacfwd(f, argnums), argnums),
            "fwd_of_fwd": lambda f, argnums: jax.jacfwd(jax.jacfwd(f, argnums), argnums)}[order]
  ours = jax.jit(second(scalar(attention_fn(backend)), argnums=(0, 1, 2)))(q, k, v)
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
    want = jax.jit(jax.hessian(scalar(reference.attention), argnums=(0, 1, 2)))(*args)
    want = jax.tree.map(np.asarray, want)
  tol = 1e-4 if dtype == jnp.float32 else 0.25
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, atol=tol * max(1, np.abs(b).max()))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_grad_still_matches_oracle(backend, rng, dtype):
  """Reverse mode now goes through the transpose of the tangent primitive."""
  if not supports(backend, dtype):
    pytest.skip(f"{backend} does not serve {jnp.dtype(dtype).name} here")
  q, k, v = random_inputs(rng, 2, 41, 41, 4, 2, 16, dtype)
  kw = _options(rng, "window causal softcap alibi segments", 2, 41, 41, 4)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  d_lse = jnp.asarray(rng.standard_normal((2, 4, 41)), jnp.float32)

  def loss(q, k, v, attention):
    out, lse = attention(q, k, v, **kw)
    return (jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
            + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0) * d_lse))

  ours = jax.grad(loss, argnums=(0, 1, 2))(
      q, k, v, lambda *a, **kw: attention_fn(backend)(*a, return_lse=True, **kw))
  base = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, naive_same_dtype)
  _, want = oracle(q, k, v, d_out, d_lse, **kw)
  for name, a, w, b in zip(("dq", "dk", "dv"), ours, want, base):
    assert_close_to_oracle(name, a, w, b, dtype)


def _custom_calls(hlo: str) -> dict[str, int]:
  return {target: len(re.findall(rf'custom_call_target="{target}"', hlo))
          for target in (_ext.FORWARD_TARGET, _ext.BACKWARD_TARGET)}


def test_grad_lowers_to_one_forward_and_one_backward(rng):
  """jax.grad of a loss of out and lse: one forward and one backward custom
  call, as with the custom_vjp before; jax.jvp: one forward, no backward."""
  q, k, v = random_inputs(rng, 2, 33, 40, 4, 2, 16, KERNEL_DTYPE)

  def loss(q, k, v):
    out, lse = jax_flash2.flash_attention(q, k, v, causal=True, return_lse=True)
    return jnp.sum(jnp.sin(out.astype(jnp.float32))) + jnp.sum(lse)

  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  assert _custom_calls(grad.lower(q, k, v).compile().as_text()) == {
      _ext.FORWARD_TARGET: 1, _ext.BACKWARD_TARGET: 1}
  jvp = jax.jit(lambda q, k, v: jax.jvp(loss, (q, k, v), (q, k, v)))
  assert _custom_calls(jvp.lower(q, k, v).compile().as_text()) == {
      _ext.FORWARD_TARGET: 1, _ext.BACKWARD_TARGET: 0}


def test_jvp_holds_no_t_by_s_array(rng):
  """The compiled jvp's largest float32 buffer is far below B * H * T * S."""
  batch, seqlen_q, seqlen_k, num_heads = 1, 4000, 700, 2
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, num_heads, 1, 8, _dtype("kernel"))
  f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True, return_lse=True)
  jvp = jax.jit(lambda q, k, v: jax.jvp(f, (q, k, v), (q, k, v)))
  hlo = jvp.lower(q, k, v).compile().as_text()
  sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
           for dims in re.findall(r"f32\[([\d,]*)\]", hlo)]
  rows, _ = _blockwise.block_rows(batch, num_heads, seqlen_q, seqlen_k)
  # About one query block of scores at most: XLA's CPU compiler keeps one (or
  # fuses even that away), its GPU compiler was seen to keep a buffer of two
  # (f32[1472,4,176] for blocks of 368 rows by S = 700, padded to 704).
  block = batch * num_heads * rows * seqlen_k
  shapes = sorted(set(re.findall(r"f32\[[\d,]*\]", hlo)), key=len)[-5:]
  assert max(sizes) <= 2 * block * 704 / 700, (rows, shapes)
  assert max(sizes) < batch * num_heads * seqlen_q * seqlen_k / 2, (rows, shapes)


def test_jvp_with_dropout_raises_and_grad_still_runs(rng):
  """Forward mode with dropout is not implemented (NotImplementedError, named);
  reverse mode with dropout still transposes into the backward kernel."""
  q, k, v = random_inputs(rng, 1, 17, 19, 2, 1, 8, KERNEL_DTYPE)
  f = lambda q, k, v: jax_flash2.flash_attention(q, k, v, dropout_rate=0.25,
                                                 dropout_rng=jax.random.key(3))
  with pytest.raises(NotImplementedError, match="dropout_rate"):
    jax.jvp(f, (q, k, v), (q, k, v))
  loss = lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) ** 2)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads)
  hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
  assert _custom_calls(hlo) == {_ext.FORWARD_TARGET: 1, _ext.BACKWARD_TARGET: 1}
