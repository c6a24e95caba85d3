"""The call's static config and its argument checks, and the extra operands.

AttentionConfig holds everything about a call that is not an array, checked
once here and hashable (the custom_jvp's static argument and the primitives'
parameter). ExtraOperands is the named structure of the array operands beside
q, k, v that every layer passes on as one value.

Shape letters used throughout the package:
  B batch, T query length, S key/value length, H query heads,
  K key/value heads (H % K == 0: MHA K == H, GQA 1 < K < H, MQA K == 1),
  D head dim (1 to 256; the kernels take multiples of 8, see kernel_head_dim).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_flash2 import _scores

SUPPORTED_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
MAX_HEAD_DIM = 256
IMPLEMENTATIONS = ("kernel", "reference")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """Everything about a call that is not an array; the custom_jvp's static argument.

  The window is relative to the bottom-right-aligned diagonal: query i sees key j
  iff i + S - T - window_left <= j <= i + S - T + window_right (-1 = unbounded).
  causal is folded in as window_right = 0.

  has_alibi / has_segment_ids say whether the alibi_slopes and segment-id
  operands (always passed, see ExtraOperands) take part in the call; so does
  dropout_rate > 0 for the dropout-seed operand. dropout_rate is a float32
  value (the kernels' attribute), kept here as a Python float.
  """

  softmax_scale: float
  window_left: int = -1
  window_right: int = -1
  softcap: float = 0.0
  has_alibi: bool = False
  has_segment_ids: bool = False
  # With segment ids: the caller's bound on any segment's key count (0:
  # none), a hint the CUDA forward chooses its tile by.
  max_segment_length: int = 0
  deterministic: bool = False
  dropout_rate: float = 0.0
  implementation: str = "kernel"
  # KV cache (jax_flash2.kvcache, forward only): the kv_seqlens operand gives
  # each sequence's valid key count (the window aligns to it, not to S);
  # page_size > 0: k, v are a page pool read through the block_table operand.
  has_kv_seqlens: bool = False
  page_size: int = 0
  # A quantized (int8 / float8_e4m3fn) cache that the kernel dequantizes with
  # the kv_scales operand.
  kv_quantized: bool = False


class ExtraOperands(NamedTuple):
  """The array operands beside q, k, v, in the order of the FFI signature.

  Always passed, so that each primitive has one signature; which of them a
  call reads is `ExtraOperands.used(config)`. Shapes, with B the batch axis
  (leading batch axes [*L] where several are allowed), in the comments.
  """

  alibi_slopes: Any    # [B, H] float32
  q_segment_ids: Any   # [B, T] int32
  kv_segment_ids: Any  # [B, S] int32
  dropout_seeds: Any   # [B, H, 2] uint32: one 64-bit Philox key per (batch, head)
  kv_seqlens: Any      # [B] int32: valid keys of each sequence (KV cache)
  block_table: Any     # [B, P] int32: page ids of each sequence (paged KV cache)
  kv_scales: Any       # [B, 2, 1 or P, K] float32: k's and v's scales (quantized KV cache)

  @staticmethod
  def trailing_ranks() -> "ExtraOperands":
    """Rank of each operand after its batch axes."""
    return ExtraOperands(alibi_slopes=1, q_segment_ids=1, kv_segment_ids=1, dropout_seeds=2,
                         kv_seqlens=0, block_table=1, kv_scales=3)

  @staticmethod
  def used(config: "AttentionConfig") -> "ExtraOperands":
    """Whether the call reads each operand (an unread one may be a stand-in)."""
    return ExtraOperands(alibi_slopes=config.has_alibi, q_segment_ids=config.has_segment_ids,
                         kv_segment_ids=config.has_segment_ids,
                         dropout_seeds=config.dropout_rate > 0,
                         kv_seqlens=config.has_kv_seqlens, block_table=config.page_size > 0,
                         kv_scales=config.kv_quantized)

  @classmethod
  def split(cls, args) -> tuple[tuple, "ExtraOperands"]:
    """(leading operands, ExtraOperands) of a primitive's flat operand list,
    whose last entries are the extra operands."""
    count = len(cls._fields)
    return tuple(args[:-count]), cls(*args[-count:])


def kernel_head_dim(head_dim: int) -> int:
  """The head dim the kernels run: D rounded up to a multiple of 8 (their
  vector width and mma k-step). api pads q, k, v with zeros to it outside the
  autodiff rule: zero columns add 0 to every score, the scale stays
  1 / sqrt(D), and the output is sliced back."""
  return -(-head_dim // 8) * 8


def shape_error(name: str, value: Any, expected: str,
                function: str = "flash_attention") -> ValueError:
  return ValueError(f"{function}: {name} {expected}; got {value}")


def _check_arrays(q, k, v, dtypes) -> None:
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"flash_attention: {name} must be an array; got {type(x).__name__}")
    if x.ndim != 4:
      raise shape_error(f"{name}.shape", x.shape, "must be rank 4 [B, T|S, H|K, D]")
    if x.dtype not in dtypes:
      names = ", ".join(jnp.dtype(d).name for d in dtypes)
      raise TypeError(f"flash_attention: {name}.dtype must be one of {names}; got {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(
        "flash_attention: q, k, v must share one dtype; got "
        f"q {q.dtype}, k {k.dtype}, v {v.dtype}"
    )
  if k.shape != v.shape:
    raise shape_error("k.shape and v.shape", (k.shape, v.shape), "must be equal [B, S, K, D]")
  if q.shape[0] != k.shape[0]:
    raise shape_error("batch sizes (q.shape[0], k.shape[0])", (q.shape[0], k.shape[0]),
                       "must be equal")
  if q.shape[3] != k.shape[3]:
    raise shape_error("head dims (q.shape[3], k.shape[3])", (q.shape[3], k.shape[3]),
                       "must be equal")
  if q.shape[1] < 1 or k.shape[1] < 1:
    raise shape_error("sequence lengths (T, S)", (q.shape[1], k.shape[1]), "must be >= 1")
  if q.shape[2] < 1 or k.shape[2] < 1 or q.shape[2] % k.shape[2] != 0:
    raise shape_error("heads (H, K)", (q.shape[2], k.shape[2]),
                      "must be >= 1 and satisfy H % K == 0 (MHA, GQA or MQA)")
  head_dim = q.shape[3]
  if not 1 <= head_dim <= MAX_HEAD_DIM:
    raise shape_error("head_dim D", head_dim, f"must be in [1, {MAX_HEAD_DIM}]")


def check_bool(name: str, value) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"flash_attention: {name} must be a bool; got {value!r}")


def _static_number(name: str, value) -> float:
  """A static real number (int, float, numpy scalar or concrete 0-d array) as
  float: traced values cannot become FFI attributes, and strings or bools are
  a mistake, not a number."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"flash_attention: {name} must be a static Python number, not a traced value")
  is_real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
  if not is_real and getattr(value, "shape", None) == () and hasattr(value, "dtype"):
    is_real = jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating)
  if not is_real:
    raise TypeError(f"flash_attention: {name} must be a number; got {value!r}")
  return float(value)


def _float32_positive(name: str, value: float, original) -> None:
  """The kernels read the value as a float32 attribute: it must stay finite
  and a normal number > 0 there (1e-50 rounds to 0, 1e39 to inf, and a
  subnormal such as 1e-40 reads as 0 where denormals are flushed, as in XLA's
  CPU threads)."""
  with np.errstate(over="ignore", under="ignore"):
    value32 = np.float32(value)
  if not np.isfinite(value32) or value32 < np.finfo(np.float32).tiny:
    raise ValueError(f"flash_attention: {name} must be finite and > 0 as a float32 (from "
                     f"{np.finfo(np.float32).tiny:.3g} to {np.finfo(np.float32).max:.3g}); got "
                     f"{original!r}, which is {value32} in float32")


def _check_scale(softmax_scale, head_dim: int) -> float:
  if softmax_scale is None:
    return 1.0 / math.sqrt(head_dim)
  scale = _static_number("softmax_scale", softmax_scale)
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"flash_attention: softmax_scale must be finite and > 0; got {softmax_scale!r}")
  _float32_positive("softmax_scale", scale, softmax_scale)
  return scale


_INT64_MAX = 2**63 - 1


def _check_window(window_size, causal: bool, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
  """(left, right) as the kernels take them. A bound that reaches past the
  sequence (>= max(T, S): every query already sees every key on that side) is
  unbounded, -1, so that no range arithmetic meets a huge value; one that does
  not fit the kernels' int64 attribute is an error."""
  try:
    left, right = window_size
  except (TypeError, ValueError):
    raise ValueError(
        f"flash_attention: window_size must be a pair (left, right); got {window_size!r}"
    ) from None
  bounds = []
  for name, value in (("left", left), ("right", right)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < -1:
      raise ValueError(
          f"flash_attention: window_size {name} must be an int >= -1 (-1 = unbounded); got {value!r}"
      )
    if int(value) > _INT64_MAX:
      raise ValueError(f"flash_attention: window_size {name} must fit in int64 (use -1 for "
                       f"unbounded); got {value!r}")
    # A symbolic length (jax.export) cannot be compared: keep the bound.
    concrete = isinstance(seqlen_q, int) and isinstance(seqlen_k, int)
    bounded = not concrete or int(value) < max(seqlen_q, seqlen_k)
    bounds.append(int(value) if bounded else -1)
  left, right = bounds
  if causal:
    right = 0 if right < 0 else min(right, 0)
  return left, right


# The largest softcap: the scores are divided by it in float32, and a
# quotient below float32's smallest normal flushes to 0 (then tanh gives 0,
# not the score). Up to 2**103 that loses only scores below float32's eps
# (2**-23 = 2**103 * 2**-126), which change no exp(score); a larger cap would
# silently zero ordinary scores (softcap=1e38: |s| < 1.2 become 0).
_SOFTCAP_MAX = 2.0**103


def _check_softcap(softcap) -> float:
  value = _static_number("softcap", softcap)
  if not math.isfinite(value) or value < 0:
    raise ValueError(f"flash_attention: softcap must be finite and >= 0 (0 = off); got {softcap!r}")
  if value > 0:  # a cap that rounds to 0 in float32 would silently switch it off
    _float32_positive("softcap", value, softcap)
  if value > _SOFTCAP_MAX:
    raise ValueError(f"flash_attention: softcap must be at most 2**103 (about {_SOFTCAP_MAX:.3g}: "
                     "scores / softcap must stay a normal float32), or 0 for no cap; got "
                     f"{softcap!r}")
  return value


def check_dropout_rate(dropout_rate, caller: str = "flash_attention") -> float:
  """A static rate in [0, 1) as a float32 (0 = off)."""
  rate = _static_number("dropout_rate", dropout_rate)
  # The float32 rounding decides: 0.99999999 rounds to 1.0, which would drop all.
  if not math.isfinite(rate) or not 0.0 <= rate or not np.float32(rate) < 1.0:
    raise ValueError(f"{caller}: dropout_rate must be in [0, 1) (0 = off); got {dropout_rate!r}")
  return rate


def _check_max_segment_length(max_segment_length, segment_ids) -> int:
  """A static int >= 1 (0 in the config when None), only with segment ids."""
  if max_segment_length is None:
    return 0
  if not isinstance(max_segment_length, (int, np.integer)) or isinstance(max_segment_length, bool):
    raise TypeError("flash_attention: max_segment_length must be a static Python int or None; "
                    f"got {max_segment_length!r}")
  if max_segment_length < 1:
    raise ValueError(f"flash_attention: max_segment_length must be >= 1 (or None); got "
                     f"{max_segment_length!r}")
  if segment_ids is None:
    raise ValueError("flash_attention: max_segment_length bounds the segments' lengths, so it "
                     "needs segment_ids; got segment_ids=None")
  return int(max_segment_length)


def _check_dropout(dropout_rate, dropout_rng) -> float:
  """The rate the kernels and the reference both apply: a multiple of 1/256
  (_scores.applied_dropout_rate), exact in float32."""
  rate = check_dropout_rate(dropout_rate)
  if dropout_rng is not None:
    if not hasattr(dropout_rng, "dtype") or not hasattr(dropout_rng, "shape"):
      raise TypeError("flash_attention: dropout_rng must be a jax PRNG key (jax.random.key) or a "
                      f"raw uint32 key (jax.random.PRNGKey); got {type(dropout_rng).__name__}")
    typed = jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
    # A raw key must have the default PRNG implementation's key shape ((2,) for
    # threefry), or jax.random fails later without naming the argument.
    raw_shape = jax.random.key_data(jax.random.key(0)).shape
    if not (typed and dropout_rng.shape == ()) and not (
        dropout_rng.dtype == jnp.uint32 and tuple(dropout_rng.shape) == raw_shape):
      raise ValueError("flash_attention: dropout_rng must be one jax PRNG key (jax.random.key) "
                       f"or one raw uint32{list(raw_shape)} key (jax.random.PRNGKey); got "
                       f"{dropout_rng.dtype}{list(dropout_rng.shape)}")
  elif rate > 0:
    raise ValueError(f"flash_attention: dropout_rate={dropout_rate} needs dropout_rng, a jax PRNG "
                     "key (jax.random.key); got None")
  return _scores.applied_dropout_rate(rate)


def _check_alibi_slopes(alibi_slopes, batch: int, num_heads: int) -> None:
  if alibi_slopes is None:
    return
  if not hasattr(alibi_slopes, "shape") or not hasattr(alibi_slopes, "dtype"):
    raise TypeError("flash_attention: alibi_slopes must be an array (float32 [H] or [B, H]) or "
                    f"None; got {type(alibi_slopes).__name__}")
  if alibi_slopes.dtype != jnp.float32:
    raise TypeError(f"flash_attention: alibi_slopes.dtype must be float32; got {alibi_slopes.dtype}")
  if tuple(alibi_slopes.shape) not in ((num_heads,), (batch, num_heads)):
    raise shape_error("alibi_slopes.shape", tuple(alibi_slopes.shape),
                       f"must be [H] = ({num_heads},) or [B, H] = ({batch}, {num_heads})")
  # A NaN or inf slope would silently zero the head.
  _require_finite("alibi_slopes", alibi_slopes)


def _is_concrete(array) -> bool:
  """Whether the values are known at trace time: not traced, and not abstract
  (a jax.ShapeDtypeStruct, as jax_flash2.plan takes)."""
  return not isinstance(array, jax.core.Tracer) and isinstance(array, (jax.Array, np.ndarray))


def _require_finite(name: str, array) -> None:
  """Concrete values must be finite; traced (or abstract) ones are trusted."""
  if not _is_concrete(array):
    return
  values = np.asarray(array)
  if not np.all(np.isfinite(values)):
    raise ValueError(f"flash_attention: {name} must be finite; got "
                     f"{values.tolist() if values.size <= 16 else 'non-finite values'}")


def check_sinks(sinks, num_heads: int, dtype) -> None:
  """sinks: None or float32 [H] (float64 too for float64 inputs, the
  reference's oracle mode); concrete values must be finite (a NaN or inf sink
  would silently empty or NaN its head), traced ones are trusted."""
  if sinks is None:
    return
  if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
    raise TypeError("flash_attention: sinks must be a float32 [H] array or None; got "
                    f"{type(sinks).__name__}")
  allowed = (jnp.float32, jnp.float64) if jnp.dtype(dtype) == jnp.float64 else (jnp.float32,)
  if sinks.dtype not in allowed:
    raise TypeError(f"flash_attention: sinks.dtype must be float32; got {sinks.dtype}")
  if tuple(sinks.shape) != (num_heads,):
    raise shape_error("sinks.shape", tuple(sinks.shape),
                       f"must be [H] = ({num_heads},), one logit per query head")
  _require_finite("sinks", sinks)


def _check_segment_ids(segment_ids, batch: int, seqlen_q: int, seqlen_k: int) -> None:
  if segment_ids is None:
    return
  if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
    raise ValueError("flash_attention: segment_ids must be a pair (q_segment_ids, kv_segment_ids) "
                     f"of int32 [B, T] and [B, S] arrays, or None; got {type(segment_ids).__name__}")
  for name, ids, length, letter in (("q_segment_ids", segment_ids[0], seqlen_q, "T"),
                                    ("kv_segment_ids", segment_ids[1], seqlen_k, "S")):
    if not hasattr(ids, "shape") or not hasattr(ids, "dtype"):
      raise TypeError(f"flash_attention: segment_ids {name} must be an integer array; "
                      f"got {type(ids).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"flash_attention: segment_ids {name}.dtype must be an integer type "
                      f"(int32); got {ids.dtype}")
    if tuple(ids.shape) != (batch, length):
      raise shape_error(f"segment_ids {name}.shape", tuple(ids.shape),
                         f"must be [B, {letter}] = ({batch}, {length})")
    # The ids are cast to int32. Concrete ids must fit (2**32 would become 0
    # and match id 0); traced ids of a wider type wrap unchecked.
    info = np.iinfo(np.int32)
    if (_is_concrete(ids) and np.dtype(ids.dtype).itemsize >= 4
        and np.dtype(ids.dtype) != np.int32 and ids.size):
      values = np.asarray(ids)
      if values.min() < info.min or values.max() > info.max:
        raise ValueError(f"flash_attention: segment_ids {name} must fit in int32 "
                         f"([{info.min}, {info.max}]); got values in "
                         f"[{values.min()}, {values.max()}]")


def extra_operands(q, k, alibi_slopes=None, segment_ids=None, dropout_rng=None,
                   dropout_rate=0.0) -> ExtraOperands:
  """The ExtraOperands of a call, always present so that the primitives have
  one signature. Absent options become zeros that the kernels never read (the
  config's has_alibi / has_segment_ids are False, its dropout_rate is 0).

  The seeds are drawn from dropout_rng, one 64-bit seed per (batch, head):
  the dropout mask is a function of them and the position only, so it is the
  same on every backend, and vmap and sharding slice the seeds with B.
  """
  batch, seqlen_q, num_heads = q.shape[:3]
  seqlen_k = k.shape[1]
  if alibi_slopes is None:
    slopes = jnp.zeros((batch, num_heads), jnp.float32)
  else:
    slopes = jnp.broadcast_to(jnp.asarray(alibi_slopes, jnp.float32), (batch, num_heads))
  if segment_ids is None:
    q_ids = jnp.zeros((batch, seqlen_q), jnp.int32)
    kv_ids = jnp.zeros((batch, seqlen_k), jnp.int32)
  else:
    q_ids, kv_ids = (jnp.asarray(x).astype(jnp.int32) for x in segment_ids)
  if dropout_rate > 0:
    seeds = jax.random.bits(dropout_rng, (batch, num_heads, 2), jnp.uint32)
  else:
    seeds = jnp.zeros((batch, num_heads, 2), jnp.uint32)
  # The KV-cache operands only jax_flash2.kvcache sets (with _replace).
  return ExtraOperands(alibi_slopes=slopes, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                       dropout_seeds=seeds, kv_seqlens=jnp.zeros((batch,), jnp.int32),
                       block_table=jnp.zeros((batch, 1), jnp.int32),
                       kv_scales=jnp.zeros((batch, 2, 1, k.shape[2]), jnp.float32))


def make_config(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, segment_ids=None, deterministic=False,
                dropout_rate=0.0, dropout_rng=None, implementation=None, sinks=None,
                max_segment_length=None, dtypes=SUPPORTED_DTYPES) -> AttentionConfig:
  """Checks the arguments of flash_attention and returns its static config.

  sinks is checked but not part of the config: the kernels never see it (it
  rescales their results, _scores.add_sinks)."""
  _check_arrays(q, k, v, dtypes)
  _check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2])
  check_sinks(sinks, q.shape[2], q.dtype)
  _check_segment_ids(segment_ids, q.shape[0], q.shape[1], k.shape[1])
  check_bool("causal", causal)
  check_bool("deterministic", deterministic)
  if implementation is None:
    implementation = "kernel"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"flash_attention: implementation must be one of {IMPLEMENTATIONS} or None; got {implementation!r}"
    )
  left, right = _check_window(window_size, bool(causal), q.shape[1], k.shape[1])
  return AttentionConfig(
      softmax_scale=_check_scale(softmax_scale, q.shape[3]),
      window_left=left,
      window_right=right,
      softcap=_check_softcap(softcap),
      has_alibi=alibi_slopes is not None,
      has_segment_ids=segment_ids is not None,
      max_segment_length=_check_max_segment_length(max_segment_length, segment_ids),
      deterministic=bool(deterministic),
      dropout_rate=_check_dropout(dropout_rate, dropout_rng),
      implementation=implementation,
  )
