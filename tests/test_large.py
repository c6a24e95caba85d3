"""The large cases on the GPU: T = 8192 causal and not, D = 128 and
256, GQA 8:1, B*H = 256, T != S, decode shapes. Kernel backend, float16 and
bfloat16: forward, LSE and gradients (of loss = <out, d_out> + <lse, d_lse>)
against a float64 oracle, with tests/oracle.py's tolerance rule.

What is sampled: the kernel runs on the whole problem, but only some
(batch, KV head) groups are compared with the oracle, `Case.groups` of them
(always the last group, where a batch or head offset error shows first, and
the rest drawn at random; all groups when the count reaches B*K). Within a
checked group every query row, every query head of the group and every key is
compared: out, lse and dq for the group's query heads, dk and dv for its KV
head. The oracle (tests/oracle_chunked.py) is numpy float64 over chunks of
query rows, so it holds a few hundred MB at most (the largest group: 8 heads
at T = 8192); the plain same-dtype attention that sets the tolerance runs on
the GPU, one group at a time (at most [1, 8, 8192, 6000] scores). Every head,
checked or not, must be finite, with LSE -inf exactly on rows that see no key.
"""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2

from conftest import ON_GPU
from oracle import assert_close_to_oracle, naive_same_dtype
from oracle_chunked import groups_oracle, visible_key_bounds

pytestmark = pytest.mark.skipif(not ON_GPU, reason="the large cases run on a GPU")


class Case(typing.NamedTuple):
  name: str
  batch: int
  seqlen_q: int
  seqlen_k: int
  heads_q: int
  heads_kv: int
  head_dim: int
  causal: bool
  grads: bool   # False: forward and LSE only
  groups: int   # (batch, KV head) groups compared with the oracle


CASES = [
    Case("t8k-d128", 1, 8192, 8192, 8, 8, 128, False, True, 2),
    Case("t8k-d128-causal", 1, 8192, 8192, 8, 8, 128, True, True, 2),
    Case("t8k-d256-causal", 1, 8192, 8192, 4, 4, 256, True, True, 2),
    # GQA 8:1, T > S: causal rows 0 .. T - S - 1 see no key.
    Case("gqa8-t8k-s6000-causal", 2, 8192, 6000, 16, 2, 128, True, True, 1),
    Case("bh256-t1k-causal", 16, 1024, 1024, 16, 16, 64, True, True, 32),
    Case("decode-t1-s32k", 8, 1, 32768, 32, 4, 128, False, False, 32),
    Case("decode-t16-s32k-causal", 8, 16, 32768, 32, 4, 128, True, False, 8),
    Case("decode-t4-s32k", 8, 4, 32768, 32, 4, 128, False, False, 8),
    Case("decode-t8-s32k-causal", 8, 8, 32768, 32, 4, 128, True, False, 8),
    Case("mqa-t257-s8k", 2, 257, 8192, 8, 1, 128, False, True, 2),
    Case("mqa-t257-s8k-causal", 2, 257, 8192, 8, 1, 128, True, True, 2),
]


def _sample_groups(rng, case):
  """The (b, kv_head) groups to check: the last one and groups - 1 others at random."""
  total = case.batch * case.heads_kv
  if case.groups >= total:
    picked = np.arange(total)
  else:
    picked = np.append(rng.choice(total - 1, case.groups - 1, replace=False), total - 1)
  return [divmod(int(i), case.heads_kv) for i in np.sort(picked)]


def _device_normal(rng, shape, dtype):
  """Standard normal drawn on the device: numpy float64 draws of the decode
  K/V (134M values each) would take seconds per case."""
  key = jax.random.key(int(rng.integers(2**31)))
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


@functools.partial(jax.jit, static_argnames=("causal",))
def _ours_forward(q, k, v, causal):
  return jax_flash2.flash_attention(q, k, v, causal=causal, return_lse=True,
                                    implementation="kernel")


@functools.partial(jax.jit, static_argnames=("causal",))
def _ours_with_grads(q, k, v, d_out, d_lse, causal):
  (out, lse), vjp = jax.vjp(functools.partial(_ours_forward, causal=causal), q, k, v)
  return (out, lse), vjp((d_out, d_lse))


@functools.partial(jax.jit, static_argnames=("causal", "grads"))
def _plain(q, k, v, d_out, d_lse, causal, grads):
  """The plain same-dtype attention (and its gradients) for one group."""
  fn = functools.partial(naive_same_dtype, causal=causal)
  if not grads:
    return fn(q, k, v), None
  result, vjp = jax.vjp(fn, q, k, v)
  return result, vjp((d_out, d_lse.astype(q.dtype)))


def _stack(arrays):
  return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float16), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_large(case, dtype, rng):
  b, t, s, h, hk, d = case[1:7]
  group = h // hk
  q = _device_normal(rng, (b, t, h, d), dtype)
  k = _device_normal(rng, (b, s, hk, d), dtype)
  v = _device_normal(rng, (b, s, hk, d), dtype)
  d_out = d_lse = None
  if case.grads:
    d_out = _device_normal(rng, (b, t, h, d), dtype)
    d_lse = _device_normal(rng, (b, h, t), jnp.float32)
    (out, lse), grads = _ours_with_grads(q, k, v, d_out, d_lse, case.causal)
  else:
    (out, lse), grads = _ours_forward(q, k, v, case.causal), ()
  assert out.shape == q.shape and out.dtype == q.dtype
  assert lse.shape == (b, h, t) and lse.dtype == jnp.float32
  for name, g, x in zip(("dq", "dk", "dv"), grads, (q, k, v)):
    assert g.shape == x.shape and g.dtype == x.dtype, name

  # Every head: finite, and LSE -inf exactly where a row sees no key.
  lo, hi = visible_key_bounds(np.arange(t), t, s, case.causal, (-1, -1))
  empty = jnp.asarray(hi <= lo)
  assert bool(jnp.all(jnp.isfinite(out))), "out: non-finite values"
  assert bool(jnp.all(jnp.where(empty, jnp.isneginf(lse), jnp.isfinite(lse)))), "lse: -inf pattern"
  for name, g in zip(("dq", "dk", "dv"), grads):
    assert bool(jnp.all(jnp.isfinite(g))), f"{name}: non-finite values"

  groups = _sample_groups(rng, case)
  inputs = [None if x is None else np.asarray(x) for x in (q, k, v, d_out, d_lse)]
  expected = groups_oracle(*inputs, groups, causal=case.causal)
  results = [np.asarray(x) for x in (out, lse, *grads)]
  names = ("out", "lse", "dq", "dk", "dv")[:len(results)]
  checked = {name: ([], [], []) for name in names}  # ours, oracle, plain; one entry per group
  for (bi, kv), (e_forward, e_grads) in zip(groups, expected):
    heads = slice(kv * group, (kv + 1) * group)
    # The group's inputs, batch and head axes kept: [1, T, G, D], [1, S, 1, D], [1, G, T].
    q_g, k_g, v_g = (jnp.asarray(x[bi:bi + 1, :, hs]) for x, hs in
                     zip(inputs[:3], (heads, slice(kv, kv + 1), slice(kv, kv + 1))))
    do_g = None if d_out is None else jnp.asarray(inputs[3][bi:bi + 1, :, heads])
    dl_g = None if d_lse is None else jnp.asarray(inputs[4][bi:bi + 1, heads])
    p_forward, p_grads = _plain(q_g, k_g, v_g, do_g, dl_g, causal=case.causal, grads=case.grads)
    plain = [p_forward[0][0], p_forward[1][0]]
    if case.grads:
      plain += [p_grads[0][0], p_grads[1][0, :, 0], p_grads[2][0, :, 0]]
    ours = [results[0][bi, :, heads], results[1][bi, heads]]
    if case.grads:
      ours += [results[2][bi, :, heads], results[3][bi, :, kv], results[4][bi, :, kv]]
    wanted = [*e_forward, *(e_grads or ())]
    for name, values in zip(names, zip(ours, wanted, plain)):
      for store, value in zip(checked[name], values):
        store.append(value)
  assert np.array_equal(np.isneginf(_stack(checked["lse"][0])),
                        np.isneginf(_stack(checked["lse"][1]))), "lse: -inf rows differ"
  for name, (ours, wanted, plain) in checked.items():
    assert_close_to_oracle(f"{name} (groups {groups})", _stack(ours), _stack(wanted),
                           _stack(plain), dtype)
