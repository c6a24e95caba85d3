"""Public API: argument checking into one frozen, hashable AttentionConfig.

Shape letters used throughout the package:
  B batch, T query length, S key/value length, H query heads,
  K key/value heads (H % K == 0: MHA K == H, GQA 1 < K < H, MQA K == 1),
  D head dim (a multiple of 8, at most 256).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import _ext, _vjp, reference

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
MAX_HEAD_DIM = 256
IMPLEMENTATIONS = ("kernel", "reference")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Everything about a call that is not an array; the custom_vjp's static argument.

  The window is relative to the bottom-right-aligned diagonal: query i sees key j
  iff i + S - T - window_left <= j <= i + S - T + window_right (-1 = unbounded).
  causal is folded in as window_right = 0.
  """

  softmax_scale: float
  window_left: int = -1
  window_right: int = -1
  softcap: float = 0.0
  implementation: str = "kernel"


def _shape_error(name: str, value: Any, expected: str) -> ValueError:
  return ValueError(f"flash_attention: {name} {expected}; got {value}")


def _check_arrays(q, k, v, dtypes) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"flash_attention: {name} must be an array; got {type(x).__name__}")
    if x.ndim != 4:
      raise _shape_error(f"{name}.shape", x.shape, "must be rank 4 [B, T|S, H|K, D]")
    if x.dtype not in dtypes:
      names = ", ".join(jnp.dtype(d).name for d in dtypes)
      raise TypeError(f"flash_attention: {name}.dtype must be one of {names}; got {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(
        "flash_attention: q, k, v must share one dtype; got "
        f"q {q.dtype}, k {k.dtype}, v {v.dtype}"
    )
  if k.shape != v.shape:
    raise _shape_error("k.shape and v.shape", (k.shape, v.shape), "must be equal [B, S, K, D]")
  if q.shape[0] != k.shape[0]:
    raise _shape_error("batch sizes (q.shape[0], k.shape[0])", (q.shape[0], k.shape[0]),
                       "must be equal")
  if q.shape[3] != k.shape[3]:
    raise _shape_error("head dims (q.shape[3], k.shape[3])", (q.shape[3], k.shape[3]),
                       "must be equal")
  if q.shape[1] < 1 or k.shape[1] < 1:
    raise _shape_error("sequence lengths (T, S)", (q.shape[1], k.shape[1]), "must be >= 1")
  if k.shape[2] < 1 or q.shape[2] % k.shape[2] != 0:
    raise _shape_error("heads (H, K)", (q.shape[2], k.shape[2]),
                       "must satisfy H % K == 0 (MHA, GQA or MQA)")
  head_dim = q.shape[3]
  if head_dim % 8 != 0 or not 8 <= head_dim <= MAX_HEAD_DIM:
    raise _shape_error("head_dim D", head_dim, f"must be a multiple of 8 in [8, {MAX_HEAD_DIM}]")


def _check_scale(softmax_scale, head_dim: int) -> float:
  if softmax_scale is None:
    return 1.0 / math.sqrt(head_dim)
  if isinstance(softmax_scale, jax.core.Tracer):
    raise TypeError("flash_attention: softmax_scale must be a static Python number, not a traced value")
  try:
    scale = float(softmax_scale)
  except (TypeError, ValueError):
    raise TypeError(f"flash_attention: softmax_scale must be a number; got {softmax_scale!r}") from None
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"flash_attention: softmax_scale must be finite and > 0; got {softmax_scale!r}")
  return scale


def _check_window(window_size, causal: bool) -> tuple[int, int]:
  try:
    left, right = window_size
  except (TypeError, ValueError):
    raise ValueError(
        f"flash_attention: window_size must be a pair (left, right); got {window_size!r}"
    ) from None
  for name, value in (("left", left), ("right", right)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < -1:
      raise ValueError(
          f"flash_attention: window_size {name} must be an int >= -1 (-1 = unbounded); got {value!r}"
      )
  left, right = int(left), int(right)
  if causal:
    right = 0 if right < 0 else min(right, 0)
  return left, right


def _check_softcap(softcap) -> float:
  if isinstance(softcap, jax.core.Tracer):
    raise TypeError("flash_attention: softcap must be a static Python number, not a traced value")
  try:
    value = float(softcap)
  except (TypeError, ValueError):
    raise TypeError(f"flash_attention: softcap must be a number; got {softcap!r}") from None
  if not math.isfinite(value) or value < 0:
    raise ValueError(f"flash_attention: softcap must be finite and >= 0 (0 = off); got {softcap!r}")
  return value


def make_config(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                softcap=0.0, implementation=None, dtypes=SUPPORTED_DTYPES) -> AttentionConfig:
  """Checks the arguments of flash_attention and returns its static config."""
  _check_arrays(q, k, v, dtypes)
  if not isinstance(causal, (bool, np.bool_)):
    raise TypeError(f"flash_attention: causal must be a bool; got {causal!r}")
  if implementation is None:
    implementation = "kernel"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"flash_attention: implementation must be one of {IMPLEMENTATIONS} or None; got {implementation!r}"
    )
  left, right = _check_window(window_size, bool(causal))
  return AttentionConfig(
      softmax_scale=_check_scale(softmax_scale, q.shape[3]),
      window_left=left,
      window_right=right,
      softcap=_check_softcap(softcap),
      implementation=implementation,
  )


def flash_attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None,
                    return_lse: bool = False, window_size: tuple[int, int] = (-1, -1),
                    softcap: float = 0.0, implementation: str | None = None):
  """FlashAttention-2: softmax(q k^T * scale [masked]) v without the T x S matrix.

  Args:
    q: [B, T, H, D] float16, bfloat16 or float32.
    k, v: [B, S, K, D], same dtype; H % K == 0 (MHA, GQA, MQA: K/V heads are
      shared by H // K query heads, never copied).
    causal: query i sees keys j <= i + S - T (aligned bottom-right, as in
      FlashAttention-2, so with T < S the last query sees every key). A query
      that sees no key (T > S) returns 0 and LSE -inf.
    softmax_scale: defaults to 1 / sqrt(D).
    return_lse: also return the logsumexp of the scaled, masked scores.
    window_size: (left, right) local attention around the bottom-right-aligned
      diagonal: query i sees keys i + S - T - left <= j <= i + S - T + right;
      -1 = unbounded. Combined with causal, right is at most 0.
    softcap: if > 0, scaled scores s become softcap * tanh(s / softcap)
      (Gemma-2); 0 = off. CPU kernels and reference (CUDA: not yet).
    implementation: None or "kernel" (the compiled kernels of the platform),
      or "reference" (plain JAX, materializes the T x S scores).

  Returns:
    out [B, T, H, D] in q's dtype; with return_lse, (out, lse) with lse
    [B, H, T] float32. Both are differentiable in q, k, v.
  """
  config = make_config(q, k, v, causal=causal, softmax_scale=softmax_scale,
                       window_size=window_size, softcap=softcap, implementation=implementation)
  if config.implementation == "reference":
    out, lse = reference.forward_from_config(q, k, v, config)
  else:
    out, lse = _vjp.attention(q, k, v, config)
  return (out, lse) if return_lse else out


def kernel_info() -> dict[str, str | None]:
  """Which compiled kernels serve each platform in this installation."""
  return {
      "cpu": f"cpu-flash2 ({_ext.cpu_ext.isa()})",
      "cuda": "cuda-flash2-sm80" if _ext.cuda_ext is not None else None,
  }
