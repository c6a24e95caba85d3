"""Every head dim D from 1 to 256 on every backend, forward and backward.

The kernels take D in multiples of 8; flash_attention pads q, k, v with zeros
to the next multiple outside the autodiff rule (the padding adds 0 to every
score; the scale stays 1 / sqrt(D)) and slices the output, so gradients flow
through the pad and the slice. The oracle is unpadded float64 attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from conftest import random_inputs
from test_attention import _check_forward, _check_gradients

HEAD_DIMS = (1, 59, 100, 255)


@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float32), ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("causal", (False, True), ids=("full", "causal"))
def test_head_dim(backend, head_dim, causal, dtype, rng):
  case = (2, 19, 23, 4, 2, head_dim, causal)
  _check_forward(backend, case, dtype, rng)
  _check_gradients(backend, case, dtype, rng, with_lse_cotangent=True)


@pytest.mark.parametrize("head_dim", (3, 59))
def test_head_dim_with_options(backend, head_dim, rng):
  case = (2, 37, 41, 4, 1, head_dim, True)
  options = {"window_size": (20, -1), "softcap": 4.0, "alibi": "bh", "segments": "packed"}
  _check_forward(backend, case, jnp.float32, rng, options)
  _check_gradients(backend, case, jnp.float32, rng, with_lse_cotangent=True, options=options)


def test_head_dims_outside_1_to_256_are_errors():
  for head_dim in (0, 257, 264):
    x = jnp.ones((1, 4, 2, head_dim), jnp.float32)
    with pytest.raises(ValueError, match=r"head_dim D must be in \[1, 256\]"):
      jax_flash2.flash_attention(x, x, x)


def test_padding_is_outside_the_kernel_call(rng):
  """The kernel sees D rounded up to 8; the results have the caller's D."""
  q, k, v = random_inputs(rng, 1, 9, 9, 2, 2, 13, jnp.float32)
  jaxpr = str(jax.make_jaxpr(lambda q, k, v: jax_flash2.flash_attention(q, k, v))(q, k, v))
  assert "pad" in jaxpr and "f32[1,9,2,16]" in jaxpr
  out = jax_flash2.flash_attention(q, k, v)
  assert out.shape == (1, 9, 2, 13)
  want = jax_flash2.flash_attention(q, k, v, implementation="reference")
  np.testing.assert_allclose(out, want, atol=2e-6, rtol=2e-6)
