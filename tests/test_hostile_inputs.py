"""Hostile and careless inputs: NaN propagates, every option value is checked
at trace time (naming the argument), and what passes the checks means the same
to the kernels and to the reference.

The general rule, kept as tests here: any finite input gives a finite output;
a NaN input row gives a NaN output row; and no option value reaches a kernel
that the reference would treat differently.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from conftest import KERNEL_DTYPE, attention_fn, random_inputs

NAN = float("nan")


def _dtype(backend):
  """The dtype of the compiled kernels for "kernel" (float32 on CPU, bfloat16
  on the GPU, so that the CUDA kernels are the ones tested there), float32
  for the reference."""
  return KERNEL_DTYPE if backend == "kernel" else jnp.float32


def _run(backend, q, k, v, **kw):
  """(out, lse), (dq, dk, dv) as float32 numpy, for random cotangents."""
  f = lambda q, k, v: attention_fn(backend)(q, k, v, return_lse=True, **kw)  # noqa: E731
  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
  d_out = jnp.asarray(np.random.default_rng(0).standard_normal(out.shape), out.dtype)
  grads = vjp((d_out, jnp.zeros_like(lse)))
  as_np = lambda x: np.asarray(x, np.float32)  # noqa: E731
  return (as_np(out), as_np(lse)), tuple(as_np(g) for g in grads)


# --- NaN in, NaN out -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_input_gives_nan_rows(backend, rng, where, causal):
  """A NaN in q (one row of one head), k or v (one key of one kv head): the
  query rows whose visible scores or values hold it get NaN out (and NaN LSE
  when the scores hold it) and NaN dq; the other rows stay finite (for a
  NaN in v: their LSE)."""
  batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim = 1, 37, 41, 4, 2, 16
  q, k, v = random_inputs(rng, batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim,
                          _dtype(backend))
  row, key, head, kv_head = 20, 9, 1, 0
  # bottom-right causal: query i sees keys j <= i + S - T
  sees_key = np.arange(seqlen_q) + (seqlen_k - seqlen_q) >= key if causal else np.ones(seqlen_q, bool)
  nan_out = np.zeros((seqlen_q, heads), bool)
  nan_lse = np.zeros((heads, seqlen_q), bool)
  if where == "q":
    q = q.at[0, row, head, 3].set(NAN)
    nan_out[row, head] = nan_lse[head, row] = True
  elif where == "k":
    k = k.at[0, key, kv_head, 3].set(NAN)
    nan_out[sees_key, :2] = True  # query heads 0, 1 read kv head 0
    nan_lse[:2, sees_key] = True
  else:
    v = v.at[0, key, kv_head, 3].set(NAN)
    nan_out[sees_key, :2] = True  # the scores are finite: the LSE too
  (out, lse), (dq, _, _) = _run(backend, q, k, v, causal=causal)
  if where == "v":
    # P V multiplies a key's value row by 0 where the key is masked, and
    # 0 * NaN is NaN: rows that do not see the key may be NaN too.
    assert np.all(np.isnan(out[0]).any(-1)[nan_out])
  else:
    np.testing.assert_array_equal(np.isnan(out[0]).any(-1), nan_out)
    assert np.all(np.isfinite(out[0][~nan_out]))
  np.testing.assert_array_equal(np.isnan(lse[0]), nan_lse)
  assert np.all(np.isfinite(lse[0][~nan_lse]))
  if where == "q":
    expected_dq = np.zeros((seqlen_q, heads), bool)
    expected_dq[row, head] = True
    np.testing.assert_array_equal(np.isnan(dq[0]).any(-1), expected_dq)
  else:
    assert np.isnan(dq[0]).any()


def test_nan_agrees_between_kernel_and_reference(rng):
  """The kernel and the reference give NaN at the same places (out, LSE, dq)
  for NaN scores (from q and from k)."""
  q, k, v = random_inputs(rng, 2, 33, 29, 2, 1, 16, _dtype("kernel"))
  q = q.at[1, 4, 0, 0].set(NAN)
  k = k.at[0, 7, 0, 1].set(NAN)
  results = [_run(backend, q, k, v, causal=True) for backend in ("kernel", "reference")]
  (out_k, lse_k), grads_k = results[0]
  (out_r, lse_r), grads_r = results[1]
  np.testing.assert_array_equal(np.isnan(out_k), np.isnan(out_r))
  np.testing.assert_array_equal(np.isnan(lse_k), np.isnan(lse_r))
  np.testing.assert_array_equal(np.isnan(grads_k[0]).any(-1), np.isnan(grads_r[0]).any(-1))


def test_rows_that_see_no_key_stay_zero_with_nan_elsewhere(backend, rng):
  """Causal with T > S: the first T - S rows see no key. With a NaN in one of
  them (q) they still give out 0 and LSE -inf: nothing visible holds the NaN."""
  q, k, v = random_inputs(rng, 1, 40, 24, 2, 2, 16, _dtype(backend))
  q = q.at[0, 3, 0, 0].set(NAN)  # row 3 < T - S = 16: sees no key
  (out, lse), (dq, _, _) = _run(backend, q, k, v, causal=True)
  assert np.all(out[0, :16] == 0) and np.all(np.isneginf(lse[0, :, :16]))
  assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[0, :, 16:]))
  assert np.all(dq[0, :16] == 0)


# --- finite in, finite out; options mean the same everywhere --------------------------------

EDGE_OPTIONS = [
    dict(softcap=1e-30),                       # tiny but a float32 normal: the cap applies
    dict(softmax_scale=1e-30),                 # uniform attention
    dict(softmax_scale=10.0),                  # nearly one-hot attention
    dict(window_size=(sys.maxsize, sys.maxsize)),  # unbounded both ways
    dict(window_size=(10**6, 0)),
    dict(window_size=(0, 10**12), causal=True),
    dict(dropout_rate=1e-12, dropout_rng=jax.random.key(1)),  # rounds to no dropped weight
    dict(alibi_slopes=jnp.full((2,), 1e30, jnp.float32)),  # only the diagonal survives
]


@pytest.mark.parametrize("options", EDGE_OPTIONS, ids=lambda o: "-".join(
    f"{k}{v if not hasattr(v, 'shape') else ''}" for k, v in o.items() if k != "dropout_rng"))
def test_edge_options_agree_with_the_reference(rng, options):
  """Extreme but valid option values: finite results, and the kernel equals
  the reference (the values reach both as the same float32 / int64 numbers)."""
  q, k, v = random_inputs(rng, 1, 23, 31, 2, 1, 16, _dtype("kernel"))
  try:
    (out_k, lse_k), grads_k = _run("kernel", q, k, v, **options)
  except NotImplementedError as e:  # a valid request this GPU's kernels do not serve
    pytest.skip(str(e))
  (out_r, lse_r), grads_r = _run("reference", q, k, v, **options)
  for ours, ref in zip((out_k, lse_k) + grads_k, (out_r, lse_r) + grads_r):
    assert np.all(np.isfinite(ours))
    # float32 rounding, amplified by the large scores of some cases
    tol = 3e-2 if _dtype("kernel") != jnp.float32 else 1e-3
    np.testing.assert_allclose(ours, ref, atol=tol * max(1.0, np.abs(ref).max()), rtol=tol)


def test_windows_past_the_sequence_are_unbounded(backend, rng):
  q, k, v = random_inputs(rng, 1, 19, 27, 2, 2, 8, _dtype(backend))
  want = _run(backend, q, k, v)
  tol = 1e-6 if _dtype(backend) == jnp.float32 else 1e-2
  for window in ((27, 19), (sys.maxsize, sys.maxsize), (2**62, 10**9)):
    got = _run(backend, q, k, v, window_size=window)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("scale", [1e4, 1.0])
def test_large_finite_inputs_give_finite_results(backend, rng, scale):
  """q, k scaled to large magnitudes (scores up to ~1e4 after the softmax
  scale, never overflowing float32): out, LSE and gradients stay finite."""
  q, k, v = random_inputs(rng, 1, 45, 45, 2, 1, 16, _dtype(backend))
  q, k = q * jnp.asarray(np.sqrt(scale), q.dtype), k * jnp.asarray(np.sqrt(scale), q.dtype)
  for kw in (dict(), dict(causal=True, softcap=50.0), dict(window_size=(5, 3))):
    (out, lse), grads = _run(backend, q, k, v, **kw)
    assert all(np.all(np.isfinite(x)) for x in (out, lse) + grads), kw


# --- errors at trace time, naming the argument -----------------------------------------------


def _arrays(q=(1, 8, 2, 16), k=(1, 8, 2, 16), dtype=jnp.float32):
  return jnp.ones(q, dtype), jnp.ones(k, dtype), jnp.ones(k, dtype)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"alibi_slopes": jnp.asarray([0.1, NAN], jnp.float32)}, ValueError,
     "alibi_slopes must be finite"),
    ({"alibi_slopes": jnp.asarray([[np.inf, 0.1]], jnp.float32)}, ValueError,
     "alibi_slopes must be finite"),
    ({"window_size": (10**20, 0)}, ValueError, "window_size left must fit in int64"),
    ({"window_size": (0, -10**20)}, ValueError, "window_size right must be an int >= -1"),
    ({"window_size": (0, 2**63)}, ValueError, "window_size right must fit in int64"),
    ({"softcap": 1e-50}, ValueError, "softcap .* float32"),
    ({"softcap": 1e39}, ValueError, "softcap .* float32"),
    ({"softcap": 1e-40}, ValueError, "softcap .* float32"),  # subnormal: flushed to 0
    ({"softcap": 1e35}, ValueError, r"softcap must be at most 2\*\*103"),
    ({"softmax_scale": 1e-40}, ValueError, "softmax_scale .* float32"),
    ({"softmax_scale": 1e-50}, ValueError, "softmax_scale .* float32"),
    ({"softmax_scale": 1e39}, ValueError, "softmax_scale .* float32"),
    ({"softmax_scale": "0.5"}, TypeError, "softmax_scale must be a number"),
    ({"softmax_scale": True}, TypeError, "softmax_scale must be a number"),
    ({"softcap": "1"}, TypeError, "softcap must be a number"),
    ({"dropout_rate": "0.1", "dropout_rng": jax.random.key(0)}, TypeError,
     "dropout_rate must be a number"),
    ({"return_lse": "no"}, TypeError, "return_lse must be a bool"),
    ({"dropout_rate": 0.1, "dropout_rng": jnp.zeros((3,), jnp.uint32)}, ValueError,
     "dropout_rng"),
    ({"segment_ids": (np.full((1, 8), 2**32, np.int64),
                      jnp.zeros((1, 8), jnp.int32))}, ValueError,
     "q_segment_ids .* int32"),
    ({"segment_ids": (jnp.zeros((1, 8), jnp.int32),
                      np.full((1, 8), -2**31 - 1, np.int64))}, ValueError,
     "kv_segment_ids .* int32"),
])
def test_bad_option_values(kwargs, error, match):
  q, k, v = _arrays()
  for implementation in ("kernel", "reference"):
    with pytest.raises(error, match=match):
      jax_flash2.flash_attention(q, k, v, implementation=implementation, **kwargs)
  options = {n: x for n, x in kwargs.items() if n != "return_lse"}
  if options:
    with pytest.raises(error, match=match):
      jax_flash2.reference.attention(q, k, v, **options)


@pytest.mark.parametrize("bound,ids,error,match", [
    (0, True, ValueError, "max_segment_length must be >= 1"),
    (2.0, True, TypeError, "max_segment_length must be a static Python int"),
    (True, True, TypeError, "max_segment_length must be a static Python int"),
    (4, False, ValueError, "max_segment_length .* needs segment_ids"),
])
def test_bad_max_segment_length(bound, ids, error, match):
  q, k, v = _arrays()
  segment_ids = (jnp.zeros((1, 8), jnp.int32),) * 2 if ids else None
  for implementation in ("kernel", "reference"):
    with pytest.raises(error, match=match):
      jax_flash2.flash_attention(q, k, v, segment_ids=segment_ids, max_segment_length=bound,
                                 implementation=implementation)
  with pytest.raises(TypeError, match="max_segment_length must be a static Python int"):
    jax.jit(lambda n: jax_flash2.flash_attention(
        q, k, v, segment_ids=(jnp.zeros((1, 8), jnp.int32),) * 2, max_segment_length=n))(4)


def test_abstract_options_pass_the_value_checks():
  """Slopes and segment ids given as jax.ShapeDtypeStruct (as jax_flash2.plan
  takes them) have no values to check: shapes and dtypes only."""
  q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in _arrays())
  ids = jax.ShapeDtypeStruct((1, 8), jnp.int64)
  plan = jax_flash2.plan(q, k, v, alibi_slopes=jax.ShapeDtypeStruct((2,), jnp.float32),
                         segment_ids=(ids, ids))
  assert plan is not None


def test_varlen_checks_every_argument_without_tokens():
  """With no key at all no kernel runs, yet each option is checked as for a
  call with tokens."""
  q = jnp.ones((3, 2, 16), jnp.float32)
  empty = jnp.zeros((0, 2, 16), jnp.float32)
  cu_q, cu_k = jnp.asarray([0, 3], jnp.int32), jnp.asarray([0, 0], jnp.int32)
  sinks = jnp.zeros((2,), jnp.float32)
  for kwargs, match in ((dict(softcap=-1.0), "softcap"), (dict(softmax_scale="2"), "softmax_scale"),
                        (dict(sinks=jnp.zeros((3,), jnp.float32)), "sinks")):
    with pytest.raises((ValueError, TypeError), match=match):
      jax_flash2.flash_attention_varlen(q, empty, empty, cu_q, cu_k, 3, 1,
                                        **{"sinks": sinks, **kwargs})


def test_zero_heads_is_a_clear_error():
  q, k, v = _arrays(q=(1, 8, 0, 16), k=(1, 8, 1, 16))
  with pytest.raises(ValueError, match=r"heads \(H, K\).*>= 1"):
    jax_flash2.flash_attention(q, k, v)


def test_int32_segment_ids_pass_and_traced_wider_ids_wrap(rng):
  """Concrete ids are range-checked; traced ids are cast to int32 unchecked
  (documented): under x64, a traced int64 id 2**32 wraps to 0 and matches 0."""
  q, k, v = random_inputs(rng, 1, 8, 8, 2, 2, 16, jnp.float32)
  ids = np.array([[0, 0, 1, 1, 2, 2, 3, 3]])
  jax_flash2.flash_attention(q, k, v, segment_ids=(ids.astype(np.int64), ids.astype(np.int64)))
  with jax.enable_x64(True):
    q_ids = jnp.asarray(np.full((1, 8), 2**32, np.int64))
    kv_ids = jnp.zeros((1, 8), jnp.int64)
    wrapped = jax.jit(lambda a, b: jax_flash2.flash_attention(q, k, v, segment_ids=(a, b)))(
        q_ids, kv_ids)
  # Same math, two compiled programs (float32 on a GPU: the blockwise path).
  np.testing.assert_allclose(wrapped, jax_flash2.flash_attention(q, k, v), rtol=1e-5, atol=1e-6)


def test_varlen_with_zero_tokens(backend):
  q = jnp.zeros((0, 2, 16), jnp.float32)
  cu = jnp.asarray([0, 0], jnp.int32)
  f = lambda q, k, v: jax_flash2.flash_attention_varlen(  # noqa: E731
      q, k, v, cu, cu, 1, 1, return_lse=True, implementation=backend)
  out, lse = f(q, q, q)
  assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
  grads = jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)[0]), argnums=(0, 1, 2))(q, q, q)
  assert all(g.shape == (0, 2, 16) for g in grads)
  # Queries but no keys: every query sees nothing (out 0, LSE -inf).
  q3 = jnp.ones((3, 2, 16), jnp.float32)
  out, lse = jax_flash2.flash_attention_varlen(
      q3, q, q, jnp.asarray([0, 3]), cu, 3, 1, return_lse=True, implementation=backend)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
