"""The test matrix, run against every backend: forward, LSE and gradients
against a float64 oracle, with the tolerance set by a plain same-dtype attention."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import attention_fn, random_inputs, supports
from oracle import assert_close_to_oracle, naive_same_dtype, oracle

DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)

# (batch, T, S, H, K, D, causal): every value of each axis appears; odd lengths,
# T != S both ways, GQA and MQA.
CASES = [
    (1, 1, 1, 1, 1, 8, False),
    (2, 17, 17, 2, 1, 32, True),
    (1, 128, 128, 8, 8, 64, False),
    (1, 128, 257, 8, 2, 64, True),
    (2, 257, 128, 2, 2, 80, True),
    (1, 1, 1000, 8, 1, 128, False),
    (1, 1000, 17, 2, 1, 128, True),
    (1, 17, 257, 8, 1, 256, False),
    (1, 257, 257, 1, 1, 256, True),
    (1, 1000, 1000, 2, 1, 32, True),
    (3, 65, 63, 4, 2, 40, False),
]
SLOW_CASES = [
    (1, t, s, h, hk, d, c)
    for t, s, (h, hk), d, c in itertools.product(
        (1, 17, 128, 257, 1000), (1, 17, 128, 257, 1000), ((1, 1), (2, 1), (8, 2), (8, 8)),
        (8, 32, 64, 80, 128, 256), (False, True))
]


def _case_id(case):
  b, t, s, h, k, d, c = case
  return f"b{b}-t{t}-s{s}-h{h}k{k}-d{d}" + ("-causal" if c else "")


def _skip_unsupported(backend, dtype):
  if not supports(backend, dtype):
    pytest.skip(f"{backend} does not serve {jnp.dtype(dtype).name} here")


def _segment_ids(rng, kind, batch, length, num_ids):
  """[B, length] int32: "packed" sorted runs (documents packed back to back,
  num_ids of them), or "random" ids in [0, num_ids)."""
  if kind == "random":
    return jnp.asarray(rng.integers(0, num_ids, (batch, length)), jnp.int32)
  cuts = np.sort(rng.integers(1, length, (batch, num_ids - 1)), axis=1)
  return jnp.asarray((np.arange(length)[None, :, None] >= cuts[:, None, :]).sum(-1), jnp.int32)


def _materialize(options, case, rng):
  """Options with the array-valued ones made from their spec in VARIANT_CASES:
  "alibi": "h" | "bh" (slopes [H] or [B, H]); "segments": "packed" | "random"
  (packed: the same runs for q and k/v when T == S; random: q ids in [0, 4), k/v
  ids in [0, 3), so queries with id 3 see no key)."""
  b, t, s, h = case[:4]
  options = dict(options)
  alibi = options.pop("alibi", None)
  if alibi is not None:
    shape = (h,) if alibi == "h" else (b, h)
    options["alibi_slopes"] = jnp.asarray(rng.uniform(0.01, 0.3, shape), jnp.float32)
  segments = options.pop("segments", None)
  if segments == "packed":
    q_ids = _segment_ids(rng, "packed", b, t, 4)
    kv_ids = q_ids if t == s else _segment_ids(rng, "packed", b, s, 4)
    options["segment_ids"] = (q_ids, kv_ids)
  elif segments == "random":
    options["segment_ids"] = (_segment_ids(rng, "random", b, t, 4),
                              _segment_ids(rng, "random", b, s, 3))
  return options


def _split_arrays(options):
  """(hashable static options, dict of the array-valued ones)."""
  arrays = {n: options[n] for n in ("alibi_slopes", "segment_ids") if n in options}
  static = tuple(sorted((n, o) for n, o in options.items() if n not in arrays))
  return static, arrays


def _check_forward(backend, case, dtype, rng, options=None):
  options = dict(options or {})
  _skip_unsupported(backend, dtype)
  b, t, s, h, hk, d, causal = case
  options = _materialize(options, case, rng)
  options["causal"] = causal
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, dtype)
  static, arrays = _split_arrays(options)
  out, lse = jax.jit(lambda q, k, v, arrays: attention_fn(backend)(
      q, k, v, return_lse=True, **dict(static), **arrays))(q, k, v, arrays)
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (b, h, t) and lse.dtype == jnp.float32
  d_out = jnp.zeros_like(out)
  (ref_out, ref_lse), _ = oracle(q, k, v, d_out, jnp.zeros_like(lse), **options)
  base_out, base_lse = naive_same_dtype(q, k, v, **options)
  assert_close_to_oracle("out", out, ref_out, base_out, dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, dtype)
  # Rows that see no key: output 0 and LSE -inf, never NaN.
  assert np.array_equal(np.isneginf(np.asarray(lse)), np.isneginf(ref_lse))


def _check_gradients(backend, case, dtype, rng, with_lse_cotangent, options=None):
  options = dict(options or {})
  _skip_unsupported(backend, dtype)
  b, t, s, h, hk, d, causal = case
  options = _materialize(options, case, rng)
  options["causal"] = causal
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, dtype)
  static, arrays = _split_arrays(options)
  d_out = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
  d_lse = jnp.asarray(rng.standard_normal((b, h, t)) if with_lse_cotangent else np.zeros((b, h, t)),
                      jnp.float32)

  def ours(q, k, v):
    return attention_fn(backend)(q, k, v, return_lse=True, **options)

  _, vjp = jax.vjp(jax.jit(ours), q, k, v)
  grads = vjp((d_out, d_lse))
  _, ref_grads = oracle(q, k, v, d_out, d_lse, **options)
  base_grads = _naive_grads(q, k, v, d_out, d_lse.astype(dtype), arrays, static)
  for name, g, r, bg, x in zip(("dq", "dk", "dv"), grads, ref_grads, base_grads, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype
    assert_close_to_oracle(name, g, r, bg, dtype)


@functools.partial(jax.jit, static_argnames=("options",))
def _naive_grads(q, k, v, d_out, d_lse, arrays, options):
  _, vjp = jax.vjp(lambda q, k, v: naive_same_dtype(q, k, v, **arrays, **dict(options)), q, k, v)
  return vjp((d_out, d_lse))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward(backend, case, dtype, rng):
  _check_forward(backend, case, dtype, rng)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_gradients(backend, case, dtype, rng):
  _check_gradients(backend, case, dtype, rng, with_lse_cotangent=False)


@pytest.mark.parametrize("case", CASES[1:6], ids=_case_id)
def test_gradients_through_lse(backend, case, rng):
  _check_gradients(backend, case, jnp.bfloat16, rng, with_lse_cotangent=True)


# (case, options): local windows (with and without causal, T != S), softcap,
# ALiBi ([H] and [B, H] slopes) and segment ids (packed runs that skip blocks,
# random ids that leave queries with no key), alone and combined with GQA.
# "alibi" and "segments" name how _materialize builds the arrays.
VARIANT_CASES = [
    ((1, 200, 200, 2, 1, 32, False), {"window_size": (16, 7)}),
    ((2, 130, 300, 4, 2, 64, True), {"window_size": (40, -1)}),
    ((1, 300, 130, 2, 2, 64, False), {"window_size": (-1, 0)}),
    ((1, 257, 257, 4, 1, 80, True), {"window_size": (64, 16)}),
    ((1, 150, 170, 2, 2, 32, False), {"softcap": 5.0}),
    ((2, 97, 97, 4, 2, 64, True), {"softcap": 2.0, "window_size": (30, -1)}),
    ((2, 130, 97, 4, 2, 64, True), {"alibi": "bh"}),
    ((2, 200, 200, 2, 1, 32, True), {"segments": "packed"}),
    ((1, 140, 200, 4, 4, 32, False), {"segments": "random"}),
    ((1, 200, 260, 2, 1, 40, False), {"alibi": "h", "softcap": 3.0, "segments": "packed"}),
    ((2, 257, 257, 4, 2, 64, True),
     {"window_size": (80, -1), "softcap": 5.0, "segments": "packed", "alibi": "bh"}),
]


def _variant_id(variant):
  case, options = variant
  return _case_id(case) + "-" + "-".join(f"{k}{v}" for k, v in sorted(options.items()))


@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float32), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("variant", VARIANT_CASES, ids=_variant_id)
def test_variants(backend, variant, dtype, rng):
  case, options = variant
  _check_forward(backend, case, dtype, rng, options)
  _check_gradients(backend, case, dtype, rng, with_lse_cotangent=True, options=options)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", SLOW_CASES, ids=_case_id)
def test_full_sweep(backend, case, dtype, rng):
  _check_forward(backend, case, dtype, rng)
  _check_gradients(backend, case, dtype, rng, with_lse_cotangent=True)


@pytest.mark.parametrize("variant", ["window", "alibi-segments-softcap"])
def test_oracle_matches_autodiff_of_reference(rng, variant):
  """The numpy oracle's gradients equal jax.grad of the float64 reference."""
  import jax_flash2

  q, k, v = random_inputs(rng, 2, 19, 23, 4, 2, 16, jnp.float32)
  d_out = rng.standard_normal(q.shape)
  d_lse = rng.standard_normal((2, 4, 19))
  options = {"causal": True, "window_size": (7, -1)}
  if variant != "window":
    options.update(softcap=2.0, alibi_slopes=jnp.asarray(rng.uniform(0, 0.5, (2, 4)), jnp.float32),
                   segment_ids=(_segment_ids(rng, "random", 2, 19, 3),
                                _segment_ids(rng, "random", 2, 23, 2)))
  (out, lse), grads = oracle(q, k, v, d_out, d_lse, **options)
  with jax.enable_x64(True):
    args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)]
    f = lambda q, k, v: jax_flash2.reference.attention(q, k, v, return_lse=True, **options)
    (ref_out, ref_lse), vjp = jax.vjp(f, *args)
    ref_grads = vjp((jnp.asarray(d_out), jnp.asarray(d_lse)))
  np.testing.assert_allclose(out, ref_out, atol=1e-12)
  np.testing.assert_allclose(lse, ref_lse, atol=1e-12)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, atol=1e-10)
