"""Attention sinks (`sinks`, one logit per query head in every row's softmax
denominator): forward, LSE and the gradients of q, k, v and the sinks against
the float64 oracle on every backend, alone and with the other options;
forward mode, rows that see no key, NaN, bad arguments, varlen, the KV
cache, the ring, the Flax modules and the GPU plans.

The kernels rescale a softmax computed without the sinks (_scores.add_sinks),
the reference puts the sink inside its softmax (_scores.normalize) and the
oracle is float64 numpy: three different computations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from jax_flash2 import api, reference

from conftest import ON_GPU, PACKAGE_ROOT, attention_fn, package_env, random_inputs, supports
from oracle import assert_close_to_oracle, max_err, naive_same_dtype, oracle


def _sinks(rng, heads, seqlen_k):
  """Sinks near a row's LSE (about log S): P_sink between about 0.1 and 0.9,
  so that a missing or doubled sink is far outside the tolerance."""
  return jnp.asarray(np.log(seqlen_k) + rng.uniform(-2.0, 2.0, heads), jnp.float32)


def _segment_ids(rng, batch, seqlen_q, seqlen_k):
  # q ids in [0, 4), kv ids in [0, 3): queries with id 3 see no key.
  return (jnp.asarray(rng.integers(0, 4, (batch, seqlen_q)), jnp.int32),
          jnp.asarray(rng.integers(0, 3, (batch, seqlen_k)), jnp.int32))


def _keep_mask(key, batch, heads, seqlen_q, seqlen_k, rate):
  """[B, H, T, S] bool: the mask flash_attention draws for `key`."""
  q = jnp.zeros((batch, seqlen_q, heads, 8))
  k = jnp.zeros((batch, seqlen_k, heads, 8))
  seeds = api.extra_operands(q, k, dropout_rng=key, dropout_rate=rate).dropout_seeds
  return np.asarray(reference.dropout_keep(seeds, seqlen_q, seqlen_k, rate))


# (B, T, S, H, K, D, causal, options, dtype). Odd lengths, T != S both ways,
# GQA and MQA, a D the kernels pad (20), rows that see no key (causal T > S,
# segment ids), and each option alone and all together.
CASES = [
    (2, 17, 23, 4, 2, 16, False, {}, jnp.float32),
    (1, 33, 33, 4, 1, 20, True, {}, jnp.float32),
    (2, 29, 19, 2, 2, 32, True, {}, jnp.float32),
    (1, 31, 37, 4, 2, 16, False, {"window_size": (5, 3)}, jnp.float32),
    (2, 19, 21, 4, 4, 16, True, {"softcap": 5.0, "softmax_scale": 1.0}, jnp.float32),
    (1, 25, 30, 4, 2, 24, False, {"alibi": True}, jnp.float32),
    (2, 21, 27, 4, 2, 16, False, {"segments": True}, jnp.float32),
    (2, 23, 23, 6, 2, 16, True, {"window_size": (7, -1), "softcap": 3.0, "alibi": True,
                                 "segments": True}, jnp.float32),
    (2, 19, 25, 4, 2, 32, True, {}, jnp.bfloat16),
    (1, 27, 21, 4, 1, 40, False, {"softcap": 4.0, "alibi": True}, jnp.float16),
]


def _case_id(case):
  b, t, s, h, hk, d, causal, options, dtype = case
  opts = "-".join(sorted(options)) or "plain"
  return (f"b{b}t{t}s{s}h{h}k{hk}d{d}" + ("-causal" if causal else "") + f"-{opts}-"
          + jnp.dtype(dtype).name)


def _materialize(rng, case):
  b, t, s, h, hk, d, causal, options, dtype = case
  options = dict(options, causal=causal)
  if options.pop("alibi", False):
    options["alibi_slopes"] = jnp.asarray(rng.uniform(0.01, 0.3, (h,)), jnp.float32)
  if options.pop("segments", False):
    options["segment_ids"] = _segment_ids(rng, b, t, s)
  return options


def _split(options):
  """(static options, array options): the arrays go through jit as arguments."""
  names = ("alibi_slopes", "segment_ids")
  return ({n: o for n, o in options.items() if n not in names},
          {n: o for n, o in options.items() if n in names})


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_against_oracle(backend, case, rng):
  b, t, s, h, hk, d, causal, _, dtype = case
  if not supports(backend, dtype):
    pytest.skip(f"{backend} does not serve {jnp.dtype(dtype).name} here")
  options = _materialize(rng, case)
  static, arrays = _split(options)
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, dtype)
  sinks = _sinks(rng, h, s)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  d_lse = jnp.asarray(rng.standard_normal((b, h, t)), jnp.float32)

  @jax.jit
  def run(q, k, v, sinks, arrays, d_out, d_lse):
    (out, lse), vjp = jax.vjp(lambda q, k, v, sinks: attention_fn(backend)(
        q, k, v, sinks=sinks, return_lse=True, **static, **arrays), q, k, v, sinks)
    return out, lse, vjp((d_out, d_lse))

  out, lse, grads = run(q, k, v, sinks, arrays, d_out, d_lse)
  (ref_out, ref_lse), ref_grads = oracle(q, k, v, d_out, d_lse, sinks=sinks, **options)
  (base_out, base_lse), naive_vjp = jax.vjp(
      lambda q, k, v, sinks: naive_same_dtype(q, k, v, sinks=sinks, **options), q, k, v, sinks)
  base_grads = naive_vjp((d_out, d_lse.astype(base_lse.dtype)))
  assert out.dtype == dtype and lse.dtype == jnp.float32
  assert_close_to_oracle("out", out, ref_out, base_out, dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, dtype)
  for name, g, r, bg, x in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, base_grads,
                               (q, k, v, sinks)):
    assert g.shape == x.shape and g.dtype == x.dtype, name
    assert_close_to_oracle(name, g, r, bg, dtype)
  # The sinks matter: without them the output is far off.
  (plain_out, _), _ = oracle(q, k, v, d_out, d_lse, **options)
  assert max_err(plain_out, ref_out) > 5 * max_err(out, ref_out)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_dropout(backend, rng):
  b, t, s, h, hk, d, rate = 2, 21, 26, 4, 2, 16, 0.3
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, jnp.float32)
  sinks = _sinks(rng, h, s)
  key = jax.random.key(7)
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  d_lse = jnp.asarray(rng.standard_normal((b, h, t)), jnp.float32)
  options = dict(causal=True, softcap=6.0)

  def f(q, k, v, sinks):
    return attention_fn(backend)(q, k, v, sinks=sinks, dropout_rate=rate, dropout_rng=key,
                                 return_lse=True, **options)

  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v, sinks)
  grads = vjp((d_out, d_lse))
  keep = _keep_mask(key, b, h, t, s, rate)
  assert 0 < keep.mean() < 1
  (ref_out, ref_lse), ref_grads = oracle(q, k, v, d_out, d_lse, sinks=sinks, dropout_keep=keep,
                                         dropout_rate=rate, **options)
  (base_out, base_lse), naive_vjp = jax.vjp(
      lambda q, k, v, sinks: naive_same_dtype(q, k, v, sinks=sinks, dropout_keep=keep,
                                              dropout_rate=rate, **options), q, k, v, sinks)
  base_grads = naive_vjp((d_out, d_lse))
  assert_close_to_oracle("out", out, ref_out, base_out, jnp.float32)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, jnp.float32)
  for name, g, r, bg in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, base_grads):
    assert_close_to_oracle(name, g, r, bg, jnp.float32)


def test_oracle_matches_autodiff_of_the_float64_reference(rng):
  """The oracle's sink gradient (written by hand) against jax.grad of the
  reference in float64: two independent derivations."""
  with jax.enable_x64(True):
    q, k, v = random_inputs(rng, 2, 13, 17, 4, 2, 8, jnp.float64)
    sinks = jnp.asarray(_sinks(rng, 4, 17), jnp.float64)
    d_out = jnp.asarray(rng.standard_normal(q.shape))
    d_lse = jnp.asarray(rng.standard_normal((2, 4, 13)))
    options = dict(causal=True, softcap=4.0)
    (out, lse), vjp = jax.vjp(lambda q, k, v, s: reference.attention(
        q, k, v, sinks=s, return_lse=True, **options), q, k, v, sinks)
    grads = vjp((d_out, d_lse))
    (ref_out, ref_lse), ref_grads = oracle(q, k, v, d_out, d_lse, sinks=sinks, **options)
  np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(lse, ref_lse, rtol=1e-12, atol=1e-12)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-10)
  assert np.max(np.abs(ref_grads[3])) > 0.1


def _oracle_out_lse(q, k, v, sinks, **options):
  zero = np.zeros(q.shape)
  (out, lse), _ = oracle(q, k, v, zero, np.zeros(lse_shape(q)), sinks=sinks, **options)
  return out, lse


def lse_shape(q):
  return (q.shape[0], q.shape[2], q.shape[1])


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_jvp_against_finite_differences(backend, rng):
  """jax.jvp in q, k, v and the sinks at once, against central differences of
  the float64 oracle."""
  b, t, s, h, hk, d = 2, 15, 19, 4, 2, 16
  options = dict(causal=True, alibi_slopes=jnp.asarray(rng.uniform(0.01, 0.3, (h,)),
                                                       jnp.float32))
  primals = random_inputs(rng, b, t, s, h, hk, d, jnp.float32) + (_sinks(rng, h, s),)
  tangents = tuple(jnp.asarray(rng.standard_normal(x.shape), jnp.float32) for x in primals)

  def f(q, k, v, sinks):
    return attention_fn(backend)(q, k, v, sinks=sinks, return_lse=True, **options)

  (out, lse), (t_out, t_lse) = jax.jvp(jax.jit(f), primals, tangents)
  eps = 1e-5
  x64 = [np.asarray(x, np.float64) for x in primals]
  dx = [np.asarray(x, np.float64) for x in tangents]
  plus = _oracle_out_lse(*[x + eps * t for x, t in zip(x64, dx)], **options)
  minus = _oracle_out_lse(*[x - eps * t for x, t in zip(x64, dx)], **options)
  fd_out, fd_lse = ((p - m) / (2 * eps) for p, m in zip(plus, minus))
  scale = max(1.0, np.max(np.abs(fd_out)))
  assert max_err(t_out, fd_out) < 1e-4 * scale
  assert max_err(t_lse, fd_lse) < 1e-4 * max(1.0, np.max(np.abs(fd_lse)))
  # The sinks' tangent alone moves the result (it is not dropped).
  only_sinks = tuple(jnp.zeros_like(x) for x in primals[:3]) + (tangents[3],)
  _, (t_out_s, _) = jax.jvp(jax.jit(f), primals, only_sinks)
  assert np.max(np.abs(np.asarray(t_out_s))) > 1e-2


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_rows_that_see_no_key(backend, rng):
  """Causal with T > S: the first T - S queries see no key; out 0, LSE the
  sink exactly, finite gradients (zero for those rows' q)."""
  b, t, s, h, hk, d = 1, 13, 6, 4, 2, 16
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, jnp.float32)
  sinks = _sinks(rng, h, s)
  f = jax.jit(lambda q, k, v, sinks: attention_fn(backend)(q, k, v, sinks=sinks, causal=True,
                                                           return_lse=True))
  out, lse = f(q, k, v, sinks)
  empty = t - s
  assert np.all(np.asarray(out)[:, :empty] == 0)
  np.testing.assert_array_equal(np.asarray(lse)[:, :, :empty],
                                np.broadcast_to(np.asarray(sinks)[None, :, None], (b, h, empty)))
  grads = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a)[0])) + jnp.sum(f(*a)[1]),
                   argnums=(0, 1, 2, 3))(q, k, v, sinks)
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(grads[0])[:, :empty] == 0)
  # Each sink still gets d lse / d sink = 1 from each empty row.
  assert np.all(np.asarray(grads[3]) >= empty - 1e-4)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_nan_sink_gives_nan_rows_of_its_head(backend, rng):
  b, t, s, h, hk, d = 2, 11, 14, 4, 2, 16
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, jnp.float32)
  sinks = np.array(_sinks(rng, h, s))
  sinks[2] = np.nan
  # Traced sinks are not checked: the NaN reaches the computation.
  out, lse = jax.jit(lambda q, k, v, sinks: attention_fn(backend)(
      q, k, v, sinks=sinks, causal=True, return_lse=True))(q, k, v, jnp.asarray(sinks))
  out, lse = np.asarray(out), np.asarray(lse)
  assert np.all(np.isnan(out[:, :, 2])) and np.all(np.isnan(lse[:, 2]))
  others = [0, 1, 3]
  assert np.all(np.isfinite(out[:, :, others])) and np.all(np.isfinite(lse[:, others]))


def test_traced_minus_inf_sink_is_no_sink(rng):
  """A sink of -inf (traced; concrete ones are refused) adds nothing."""
  q, k, v = random_inputs(rng, 1, 9, 12, 2, 1, 8, jnp.float32)
  f = jax.jit(lambda q, k, v, s: jax_flash2.flash_attention(q, k, v, sinks=s, causal=True,
                                                            return_lse=True))
  out, lse = f(q, k, v, jnp.full((2,), -jnp.inf, jnp.float32))
  ref_out, ref_lse = jax_flash2.flash_attention(q, k, v, causal=True, return_lse=True)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


BAD_SINKS = [
    ([0.0] * 4, TypeError, "sinks must be a float32"),
    (jnp.zeros((5,), jnp.float32), ValueError, "sinks.shape"),
    (jnp.zeros((2, 4), jnp.float32), ValueError, "sinks.shape"),
    (jnp.zeros((4,), jnp.bfloat16), TypeError, "sinks.dtype"),
    (jnp.zeros((4,), jnp.int32), TypeError, "sinks.dtype"),
    (jnp.asarray([0.0, np.nan, 0.0, 0.0], jnp.float32), ValueError, "sinks must be finite"),
    (jnp.asarray([0.0, 0.0, np.inf, 0.0], jnp.float32), ValueError, "sinks must be finite"),
    (jnp.asarray([0.0, 0.0, 0.0, -np.inf], jnp.float32), ValueError, "sinks must be finite"),
]


@pytest.mark.parametrize("bad", BAD_SINKS, ids=lambda b: f"{b[1].__name__}-{b[2]}")
def test_bad_sinks_raise_at_trace_time(bad, rng):
  sinks, error, message = bad
  q, k, v = random_inputs(rng, 1, 5, 6, 4, 2, 8, jnp.float32)
  calls = [
      lambda: jax_flash2.flash_attention(q, k, v, sinks=sinks),
      lambda: jax_flash2.flash_attention(q, k, v, sinks=sinks, implementation="reference"),
      lambda: reference.attention(q, k, v, sinks=sinks),
      lambda: jax.jit(lambda q: jax_flash2.flash_attention(q, k, v, sinks=sinks)).lower(q),
      lambda: jax_flash2.plan(q, k, v, sinks=sinks),
      lambda: jax_flash2.flash_attention_varlen(
          q[0], k[0], v[0], jnp.asarray([0, 2, 5]), jnp.asarray([0, 4, 6]), 3, 4, sinks=sinks),
  ]
  for call in calls:
    with pytest.raises(error, match=message):
      call()


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_varlen(backend, rng):
  """flash_attention_varlen with sinks against the oracle of each sequence
  (a query's sink does not leak across sequences, and an empty sequence's
  queries get LSE = sink); the sinks' gradient sums over the sequences."""
  h, hk, d = 4, 2, 16
  lens_q, lens_k = [5, 9, 3, 7], [8, 6, 0, 11]
  cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
  q, k, v = (x[0] for x in random_inputs(rng, 1, cu_q[-1], cu_k[-1], h, hk, d, jnp.float32))
  sinks = _sinks(rng, h, 8)
  d_out = rng.standard_normal(q.shape)
  d_lse = rng.standard_normal((h, cu_q[-1]))

  def f(q, k, v, sinks):
    return jax_flash2.flash_attention_varlen(
        q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max(lens_q), max(lens_k), causal=True,
        softcap=5.0, sinks=sinks, return_lse=True, implementation=backend)

  (out, lse), vjp = jax.vjp(f, q, k, v, sinks)
  dq, dk, dv, dsinks = vjp((jnp.asarray(d_out, jnp.float32), jnp.asarray(d_lse, jnp.float32)))
  ref_dsinks = np.zeros(h)
  for i in range(len(lens_q)):
    rq, rk = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
    if lens_k[i] == 0:  # no key: out 0, LSE the sink, d sink = sum of d_lse
      assert np.all(np.asarray(out[rq]) == 0)
      np.testing.assert_allclose(lse[:, rq], np.broadcast_to(
          np.asarray(sinks)[:, None], (h, lens_q[i])), rtol=1e-6)
      ref_dsinks += d_lse[:, rq].sum(1)
      continue
    (ro, rl), (rdq, rdk, rdv, rds) = oracle(
        q[None, rq], k[None, rk], v[None, rk], d_out[None, rq], d_lse[None, :, rq],
        causal=True, softcap=5.0, sinks=sinks)
    np.testing.assert_allclose(out[rq], ro[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse[:, rq], rl[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(dq[rq], rdq[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dk[rk], rdk[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dv[rk], rdv[0], rtol=1e-4, atol=1e-4)
    ref_dsinks += rds
  np.testing.assert_allclose(dsinks, ref_dsinks, rtol=1e-4, atol=1e-4)


def test_no_key_at_all_varlen(rng):
  h, d = 2, 8
  q = jnp.asarray(rng.standard_normal((5, h, d)), jnp.float32)
  k = v = jnp.zeros((0, 1, d), jnp.float32)
  sinks = jnp.asarray([0.5, -1.5], jnp.float32)
  out, lse = jax_flash2.flash_attention_varlen(
      q, k, v, jnp.asarray([0, 5]), jnp.asarray([0, 0]), 5, 1, sinks=sinks, return_lse=True)
  assert np.all(np.asarray(out) == 0)
  np.testing.assert_array_equal(lse, np.broadcast_to(np.asarray(sinks)[:, None], (h, 5)))


def test_plan_is_unchanged_by_sinks(rng):
  """Sinks never reach the kernels: every GPU plan of a sinks call is that of
  the same call without them (on Hopper: the sm90 kernels)."""
  q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in random_inputs(
      rng, 2, 4096, 4096, 16, 4, 128, jnp.float32))
  sinks = jnp.zeros((16,), jnp.float32)
  for cc in ((9, 0), (8, 0), (8, 9)):
    for options in ({"causal": True}, {"softcap": 30.0}, {"window_size": (256, 0)}):
      with_sinks = jax_flash2.plan(q, k, v, compute_capability=cc, sinks=sinks, **options)
      assert with_sinks == jax_flash2.plan(q, k, v, compute_capability=cc, **options)
  hopper = jax_flash2.plan(q, k, v, compute_capability=(9, 0), sinks=sinks, causal=True)
  assert hopper["forward"].kernel == "sm90", hopper


def test_one_elementwise_pass_outside_the_kernels(rng):
  """The forward with sinks is the same kernel call plus elementwise work:
  one forward custom call, no second one, nothing [T, S]-sized."""
  # bfloat16: float32 on CUDA lowers to plain JAX, not the custom call.
  q, k, v = random_inputs(rng, 1, 64, 80, 4, 2, 16, jnp.bfloat16)
  sinks = _sinks(rng, 4, 80)
  text = jax.jit(lambda q, k, v, s: jax_flash2.flash_attention(q, k, v, sinks=s)).lower(
      q, k, v, sinks).as_text()
  assert text.count("jax_flash2_attention_fwd") == 1
  assert "64x80" not in text and "80x64" not in text


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("seqlen_q", [1, 5])
def test_kvcache(backend, seqlen_q, rng):
  """flash_attention_with_kvcache with sinks against the oracle of each
  sequence's visible keys (causal, aligned to each sequence's end); a
  sequence with an empty cache gets out 0 and LSE the sink."""
  b, s_max, h, hk, d = 3, 40, 4, 2, 16
  lengths = [17, 0, 33] if seqlen_q == 1 else [17, 3, 33]
  q, k_cache, v_cache = random_inputs(rng, b, seqlen_q, s_max, h, hk, d, jnp.float32)
  sinks = _sinks(rng, h, 20)
  out, lse = jax.jit(lambda q, kc, vc, n, s: jax_flash2.flash_attention_with_kvcache(
      q, kc, vc, cache_seqlens=n, sinks=s, softcap=6.0, return_lse=True,
      implementation=backend))(q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), sinks)
  for i, length in enumerate(lengths):
    if length == 0:
      assert np.all(np.asarray(out[i]) == 0)
      np.testing.assert_array_equal(lse[i], np.broadcast_to(
          np.asarray(sinks)[:, None], (h, seqlen_q)))
      continue
    (ro, rl), _ = oracle(q[i:i + 1], k_cache[i:i + 1, :length], v_cache[i:i + 1, :length],
                         np.zeros((1, seqlen_q, h, d)), np.zeros((1, h, seqlen_q)), causal=True,
                         softcap=6.0, sinks=sinks)
    np.testing.assert_allclose(out[i], ro[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse[i], rl[0], rtol=2e-5, atol=2e-5)
  with pytest.raises(ValueError, match="sinks.shape"):
    jax_flash2.flash_attention_with_kvcache(q, k_cache, v_cache,
                                            cache_seqlens=jnp.asarray(lengths, jnp.int32),
                                            sinks=jnp.zeros((3,), jnp.float32))


# The ring: several CPU devices need a fresh process (the device count is
# fixed when jax initializes).
_RING_SCRIPT = r"""
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
import jax_flash2
from jax_flash2 import context_parallel as cp
mesh = jax.make_mesh((4,), ("sp",), axis_types=(jax.sharding.AxisType.Explicit,))
rng = np.random.default_rng(3)
b, t, h, hk, d = 2, 48, 4, 2, 16
q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32)
           for s in ((b, t, h, d), (b, t, hk, d), (b, t, hk, d)))
sinks = jnp.asarray(np.log(t) + rng.uniform(-2, 2, h), jnp.float32)
d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
result = {}
for strategy in ("ring", "allgather"):
  def loss(q, k, v, s, f):
    out, lse = f(q, k, v, s)
    return jnp.sum(out * d_out) + jnp.sum(jnp.sin(lse))
  ring = lambda q, k, v, s: cp.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="sp", causal=True, sinks=s, strategy=strategy,
      return_lse=True)
  plain = lambda q, k, v, s: jax_flash2.flash_attention(q, k, v, causal=True, sinks=s,
                                                        return_lse=True)
  got = jax.jit(jax.value_and_grad(lambda *a: loss(*a, ring), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  want = jax.value_and_grad(lambda *a: loss(*a, plain), argnums=(0, 1, 2, 3))(q, k, v, sinks)
  errs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
          for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))]
  result[strategy] = errs + [float(np.max(np.abs(np.asarray(want[1][3]))))]
print(json.dumps(result))
"""


def test_ring_attention():
  env = package_env(drop=("XLA_FLAGS",), JAX_PLATFORMS="cpu")
  # `python -c` puts the working directory first on sys.path: run it beside
  # the package under test, so a source checkout without built extensions
  # (pytest's working directory in CI) is not the one imported.
  proc = subprocess.run([sys.executable, "-c", _RING_SCRIPT], capture_output=True, text=True,
                        env=env, cwd=PACKAGE_ROOT, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  for strategy, errs in result.items():
    *errs, sink_grad = errs
    assert sink_grad > 0.1, (strategy, sink_grad)  # the sinks' gradient is not trivially 0
    assert max(errs) < 2e-4, (strategy, errs)      # loss, dq, dk, dv, dsinks


# Flax.


def test_flax_nnx_module_trains_its_sinks(rng):
  nnx = pytest.importorskip("flax.nnx")
  import optax
  from jax_flash2.flax import MultiHeadAttention

  model = MultiHeadAttention(4, 32, num_kv_heads=2, causal=True, use_sinks=True,
                             rngs=nnx.Rngs(0))
  assert model.sinks[...].shape == (4,) and np.all(np.asarray(model.sinks[...]) == 0)
  assert MultiHeadAttention(4, 32, rngs=nnx.Rngs(0)).sinks is None
  x = jnp.asarray(rng.standard_normal((2, 13, 32)), jnp.float32)
  target = jnp.asarray(rng.standard_normal((2, 13, 32)), jnp.float32)

  def loss_fn(model):
    return jnp.mean((model(x) - target) ** 2)

  grads = nnx.grad(loss_fn)(model)
  g = np.asarray(grads.sinks[...])
  assert g.shape == (4,) and np.all(np.isfinite(g)) and np.all(g != 0)
  # The module's sinks are flash_attention's: the same output as the
  # reference backend with the same parameter.
  q, kk, vv = model.query(x), model.key(x), model.value(x)
  want = model.out(reference.attention(q, kk, vv, causal=True, sinks=model.sinks[...]))
  np.testing.assert_allclose(model(x), want, rtol=2e-5, atol=2e-5)
  optimizer = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)
  losses = []
  for _ in range(8):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert np.any(np.asarray(model.sinks[...]) != 0)


def test_flax_linen_module_has_a_sinks_param(rng):
  pytest.importorskip("flax.linen")
  from jax_flash2.flax.linen import MultiHeadAttention

  x = jnp.asarray(rng.standard_normal((2, 11, 16)), jnp.float32)
  layer = MultiHeadAttention(num_heads=4, num_kv_heads=1, use_sinks=True, causal=True)
  params = layer.init(jax.random.key(0), x)["params"]
  assert params["sinks"].shape == (4,)
  assert "sinks" not in MultiHeadAttention(num_heads=4).init(jax.random.key(0), x)["params"]
  params = dict(params, sinks=jnp.asarray(rng.uniform(-1, 2, 4), jnp.float32))
  grads = jax.grad(lambda p: jnp.sum(jnp.sin(layer.apply({"params": p}, x))))(params)
  assert np.all(np.asarray(grads["sinks"]) != 0)


# GPU.


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_kernels_serve_sinks(rng, dtype, causal):
  """On the GPU: the plan of a sinks call is the plain call's (the Hopper
  kernels on cc 9.0), and out, LSE and gradients match the oracle."""
  b, t, s, h, hk, d = 2, 1000, 1000, 16, 4, 128
  q, k, v = random_inputs(rng, b, t, s, h, hk, d, dtype)
  sinks = _sinks(rng, h, s)
  device = jax.devices()[0]
  cc = tuple(int(x) for x in str(device.compute_capability).split("."))
  plan = jax_flash2.plan(q, k, v, compute_capability=cc, sm_count=device.core_count,
                         causal=causal, sinks=sinks)
  assert plan == jax_flash2.plan(q, k, v, compute_capability=cc, sm_count=device.core_count,
                                 causal=causal)
  if cc == (9, 0):
    assert plan["forward"].kernel == "sm90", plan
    if os.environ.get("JAX_FLASH2_SM90_BACKWARD", "1") != "0":
      assert plan["backward"].kernel == "sm90", plan
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  d_lse = jnp.asarray(rng.standard_normal((b, h, t)), jnp.float32)

  @jax.jit
  def run(q, k, v, sinks, d_out, d_lse):
    (out, lse), vjp = jax.vjp(lambda q, k, v, s: jax_flash2.flash_attention(
        q, k, v, causal=causal, sinks=s, return_lse=True), q, k, v, sinks)
    return out, lse, vjp((d_out, d_lse))

  out, lse, grads = run(q, k, v, sinks, d_out, d_lse)
  (ref_out, ref_lse), ref_grads = oracle(q, k, v, d_out, d_lse, causal=causal, sinks=sinks)
  (base_out, base_lse), naive_vjp = jax.vjp(
      lambda q, k, v, s: naive_same_dtype(q, k, v, causal=causal, sinks=s), q, k, v, sinks)
  base_grads = naive_vjp((d_out, d_lse.astype(base_lse.dtype)))
  assert_close_to_oracle("out", out, ref_out, base_out, dtype)
  assert_close_to_oracle("lse", lse, ref_lse, base_lse, dtype)
  for name, g, r, bg in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, base_grads):
    assert_close_to_oracle(name, g, r, bg, dtype)
