"""flash_attention_varlen against the float64 oracle applied sequence by sequence."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from conftest import supports
from oracle import ABS_SLACK, max_err, oracle

# (q lengths, k lengths, H, K, D, options)
CASES = [
    ([5, 17, 1, 30], [7, 17, 3, 30], 4, 2, 32, {"causal": True}),
    ([64, 3, 70], [64, 90, 2], 2, 1, 16, {}),
    ([33, 40], [33, 40], 2, 2, 64, {"causal": True, "window_size": (8, -1)}),
    ([9, 12, 1], [20, 5, 8], 2, 2, 16, {"causal": True, "softcap": 3.0}),
]


def _cu(lengths):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def _cpu_sharding():
  """The first CPU device as a sharding (SingleDeviceSharding is deprecated
  from jax 0.12)."""
  mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:1]), ("x",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[0]}-k{c[1]}-h{c[2]}k{c[3]}-d{c[4]}-{c[5]}")
def test_varlen_matches_per_sequence_oracle(backend, case, dtype, rng):
  if not supports(backend, dtype):
    pytest.skip(f"{backend} does not serve {jnp.dtype(dtype).name} here")
  q_lens, k_lens, h, hk, d, options = case
  q = jnp.asarray(rng.standard_normal((sum(q_lens), h, d)), dtype)
  k = jnp.asarray(rng.standard_normal((sum(k_lens), hk, d)), dtype)
  v = jnp.asarray(rng.standard_normal((sum(k_lens), hk, d)), dtype)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  cu_q, cu_k = _cu(q_lens), _cu(k_lens)

  def f(q, k, v):
    return jax_flash2.flash_attention_varlen(q, k, v, cu_q, cu_k, max(q_lens) + 3, max(k_lens),
                                             return_lse=True, implementation=backend, **options)

  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
  grads = vjp((d_out, jnp.zeros_like(lse)))
  assert out.shape == q.shape and lse.shape == (h, q.shape[0])

  tol = 2e-5 if dtype == jnp.float32 else 6e-2
  for b in range(len(q_lens)):
    qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
    (ref_out, ref_lse), ref_grads = oracle(q[None, qs:qe], k[None, ks:ke], v[None, ks:ke],
                                           d_out[None, qs:qe], np.zeros((1, h, qe - qs)),
                                           **options)
    assert max_err(out[qs:qe], ref_out[0]) <= tol
    assert max_err(lse[:, qs:qe], ref_lse[0]) <= tol * 10
    for g, r, (s, e) in zip(grads, ref_grads, ((qs, qe), (ks, ke), (ks, ke))):
      scale = max(1.0, float(np.max(np.abs(r))))
      assert max_err(g[s:e], r[0]) <= tol * 4 * scale


def test_varlen_bad_arguments():
  q = jnp.ones((10, 2, 16))
  k = jnp.ones((12, 2, 16))
  cu_q = jnp.asarray([0, 4, 10], jnp.int32)
  cu_k = jnp.asarray([0, 5, 12], jnp.int32)
  f = jax_flash2.flash_attention_varlen
  with pytest.raises(ValueError, match="must start at 0, be non-decreasing"):
    f(q, k, k, jnp.asarray([0, 6, 4, 10], jnp.int32), jnp.asarray([0, 5, 6, 12], jnp.int32), 8, 8)
  with pytest.raises(ValueError, match="end at most at the number of tokens"):
    f(q, k, k, jnp.asarray([0, 4, 11], jnp.int32), cu_k, 8, 8)
  with pytest.raises(ValueError, match="more than max_seqlen"):
    f(q, k, k, cu_q, cu_k, 5, 8)
  with pytest.raises(TypeError, match="cu_seqlens_q must be an integer array"):
    f(q, k, k, cu_q.astype(jnp.float32), cu_k, 8, 8)
  with pytest.raises(ValueError, match="flash_attention_varlen: q.shape must be rank 3"):
    f(q[None], k, k, cu_q, cu_k, 8, 8)
  with pytest.raises(ValueError, match="max_seqlen_k must be a static int"):
    f(q, k, k, cu_q, cu_k, 8, 0)
  with pytest.raises(ValueError, match="flash_attention_varlen: cu_seqlens_q and cu_seqlens_k shapes"):
    f(q, k, k, cu_q, jnp.asarray([0, 12], jnp.int32), 8, 12)


# The packed path: one row [1, total, ...] with segment ids from cu_seqlens.


def _local_mask(q_lens, k_lens, total_q, total_k, causal=False, window_size=(-1, -1),
                used=None):
  """[total_q, total_k] bool: query i sees key j, per sequence and bottom-right
  aligned within it (FlashAttention's varlen convention), built directly from
  the definition. With used (seqused_k) sequence b sees only its first
  used[b] keys, the diagonal at the used length. Rows and columns past the
  sequences see nothing."""
  left, right = window_size
  if causal:
    right = 0 if right < 0 else min(right, 0)
  mask = np.zeros((total_q, total_k), bool)
  a = c = 0
  for t, s, u in zip(q_lens, k_lens, k_lens if used is None else used):
    i = np.arange(t)[:, None] + u - t  # the query's diagonal key
    j = np.arange(u)[None, :]
    ok = np.ones((t, u), bool)
    if left >= 0:
      ok &= j >= i - left
    if right >= 0:
      ok &= j <= i + right
    mask[a:a + t, c:c + u] = ok
    a, c = a + t, c + s
  return mask


def _plain_masked(q, k, v, mask, softcap=0.0):
  """out [T, H, D] and lse [H, T] of attention computed in q's dtype with a
  dense [T, S] mask: the 'plain same-dtype attention' of the tolerance rule."""
  dtype = q.dtype
  group = q.shape[1] // k.shape[1]
  kr, vr = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
  s = jnp.einsum("thd,shd->hts", q, kr, preferred_element_type=dtype)
  s = s * jnp.asarray(q.shape[-1]**-0.5, dtype)
  if softcap:
    s = jnp.asarray(softcap, dtype) * jnp.tanh(s / jnp.asarray(softcap, dtype))
  s = jnp.where(mask[None], s, jnp.asarray(-jnp.inf, dtype))
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  m = jnp.where(jnp.isfinite(m), m, 0)
  e = jnp.where(mask[None], jnp.exp(s - m), 0)
  total = jnp.sum(e.astype(jnp.float32), axis=-1, keepdims=True)
  p = (e / jnp.where(total > 0, total, 1).astype(dtype)).astype(dtype)
  out = jnp.einsum("hts,shd->thd", p, vr, preferred_element_type=dtype)
  with np.errstate(divide="ignore"):
    lse = (m.astype(jnp.float32) + jnp.log(total))[..., 0]
  return out, lse


@functools.partial(jax.jit, static_argnames="softcap")
def _plain_with_grads(q, k, v, mask, d_out, softcap):
  """out, lse and (dq, dk, dv) of <out, d_out> for _plain_masked, in q's dtype."""
  out, vjp = jax.vjp(lambda q, k, v: _plain_masked(q, k, v, mask, softcap)[0], q, k, v)
  return out, _plain_masked(q, k, v, mask, softcap)[1], vjp(d_out)


def _packed_oracle(q, k, v, d_out, q_lens, k_lens, options):
  """(out, lse), (dq, dk, dv) in float64: the oracle on the sequences' tokens
  as one row with segment ids built on the host (np.repeat), so it is exact
  for the packed cases (no positional option, or equal offsets, where the
  row's diagonal is each sequence's). Tokens past the sequences get out 0,
  LSE -inf and gradients 0."""
  q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
  real_q, real_k = sum(q_lens), sum(k_lens)
  ids_q = np.repeat(np.arange(len(q_lens)), q_lens)[None]
  ids_k = np.repeat(np.arange(len(k_lens)), k_lens)[None]
  (o, l), g = oracle(q[None, :real_q], k[None, :real_k], v[None, :real_k], d_out[None, :real_q],
                     np.zeros((1, q.shape[1], real_q)), segment_ids=(ids_q, ids_k), **options)
  out = np.zeros(q.shape)
  lse = np.full((q.shape[1], q.shape[0]), -np.inf)
  out[:real_q], lse[:, :real_q] = o[0], l[0]
  grads = [np.zeros(x.shape) for x in (q, k, v)]
  for full, part in zip(grads, g):
    full[:part.shape[1]] = part[0]
  return (out, lse), grads


def _within_rule(name, ours, expected, plain, dtype):
  """The oracle rule, max norms over the whole tensor; rows that are exactly 0
  (or -inf) in the oracle must be exactly that in ours."""
  ours, expected, plain = (np.asarray(x, np.float64) for x in (ours, expected, plain))
  assert np.all(np.isfinite(ours) | np.isinf(expected)), f"{name}: non-finite values"
  err, base = max_err(ours, expected), max_err(plain, expected)
  scale = max(1.0, float(np.max(np.abs(np.where(np.isfinite(expected), expected, 0)))))
  bound = 2.0 * base + ABS_SLACK[jnp.dtype(dtype)] * scale
  assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} (plain: {base:.3g})"


def _lengths_64(seed=64):
  # 64 documents of 0-23 tokens: all shorter than a kernel block, some empty.
  lengths = np.random.default_rng(seed).integers(0, 24, size=64)
  lengths[[3, 17, 40]] = 0
  return lengths.tolist()


# (name, q lengths, k lengths (None: the same offsets), H, K, D, options,
#  padding rows past cu_seqlens[-1] in q and in k)
PACKED_CASES = [
    ("1doc-causal", [77], None, 2, 2, 32, {"causal": True}, 0, 0),
    ("2docs-causal-gqa", [20, 45], None, 4, 2, 16, {"causal": True}, 0, 0),
    ("7docs-empty-mqa", [5, 0, 33, 1, 0, 17, 9], None, 4, 1, 32, {"causal": True}, 0, 0),
    ("64docs-short", _lengths_64(), None, 2, 2, 16, {"causal": True}, 0, 0),
    ("window-causal", [40, 70, 3], None, 2, 2, 16, {"causal": True, "window_size": (9, -1)},
     0, 0),
    ("window-two-sided", [40, 0, 70], None, 2, 1, 16, {"window_size": (6, 4)}, 0, 0),
    ("cross-t-ne-s", [9, 0, 30, 4, 11], [17, 5, 2, 40, 0], 4, 2, 16, {}, 0, 0),
    ("cross-softcap", [33, 1, 12], [3, 50, 12], 2, 2, 16, {"softcap": 2.0}, 0, 0),
    ("padding-rows-causal", [12, 30, 0, 7], None, 2, 2, 16, {"causal": True}, 5, 9),
    ("padding-rows-q-longer", [12, 30], None, 2, 1, 16, {"causal": True}, 11, 2),
    # The rows padded to equal lengths lie right of the last sequence, which
    # a two-sided window reaches.
    ("padding-rows-window-q-longer", [12, 30, 9], None, 2, 1, 16, {"window_size": (6, 4)},
     11, 2),
    ("padding-rows-window-k-longer", [12, 30, 9], None, 2, 2, 16, {"window_size": (6, 4)},
     2, 11),
]


# Every case in float32; float16 and bfloat16 on the cases that differ in
# structure (the kernels' 16-bit tiles), to keep the file's run time down.
_HALF_CASES = ("2docs-causal-gqa", "7docs-empty-mqa", "64docs-short", "window-causal",
               "cross-t-ne-s", "padding-rows-causal")
PACKED_PARAMS = [pytest.param(c, jnp.float32, id=f"{c[0]}-float32") for c in PACKED_CASES] + [
    pytest.param(c, dt, id=f"{c[0]}-{jnp.dtype(dt).name}")
    for dt in (jnp.float16, jnp.bfloat16) for c in PACKED_CASES if c[0] in _HALF_CASES]


@pytest.mark.parametrize("case,dtype", PACKED_PARAMS)
def test_packed_path_matches_oracle(backend, case, dtype, rng):
  """Forward, LSE and gradients of the packed path against the float64 oracle,
  within the oracle rule of a plain same-dtype attention with the sequences'
  dense mask (built per sequence from the definition)."""
  if not supports(backend, dtype):
    pytest.skip(f"{backend} does not serve {jnp.dtype(dtype).name} here")
  _, q_lens, k_lens, h, hk, d, options, pad_q, pad_k = case
  same = k_lens is None
  k_lens = q_lens if same else k_lens
  total_q, total_k = sum(q_lens) + pad_q, sum(k_lens) + pad_k
  q = jnp.asarray(rng.standard_normal((total_q, h, d)), dtype)
  k = jnp.asarray(rng.standard_normal((total_k, hk, d)), dtype)
  v = jnp.asarray(rng.standard_normal((total_k, hk, d)), dtype)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  cu_q = _cu(q_lens)
  cu_k = cu_q if same else _cu(k_lens)
  positional = options.get("causal", False) or "window_size" in options
  assert jax_flash2._varlen.choose_path(cu_q, cu_k, positional) == "packed"

  def f(q, k, v):
    return jax_flash2.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max(q_lens), max(max(k_lens), 1), return_lse=True,
        implementation=backend, **options)

  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
  grads = vjp((d_out, jnp.zeros_like(lse)))
  assert out.shape == q.shape and lse.shape == (h, total_q)

  (ref_out, ref_lse), ref_grads = _packed_oracle(q, k, v, d_out, q_lens, k_lens, options)
  mask = jnp.asarray(_local_mask(q_lens, k_lens, total_q, total_k, options.get("causal", False),
                                 options.get("window_size", (-1, -1))))
  if dtype == jnp.float32:
    # float32: the slack alone (a plain float32 attention's error is far below it).
    plain_out, plain_lse, plain_grads = ref_out, ref_lse, ref_grads
  else:
    plain_out, plain_lse, plain_grads = _plain_with_grads(q, k, v, mask, d_out,
                                                          options.get("softcap", 0.0))

  _within_rule("out", out, ref_out, plain_out, dtype)
  _within_rule("lse", lse, ref_lse, plain_lse, dtype)
  for name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, plain_grads):
    _within_rule(name, g, r, p, dtype)
  # Tokens of no sequence, and queries of sequences without keys: exactly 0
  # out and gradients, LSE -inf.
  no_key = ~np.asarray(mask).any(axis=1)
  assert np.all(np.asarray(out)[no_key] == 0) and np.all(np.isneginf(np.asarray(lse)[:, no_key]))
  assert np.all(np.asarray(grads[0])[no_key] == 0)
  unseen = ~np.asarray(mask).any(axis=0)
  assert np.all(np.asarray(grads[1])[unseen] == 0) and np.all(np.asarray(grads[2])[unseen] == 0)


def test_choose_path():
  """Packed wherever one row is exact; for causal or window with offsets that
  differ or cannot be compared (distinct traced arrays) the aligned row, or
  the padded batch where that holds fewer elements."""
  choose = jax_flash2._varlen.choose_path
  sizes = jax_flash2._varlen.Sizes
  a, b = _cu([3, 5]), _cu([4, 4])
  assert choose(a, b, positional=False) == "packed"
  assert choose(a, b, positional=True) == "aligned"
  assert choose(a, _cu([3, 5]), positional=True) == "packed"  # equal values
  # 1,000 short sequences and one of 4,096: the padded batch is 1,001 x 4,096.
  lens = np.concatenate([np.full(1000, 5), [4096]])
  cu_q, cu_k = _cu(lens), _cu(lens + 1)
  assert choose(cu_q, cu_k, True, None, sizes(9096, 10097, 4096, 4097, 8, 8)) == "aligned"
  # Chunked prefill, 16 new queries against 4,096 keys per sequence: the
  # aligned row would give each sequence 4,096 query slots.
  cu_q, cu_k = _cu([16] * 8), _cu([4096] * 8)
  assert choose(cu_q, cu_k, True, None, sizes(128, 32768, 16, 4096, 32, 8)) == "padded"
  seen = {}

  def probe(x, y):
    seen["same"] = choose(x, x, positional=True)
    seen["distinct"] = choose(x, y, positional=True)
    seen["distinct, no mask"] = choose(x, y, positional=False)
    return x

  jax.jit(probe)(a, a)
  assert seen == {"same": "packed", "distinct": "aligned", "distinct, no mask": "packed"}


def test_traced_offsets_under_jit(backend, rng):
  """cu_seqlens as jit arguments: the same traced array for q and k (causal,
  packed), distinct traced arrays without a mask (packed, T != S) and with
  causal (the aligned row), all equal to the oracle."""
  q_lens, k_lens = [7, 0, 40, 13], [20, 3, 9, 0]
  h, hk, d = 2, 1, 16
  q = jnp.asarray(rng.standard_normal((sum(q_lens), h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((sum(k_lens), hk, d)), jnp.float32) for _ in "kv")
  kq, vq = (jnp.asarray(rng.standard_normal((sum(q_lens), hk, d)), jnp.float32) for _ in "kv")
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  varlen = functools.partial(jax_flash2.flash_attention_varlen, return_lse=True,
                             implementation=backend)

  @jax.jit
  def self_causal(q, k, v, cu):
    return varlen(q, k, v, cu, cu, 40, 40, causal=True)

  @jax.jit
  def cross(q, k, v, cu_q, cu_k):
    return varlen(q, k, v, cu_q, cu_k, 40, 20)

  @jax.jit
  def causal_distinct(q, k, v, cu_q, cu_k):
    return varlen(q, k, v, cu_q, cu_k, 40, 40, causal=True)

  cu_q, cu_k = _cu(q_lens), _cu(k_lens)
  runs = [
      (lambda q, k, v: self_causal(q, k, v, cu_q), (q, kq, vq), q_lens, {"causal": True}),
      (lambda q, k, v: cross(q, k, v, cu_q, cu_k), (q, k, v), k_lens, {}),
      (lambda q, k, v: causal_distinct(q, k, v, cu_q, cu_q), (q, kq, vq), q_lens,
       {"causal": True}),
  ]
  for f, args, lens, options in runs:
    (out, lse), vjp = jax.vjp(f, *args)
    grads = vjp((d_out, jnp.zeros_like(lse)))
    (ref_out, ref_lse), ref_grads = _packed_oracle(*args, d_out, q_lens, lens, options)
    assert max_err(out, ref_out) <= 2e-5 and max_err(lse, ref_lse) <= 1e-4
    for g, r in zip(grads, ref_grads):
      assert max_err(g, r) <= 1e-4 * max(1.0, float(np.max(np.abs(r))))


@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_packed_aligned_and_padded_paths_agree(rng, with_sinks):
  """The three paths forced on the same causal call (equal offsets, padding
  rows past cu_seqlens[-1] on both sides): the same out, LSE and gradients;
  the padding rows give out 0 and the LSE of a row that sees no key (-inf,
  or the sink)."""
  lens = [9, 0, 31, 2, 17]
  h, d = 2, 16
  q = jnp.asarray(rng.standard_normal((sum(lens) + 3, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((sum(lens) + 6, h, d)), jnp.float32) for _ in "kv")
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  sinks = jnp.asarray([0.5, -1.0], jnp.float32) if with_sinks else None
  cu = _cu(lens)

  def run(path, traced):
    def f(q, k, v, cu_arg):
      offsets = cu_arg if traced else cu
      return jax_flash2._varlen.varlen_attention(
          functools.partial(jax_flash2.flash_attention, causal=True, window_size=(5, -1),
                            sinks=sinks),
          q, k, v, offsets, offsets, max(lens), max(lens), True, positional=True, path=path)
    (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v, cu)
    return out, lse, vjp((d_out, jnp.zeros_like(lse)))[:3]

  packed = run("packed", traced=True)
  # Offsets traced (jit arguments) or concrete (closed over).
  for path in ("aligned", "padded"):
    for other in (run(path, traced=True), run(path, traced=False)):
      for a, b in zip(jax.tree.leaves(packed), jax.tree.leaves(other)):
        assert max_err(a, b) <= 2e-5
  assert np.all(np.asarray(packed[0])[sum(lens):] == 0)
  pad_lse = np.asarray(packed[1])[:, sum(lens):]
  if with_sinks:
    np.testing.assert_allclose(pad_lse, np.broadcast_to(np.asarray(sinks)[:, None],
                                                         pad_lse.shape), rtol=1e-6)
  else:
    assert np.all(np.isneginf(pad_lse))


def test_zero_tokens_and_empty_sequences(backend):
  """No query, no key, or sequences of length 0 only: empty or zero outputs,
  LSE -inf, zero gradients."""
  f = functools.partial(jax_flash2.flash_attention_varlen, return_lse=True,
                        implementation=backend)
  q0, k0 = jnp.ones((0, 2, 16)), jnp.ones((0, 2, 16))
  out, lse = f(q0, k0, k0, _cu([0, 0]), _cu([0, 0]), 1, 1, causal=True)
  assert out.shape == (0, 2, 16) and lse.shape == (2, 0)
  q = jnp.ones((5, 2, 16))
  out, lse = f(q, k0, k0, _cu([5, 0]), _cu([0, 0]), 5, 1)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
  # Tokens that belong to no sequence (cu_seqlens[-1] == 0 < total).
  out, lse = f(q, q, q, _cu([0, 0]), _cu([0, 0]), 1, 1, causal=True)
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
  grads = jax.grad(lambda q: jnp.sum(f(q, q, q, _cu([0, 0]), _cu([0, 0]), 1, 1)[0]))(q)
  assert np.all(np.asarray(grads) == 0)


def _compiled_memory(f, *args):
  compiled = jax.jit(f).lower(*args).compile()
  return compiled.memory_analysis().temp_size_in_bytes, compiled.as_text()


def test_packed_memory_linear_in_tokens(rng):
  """1,000 short sequences and one of 4,096 tokens: the packed path's
  forward+backward needs temporary memory of a few times the packed tensors
  (linear in the tokens, no [n, max_seqlen, ...] buffer in its HLO); the
  padded path pads all 1,001 sequences to 4,096. Compiled, not run (CPU)."""
  short = rng.integers(1, 9, size=1000)
  lens = np.concatenate([short, [4096]])
  n, total, h, d = len(lens), int(lens.sum()), 1, 8
  cu = _cu(lens)
  # Compiled for the CPU on every machine (the GPU figures are packed_bench's).
  cpu = _cpu_sharding()
  spec = jax.ShapeDtypeStruct((total, h, d), jnp.float32, sharding=cpu)

  def loss(path):
    def f(q, k, v):
      out = jax_flash2._varlen.varlen_attention(
          functools.partial(jax_flash2.flash_attention, causal=True), q, k, v, cu, cu,
          4096, 4096, False, positional=True, path=path)
      return jnp.sum(out * out)
    return jax.value_and_grad(f, argnums=(0, 1, 2))

  packed, packed_hlo = _compiled_memory(loss("packed"), spec, spec, spec)
  padded, padded_hlo = _compiled_memory(loss("padded"), spec, spec, spec)
  tensor = total * h * d * 4  # one packed [total, H, D] float32 tensor
  print(f"temp bytes: packed {packed:,}, padded {padded:,} ({total} tokens, "
        f"{tensor:,} B per tensor)")
  padded_shape = f"[{n},4096,{h},{d}]"
  assert padded_shape in padded_hlo  # the check below can see such a buffer
  assert padded_shape not in packed_hlo and f"[{n},4096]" not in packed_hlo
  assert packed <= 16 * tensor, (packed, tensor)
  assert padded >= n * 4096 * h * d * 4


def test_aligned_memory_linear_in_tokens(rng):
  """1,000 short sequences and one of 4,096 tokens, causal, with one key more
  than queries per sequence (offsets that differ: no single packed row): the
  aligned row's forward+backward needs temporary memory of a few times the
  packed tensors and no [n, max_seqlen, ...] buffer, where the padded batch
  pads every sequence to 4,097. Compiled, not run (CPU)."""
  short = rng.integers(1, 9, size=1000)
  q_lens = np.concatenate([short, [4096]])
  k_lens = q_lens + 1
  n, h, d = len(q_lens), 1, 8
  cu_q, cu_k = _cu(q_lens), _cu(k_lens)
  total_q, total_k = int(q_lens.sum()), int(k_lens.sum())
  cpu = _cpu_sharding()
  q_spec = jax.ShapeDtypeStruct((total_q, h, d), jnp.float32, sharding=cpu)
  k_spec = jax.ShapeDtypeStruct((total_k, h, d), jnp.float32, sharding=cpu)
  sizes = jax_flash2._varlen.Sizes(total_q, total_k, 4096, 4097, h, h)
  assert jax_flash2._varlen.choose_path(cu_q, cu_k, True, None, sizes) == "aligned"

  def loss(q, k, v):
    out = jax_flash2.flash_attention_varlen(q, k, v, cu_q, cu_k, 4096, 4097, causal=True)
    return jnp.sum(out * out)

  temp, hlo = _compiled_memory(jax.value_and_grad(loss, argnums=(0, 1, 2)), q_spec, k_spec, k_spec)
  tensor = total_k * h * d * 4
  print(f"temp bytes: aligned {temp:,} ({total_q} + {total_k} tokens, {tensor:,} B per tensor)")
  assert f"[{n},4096" not in hlo and f"[{n},4097" not in hlo
  assert temp <= 24 * tensor, (temp, tensor)


@pytest.mark.parametrize("case", [c for c in CASES if c[0] != c[1] and c[5].get("causal")],
                         ids=lambda c: f"q{c[0]}-k{c[1]}")
def test_aligned_and_padded_paths_agree(case, rng):
  """Causal with offsets that differ, queries past cu_seqlens_q[-1], a
  seqused_k: the aligned row and the padded batch forced on the same calls
  give the same out, LSE and gradients."""
  q_lens, k_lens, h, hk, d, options = case
  q = jnp.asarray(rng.standard_normal((sum(q_lens) + 2, h, d)), jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((sum(k_lens), hk, d)), jnp.float32) for _ in "kv")
  d_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
  cu_q, cu_k = _cu(q_lens), _cu(k_lens)
  for used in (None, jnp.asarray([max(s - 2, 0) for s in k_lens], jnp.int32)):
    def run(path):
      def f(q, k, v):
        return jax_flash2._varlen.varlen_attention(
            functools.partial(jax_flash2.flash_attention, **options), q, k, v, cu_q, cu_k,
            max(q_lens), max(k_lens), True, positional=True, seqused_k=used, path=path)
      (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
      return out, lse, vjp((d_out, jnp.zeros_like(lse)))
    aligned, padded = run("aligned"), run("padded")
    for a, b in zip(jax.tree.leaves(aligned), jax.tree.leaves(padded)):
      assert max_err(a, b) <= 2e-5


# seqused_k: sequence b uses the first seqused_k[b] keys of its range; causal
# and window align bottom-right to that used length (FlashAttention's).

# (name, q lengths, k lengths (None: the same offsets), seqused_k, H, K, D,
#  options)
SEQUSED_CASES = [
    ("cross", [5, 17, 1, 30, 0, 8], [7, 17, 3, 30, 4, 0], [0, 9, 3, 30, 2, 0], 4, 2, 32, {}),
    ("cross-causal", [5, 17, 1, 30, 0, 8], [7, 17, 3, 30, 4, 0], [0, 9, 3, 30, 2, 0], 4, 2, 32,
     {"causal": True}),
    # Same offsets: the used keys' diagonal is not the row's, so not packed.
    ("self-causal-mqa", [20, 33, 1, 9, 0], None, [20, 10, 0, 4, 0], 4, 1, 16, {"causal": True}),
    ("window-causal", [12, 40, 3], [30, 41, 70], [25, 17, 70], 2, 2, 16,
     {"causal": True, "window_size": (5, -1)}),
    ("window-two-sided", [12, 40, 3], [30, 41, 70], [25, 41, 9], 2, 1, 16,
     {"window_size": (3, 2)}),
    ("cross-softcap-many", _lengths_64(7)[:20], _lengths_64(8)[:20], None, 2, 2, 16,
     {"softcap": 2.0}),
]
SEQUSED_PARAMS = [pytest.param(c, jnp.float32, id=f"{c[0]}-float32") for c in SEQUSED_CASES] + [
    pytest.param(c, jnp.bfloat16, id=f"{c[0]}-bfloat16") for c in SEQUSED_CASES
    if c[0] in ("cross", "self-causal-mqa")]


def _seqused_inputs(rng, q_lens, k_lens, used, h, hk, d, dtype, poison=np.nan):
  """q, k, v, d_out and offsets, with `poison` in every unused key and value
  row (the keys past seqused_k of each sequence)."""
  q = jnp.asarray(rng.standard_normal((sum(q_lens), h, d)), dtype)
  k = rng.standard_normal((sum(k_lens), hk, d))
  v = rng.standard_normal((sum(k_lens), hk, d))
  cu_k = np.concatenate([[0], np.cumsum(k_lens)])
  for b, u in enumerate(used):
    k[cu_k[b] + u:cu_k[b + 1]] = poison
    v[cu_k[b] + u:cu_k[b + 1]] = poison
  k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
  d_out = jnp.asarray(rng.standard_normal(q.shape), dtype)
  return q, k, v, d_out


def _seqused_oracle(q, k, v, d_out, q_lens, k_lens, used, options):
  """(out, lse), (dq, dk, dv) in float64, the oracle run sequence by sequence
  on the used keys only (so its bottom-right alignment is the used length's);
  unused keys get dk = dv = 0."""
  q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
  h = q.shape[1]
  out, lse = np.zeros(q.shape), np.full((h, q.shape[0]), -np.inf)
  grads = [np.zeros(x.shape) for x in (q, k, v)]
  qs = ks = 0
  for t, s, u in zip(q_lens, k_lens, used):
    if t and u:
      (o, l), g = oracle(q[None, qs:qs + t], k[None, ks:ks + u], v[None, ks:ks + u],
                         d_out[None, qs:qs + t], np.zeros((1, h, t)), **options)
      out[qs:qs + t], lse[:, qs:qs + t] = o[0], l[0]
      grads[0][qs:qs + t] = g[0][0]
      grads[1][ks:ks + u], grads[2][ks:ks + u] = g[1][0], g[2][0]
    qs, ks = qs + t, ks + s
  return (out, lse), grads


@pytest.mark.parametrize("case,dtype", SEQUSED_PARAMS)
def test_seqused_k_matches_oracle(backend, case, dtype, rng):
  """Forward, LSE and gradients with seqused_k (0, partial and full, length-0
  sequences) against the float64 oracle on the used keys, NaN written into
  every unused key and value: none reaches out, LSE or dq, and the unused
  keys get dk = dv = 0 exactly."""
  if not supports(backend, dtype):
    pytest.skip(f"{backend} does not serve {jnp.dtype(dtype).name} here")
  name, q_lens, k_lens, used, h, hk, d, options = case
  same = k_lens is None
  k_lens = q_lens if same else k_lens
  if used is None:  # a random length in [0, key length] per sequence
    used = [int(rng.integers(0, s + 1)) for s in k_lens]
  q, k, v, d_out = _seqused_inputs(rng, q_lens, k_lens, used, h, hk, d, dtype)
  cu_q = _cu(q_lens)
  cu_k = cu_q if same else _cu(k_lens)
  seqused = jnp.asarray(used, jnp.int32)
  positional = options.get("causal", False) or "window_size" in options
  expected_path = "aligned" if positional else "packed"
  assert jax_flash2._varlen.choose_path(cu_q, cu_k, positional, seqused) == expected_path

  def f(q, k, v):
    return jax_flash2.flash_attention_varlen(
        q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), seqused_k=seqused, return_lse=True,
        implementation=backend, **options)

  visible = _local_mask(q_lens, k_lens, sum(q_lens), sum(k_lens), used=used,
                        causal=options.get("causal", False),
                        window_size=options.get("window_size", (-1, -1)))
  (out, lse), vjp = jax.vjp(jax.jit(f), q, k, v)
  grads = vjp((d_out, jnp.zeros_like(lse)))
  (ref_out, ref_lse), ref_grads = _seqused_oracle(q, k, v, d_out, q_lens, k_lens, used, options)
  if dtype == jnp.float32:
    plain_out, plain_lse, plain_grads = ref_out, ref_lse, ref_grads
  else:
    mask = jnp.asarray(visible)
    finite = [jnp.nan_to_num(x) for x in (k, v)]  # the plain attention has no notion of unused
    plain_out, plain_lse, plain_grads = _plain_with_grads(q, *finite, mask, d_out,
                                                          options.get("softcap", 0.0))
  _within_rule("out", out, ref_out, plain_out, dtype)
  _within_rule("lse", lse, ref_lse, plain_lse, dtype)
  for g_name, g, r, p in zip(("dq", "dk", "dv"), grads, ref_grads, plain_grads):
    _within_rule(g_name, g, r, p, dtype)
  unused = np.ones(k.shape[0], bool)
  for b, u in enumerate(used):
    unused[int(cu_k[b]):int(cu_k[b]) + u] = False
  assert np.all(np.asarray(grads[1])[unused] == 0) and np.all(np.asarray(grads[2])[unused] == 0)
  # Queries of sequences that use no key: out 0, LSE -inf.
  no_key = ~visible.any(axis=1)
  assert np.all(np.asarray(out)[no_key] == 0) and np.all(np.isneginf(np.asarray(lse)[:, no_key]))


def test_seqused_k_full_is_no_seqused_k(rng):
  """seqused_k equal to every key length gives what no seqused_k gives, on
  both paths (cross without mask: packed; causal: aligned)."""
  q_lens, k_lens = [9, 30, 0, 4], [12, 30, 5, 4]
  q, k, v, _ = _seqused_inputs(rng, q_lens, k_lens, k_lens, 2, 1, 16, jnp.float32)
  cu_q, cu_k = _cu(q_lens), _cu(k_lens)
  for causal in (False, True):
    f = functools.partial(jax_flash2.flash_attention_varlen, q, k, v, cu_q, cu_k, 30, 30,
                          causal=causal, return_lse=True)
    for a, b in zip(f(), f(seqused_k=jnp.asarray(k_lens, jnp.int32))):
      assert max_err(a, b) <= 1e-6


def test_seqused_k_traced_under_jit(backend, rng):
  """seqused_k as a jit argument: new values run without retracing and match
  the oracle, on the packed (no mask) and the aligned (causal) path."""
  q_lens, k_lens = [6, 0, 21, 13], [20, 3, 9, 17]
  h, hk, d = 2, 1, 16
  cu_q, cu_k = _cu(q_lens), _cu(k_lens)
  traces = []

  @functools.partial(jax.jit, static_argnames="causal")
  def f(q, k, v, d_out, seqused, causal):
    traces.append(causal)

    def g(q, k, v):
      return jax_flash2.flash_attention_varlen(q, k, v, cu_q, cu_k, 21, 20, seqused_k=seqused,
                                               causal=causal, return_lse=True,
                                               implementation=backend)
    (out, lse), vjp = jax.vjp(g, q, k, v)
    return out, lse, vjp((d_out, jnp.zeros_like(lse)))

  for causal in (False, True):
    for used in ([20, 3, 9, 17], [0, 1, 4, 17], [7, 0, 9, 2]):
      q, k, v, d_out = _seqused_inputs(rng, q_lens, k_lens, used, h, hk, d, jnp.float32)
      out, lse, grads = f(q, k, v, d_out, jnp.asarray(used, jnp.int32), causal)
      options = {"causal": True} if causal else {}
      (ref_out, ref_lse), ref_grads = _seqused_oracle(q, k, v, d_out, q_lens, k_lens, used,
                                                      options)
      assert max_err(out, ref_out) <= 2e-5 and max_err(lse, ref_lse) <= 1e-4
      for g, r in zip(grads, ref_grads):
        assert max_err(g, r) <= 1e-4 * max(1.0, float(np.max(np.abs(r))))
  assert traces == [False, True]


def _spec(x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype)


def test_seqused_k_keeps_the_kernel_plan():
  """seqused_k changes only the segment ids' values (packed) or what is
  copied (aligned): the flash_attention call underneath has the same shapes
  and options as without it, so plan names the same kernels (sm90 on Hopper
  for these shapes)."""
  q_lens, k_lens, used = [2000, 3000, 1500], [2100, 3000, 1600], [700, 3000, 0]
  q = jax.ShapeDtypeStruct((sum(q_lens), 16, 128), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((sum(k_lens), 4, 128), jnp.bfloat16)
  cu_q, cu_k = _cu(q_lens), _cu(k_lens)

  def inner_call(options, seqused):
    """(q, k, v specs, options) of the flash_attention call varlen makes."""
    seen = []

    def recording(q, k, v, **kwargs):
      seen.append(((_spec(q), _spec(k), _spec(v)), {**options, **kwargs}))
      return jax_flash2.flash_attention(q, k, v, **options, **kwargs)

    def varlen(q, k, v):
      return jax_flash2._varlen.varlen_attention(recording, q, k, v, cu_q, cu_k, 3000, 3000,
                                                 True, positional=bool(options),
                                                 seqused_k=seqused)

    jax.eval_shape(varlen, q, k, k)
    return seen[0]

  for options in ({}, {"causal": True}, {"window_size": (256, 0)}):
    calls = [inner_call(options, s) for s in (None, jnp.asarray(used, jnp.int32))]
    plans = []
    for specs, kwargs in calls:
      kwargs = {**kwargs, "segment_ids": tuple(map(_spec, kwargs["segment_ids"]))}
      kwargs.pop("return_lse")
      plans.append(jax_flash2.plan(*specs, compute_capability=(9, 0), **kwargs))
    assert calls[0][0] == calls[1][0] and calls[0][1].keys() == calls[1][1].keys()
    assert plans[0] == plans[1]
    assert plans[1]["forward"].kernel == "sm90" and plans[1]["backward"].kernel == "sm90", plans


def test_seqused_k_bad_arguments():
  q = jnp.ones((10, 2, 16))
  k = jnp.ones((12, 2, 16))
  cu_q = jnp.asarray([0, 4, 10], jnp.int32)
  cu_k = jnp.asarray([0, 5, 12], jnp.int32)
  f = functools.partial(jax_flash2.flash_attention_varlen, q, k, k, cu_q, cu_k, 8, 8)
  with pytest.raises(TypeError, match="seqused_k must be an integer array"):
    f(seqused_k=jnp.asarray([1.0, 2.0]))
  with pytest.raises(TypeError, match="seqused_k must be an integer array"):
    f(seqused_k=[1, 2])
  with pytest.raises(ValueError, match=r"seqused_k must be 1-D \[n\] = \[2\]"):
    f(seqused_k=jnp.asarray([1, 2, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"seqused_k\[1\] = 8, key length 7"):
    f(seqused_k=jnp.asarray([5, 8], jnp.int32))
  with pytest.raises(ValueError, match=r"seqused_k\[0\] = -1"):
    f(seqused_k=jnp.asarray([-1, 0], jnp.int32))
  # Traced: the shape and dtype are still checked, the values are trusted.
  with pytest.raises(ValueError, match="seqused_k must be 1-D"):
    jax.jit(lambda s: f(seqused_k=s))(jnp.zeros((2, 1), jnp.int32))
  out = jax.jit(lambda s: f(seqused_k=s, causal=True))(jnp.asarray([99, -3], jnp.int32))
  assert np.all(np.isfinite(np.asarray(out)))
