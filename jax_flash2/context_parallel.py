"""Context parallelism: exact attention over a sequence split across devices.

`ring_attention` runs inside `jax.shard_map`. Each of the n devices of mesh
axis `axis_name` holds its shard of the sequence: q [B, T/n, H, D],
k, v [B, S/n, K, D] (shape letters as in jax_flash2.api); the result is its
shard of the exact attention over the whole sequence.

Layouts (how the sequence is cut):
  * "contiguous": device r holds positions [r T/n, (r + 1) T/n).
  * "zigzag": the sequence is cut into 2n equal chunks and device r holds
    chunks r and 2n - 1 - r (`to_zigzag` / `from_zigzag` permute a full
    sequence, its positions or segment ids, into and out of that order).

Balance under causal attention, in units of one (T/n x T/n) block product:
with "contiguous", device r computes r full blocks and one half (diagonal)
block, r + 1/2 in all, from 1/2 on device 0 to n - 1/2 on device n - 1; the
mean is n/2, the busiest device does (2n - 1)/n (about 2x) the mean, and as
every ring step waits for its slowest device (at step s >= 1 devices r >= s
compute a full block, the others idle) the ring takes n - 1/2 block times for
n/2 of useful work per device: about 50% utilization. With "zigzag" every
device computes half a block per step (two of its four chunk pairs; at step
0 two halves and one full chunk pair), n/2 blocks in all: balanced.

Strategies (how K/V reach the queries):
  * "ring": K/V blocks travel around the ring with jax.lax.ppermute, one hop
    per step; each device holds two K/V blocks at a time (memory O(S/n)).
    The hop of the next block is issued before the current block's kernels
    so that XLA can overlap them.
  * "allgather": K/V are all-gathered once (memory O(S) for K/V, cheap with
    GQA: K << H) and the local queries are computed against them; the
    backward reduce-scatters dK/dV.

Per step the local queries meet one visiting K/V block. Which part of the
pair is visible is static once we know whether the visiting block comes
from before or after the local one (the traced device index only picks
between two static plans with lax.cond): a pair is skipped, fully visible, or
cut by the causal/window diagonal, in which case the kernels run on the
tight bounding box of the visible part with the window that reproduces the
global mask there. Block results (out_i, lse_i) are merged into a running
(out, lse) in float32 (logsumexp merge, safe for -inf rows).

Backward (a custom_vjp): from the global out and LSE the backward kernel of
each block pair gives exact dq, dk, dv contributions (P = exp(s - lse_global),
D = rowsum(dO * O) - dLSE are those of the whole row); dK/dV accumulators
(float32) travel with their K/V blocks and are sent home at the end.

A window stops the ring early: steps whose block pairs are all outside the
window are not computed, and the hops between the remaining steps are fused
into one ppermute each.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import sys
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flash2 import _scores, _sharding, api

try:
  shard_map = jax.shard_map
except AttributeError:  # jax < 0.7
  from jax.experimental.shard_map import shard_map  # type: ignore[no-redef]

LAYOUTS = ("contiguous", "zigzag")
STRATEGIES = ("ring", "allgather")
_INF = math.inf


# Layout helpers.


def _zigzag_order(n: int) -> list[int]:
  """Chunk indices in zigzag order: 0, 2n-1, 1, 2n-2, ..., n-1, n."""
  order = []
  for r in range(n):
    order += [r, 2 * n - 1 - r]
  return order


def _check_zigzag_args(x, n, axis, name):
  if not isinstance(n, int) or isinstance(n, bool) or n < 1:
    raise ValueError(f"{name}: n must be an int >= 1; got {n!r}")
  if not hasattr(x, "shape"):
    raise TypeError(f"{name}: x must be an array; got {type(x).__name__}")
  if (not isinstance(axis, numbers.Integral) or isinstance(axis, bool)
      or not -x.ndim <= axis < x.ndim):
    raise ValueError(f"{name}: axis must be an int in [-{x.ndim}, {x.ndim}) for x of shape "
                     f"{tuple(x.shape)}; got {axis!r}")
  axis = axis % x.ndim
  if x.shape[axis] % (2 * n):
    raise ValueError(f"{name}: x.shape[{axis}] = {x.shape[axis]} must be divisible by 2n = "
                     f"{2 * n} (2 chunks per device for n = {n} devices)")
  return axis


def to_zigzag(x, n: int, axis: int = 1):
  """Permutes a full sequence along `axis` into the zigzag layout for n
  devices: 2n equal chunks, ordered so that shard r of an even split holds
  chunks r and 2n - 1 - r. Apply it to q, k, v (or to the tokens), their
  positions and segment ids alike."""
  axis = _check_zigzag_args(x, n, axis, "to_zigzag")
  chunks = jnp.split(x, 2 * n, axis=axis)
  return jnp.concatenate([chunks[i] for i in _zigzag_order(n)], axis=axis)


def from_zigzag(x, n: int, axis: int = 1):
  """The inverse of `to_zigzag`."""
  axis = _check_zigzag_args(x, n, axis, "from_zigzag")
  chunks = jnp.split(x, 2 * n, axis=axis)
  inverse = [0] * (2 * n)
  for position, chunk in enumerate(_zigzag_order(n)):
    inverse[chunk] = position
  return jnp.concatenate([chunks[inverse[i]] for i in range(2 * n)], axis=axis)


# Static plans: which part of a (local queries, visiting K/V) pair is visible.


@dataclasses.dataclass(frozen=True)
class RingConfig:
  """Everything static about a call; the custom_vjp's non-differentiable argument."""

  axis_name: Any
  num_devices: int
  layout: str
  strategy: str
  causal: bool
  softmax_scale: float
  window_left: int
  window_right: int
  softcap: float


@dataclasses.dataclass(frozen=True)
class Pair:
  """Query rows [q0, q1) of the local shard against rows [k0, k1) of the
  visiting K/V block, with the flash_attention window (bottom-right aligned
  within the box) that reproduces the global mask there."""

  q0: int
  q1: int
  k0: int
  k1: int
  window: tuple[int, int]


def block_pair(q_start: int, q_len: int, k_start: int, k_len: int, delta: float,
               left: int, right: int) -> Pair | None:
  """The visible box of a block pair, or None when nothing is visible.

  Query i (0 <= i < q_len) sees key j (0 <= j < k_len) iff
  i + delta - left <= j <= i + delta + right (left/right -1 = unbounded):
  delta is the global position of query row 0 minus that of key row 0.
  The box is tight (its first and last rows and columns see something), which
  makes the window inside it expressible with left, right >= 0 or -1.
  """
  lo = -_INF if left < 0 else delta - left  # j - i >= lo
  hi = _INF if right < 0 else delta + right  # j - i <= hi
  i0 = 0 if hi == _INF else max(0, -hi)
  i1 = q_len - 1 if lo == -_INF else min(q_len - 1, k_len - 1 - lo)
  if i0 > i1:
    return None
  j0 = 0 if lo == -_INF else max(0, i0 + lo)
  j1 = k_len - 1 if hi == _INF else min(k_len - 1, i1 + hi)
  if j0 > j1:
    return None
  i0, i1, j0, j1 = int(i0), int(i1), int(j0), int(j1)
  tq, sk = i1 - i0 + 1, j1 - j0 + 1
  lo, hi = lo + i0 - j0, hi + i0 - j0  # within the box
  # flash_attention's window: j >= i + (sk - tq) - l and j <= i + (sk - tq) + r.
  win_left = -1 if lo <= -(tq - 1) else int(sk - tq - lo)
  win_right = -1 if hi >= sk - 1 else int(hi - (sk - tq))
  assert win_left >= -1 and win_right >= -1, (q_len, k_len, delta, left, right)
  return Pair(q_start + i0, q_start + i1 + 1, k_start + j0, k_start + j1 + 1,
              (win_left, win_right))


def _fuse_full(pairs: list[Pair]) -> list[Pair]:
  """Adjacent fully visible pairs sharing their rows or their columns as one
  kernel call."""
  out: list[Pair] = []
  for p in pairs:
    last = out[-1] if out else None
    if last is not None and last.window == p.window == (-1, -1):
      if (last.k0, last.k1) == (p.k0, p.k1) and last.q1 == p.q0:
        out[-1] = Pair(last.q0, p.q1, p.k0, p.k1, p.window)
        continue
      if (last.q0, last.q1) == (p.q0, p.q1) and last.k1 == p.k0:
        out[-1] = Pair(p.q0, p.q1, last.k0, p.k1, p.window)
        continue
    out.append(p)
  return out


def step_pairs(cfg: RingConfig, q_len: int, k_len: int, step: int,
               wrapped: bool) -> tuple[Pair, ...]:
  """The visible pairs at ring step `step`, where the visiting K/V block is
  that of device src = r - step (mod n): `wrapped` says src > r (src = r -
  step + n), which the traced device index decides."""
  n, left, right = cfg.num_devices, cfg.window_left, cfg.window_right
  if cfg.layout == "contiguous":
    blocks = step - n if wrapped else step
    pairs = [block_pair(0, q_len, 0, k_len, blocks * q_len, left, right)]
  else:
    # Query chunks r, 2n-1-r at rows 0 and c; key chunks src, 2n-1-src at 0
    # and c. Two of the four chunk distances depend on r itself; their sign
    # does not, which is all causal (or unmasked) attention needs: there a
    # key chunk wholly before the query chunk is fully visible and one wholly
    # after is visible only without causal (zigzag takes no window).
    c = q_len // 2
    after, before = -c, c
    if wrapped:  # src in (r, n)
      deltas = ((step - n) * c, after, before, (n - step) * c)
    else:  # src in [0, r]
      deltas = (step * c, after, before, -step * c)
    pairs = [block_pair(q0, c, k0, c, d, left, right)
             for (q0, k0), d in zip(((0, 0), (0, c), (c, 0), (c, c)), deltas)]
  return tuple(_fuse_full([p for p in pairs if p is not None]))


def ring_plan(cfg: RingConfig, q_len: int, k_len: int):
  """[(step, pairs if src <= r, pairs if src > r)] for the steps that compute
  anything; step 0 (the local block) always comes first."""
  plan = []
  for step in range(cfg.num_devices):
    own = step_pairs(cfg, q_len, k_len, step, wrapped=False)
    other = step_pairs(cfg, q_len, k_len, step, wrapped=True) if step else ()
    if step == 0 or own or other:
      plan.append((step, own, other))
  return plan


# Numerics.


def _merge(out, lse, block_out, block_lse):
  """The logsumexp merge of two partial results over disjoint key sets:
  out [B, R, H, D] float32, lse [B, H, R]; -inf rows (no key yet) are safe."""
  m = jnp.maximum(lse, block_lse)
  # A row that has seen no key on either side keeps lse -inf and out 0
  # (shifting by 0 there avoids -inf - -inf = NaN); NaN stays NaN.
  shift = jnp.where(m == -jnp.inf, 0.0, m)
  wa, wb = jnp.exp(lse - shift), jnp.exp(block_lse - shift)
  total = wa + wb
  new_lse = shift + jnp.log(total)
  scale = lambda w: jnp.swapaxes(w / jnp.where(total > 0, total, 1.0), 1, 2)[..., None]
  new_out = out * scale(wa) + block_out.astype(jnp.float32) * scale(wb)
  return new_out, new_lse


def _varying(x) -> frozenset:
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
  if mat is not None:
    return mat.varying
  return getattr(aval, "vma", frozenset())


def _vary_like(x, ref):
  """x typed as varying over the shard_map axes `ref` varies over (zeros made
  here are replicated, the loop carries must keep one type)."""
  missing = _varying(ref) - _varying(x)
  if not missing:
    return x
  return jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")


def _axis_names(axis_name) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _block_forward(cfg, q, k, v, q_ids, kv_ids, pair):
  ids = None if q_ids is None else (q_ids[:, pair.q0:pair.q1], kv_ids[:, pair.k0:pair.k1])
  return api.flash_attention(
      q[:, pair.q0:pair.q1], k[:, pair.k0:pair.k1], v[:, pair.k0:pair.k1],
      softmax_scale=cfg.softmax_scale, window_size=pair.window, softcap=cfg.softcap,
      segment_ids=ids, return_lse=True)


def _block_backward(cfg, q, k, v, out, lse, d_out, d_lse, q_ids, kv_ids, window):
  """(dq, dk, dv) of one block pair from the given (global) out and lse: the
  package's backward kernel entry. The only use of jax_flash2 internals here
  (beside the registration at the end)."""
  ids = None if q_ids is None else (q_ids, kv_ids)
  config = api.make_config(q, k, v, softmax_scale=cfg.softmax_scale, window_size=window,
                           softcap=cfg.softcap, segment_ids=ids)
  extras = api.extra_operands(q, k, segment_ids=ids)
  return _sharding.backward(q, k, v, out, lse, d_out, d_lse, extras, config)


def _update_rows(x, axis: int, start: int, update):
  """x with x[start:start + len] along axis replaced by update. Not
  x.at[...].set / add: inside shard_map their scatter's hoisted empty index
  operand crashes XLA:CPU's compile on jax 0.11 (Shardy's
  ManualComputationUnusedInputsPattern)."""
  return jax.lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), start, axis=axis)


def _forward_pairs(cfg, state, q, kv, pairs):
  out, lse = state
  k, v, kv_ids = kv
  q, q_ids = q
  for p in pairs:
    block_out, block_lse = _block_forward(cfg, q, k, v, q_ids, kv_ids, p)
    rows = slice(p.q0, p.q1)
    new_out, new_lse = _merge(out[:, rows], lse[:, :, rows], block_out, block_lse)
    out = _update_rows(out, 1, p.q0, new_out)
    lse = _update_rows(lse, 2, p.q0, new_lse)
  return out, lse


def _backward_pairs(cfg, state, res, kv, pairs):
  dq, dk, dv = state
  q, q_ids, out, lse, d_out, d_lse = res
  k, v, kv_ids = kv
  for p in pairs:
    rows, cols = slice(p.q0, p.q1), slice(p.k0, p.k1)
    gq, gk, gv = _block_backward(
        cfg, q[:, rows], k[:, cols], v[:, cols], out[:, rows], lse[:, :, rows],
        d_out[:, rows], d_lse[:, :, rows], None if q_ids is None else q_ids[:, rows],
        None if kv_ids is None else kv_ids[:, cols], p.window)
    dq = _update_rows(dq, 1, p.q0, dq[:, rows] + gq.astype(jnp.float32))
    dk = _update_rows(dk, 1, p.k0, dk[:, cols] + gk.astype(jnp.float32))
    dv = _update_rows(dv, 1, p.k0, dv[:, cols] + gv.astype(jnp.float32))
  return dq, dk, dv


def _run_step(fn, cfg, state, fixed, kv, step, own, other, index):
  """fn over the pairs of this step: `own` where the visiting block comes
  from src <= r, `other` where src > r (a lax.cond on the device index r;
  a case with no pairs costs nothing). At step 0 src is r itself."""
  if step == 0:
    return fn(cfg, state, fixed, kv, own)
  wrapped = index < step
  run_own = lambda s: fn(cfg, s, fixed, kv, own) if own else s
  run_other = lambda s: fn(cfg, s, fixed, kv, other) if other else s
  return jax.lax.cond(wrapped, run_other, run_own, state)


def _hop(tree, axis_name, n, shift):
  """Sends every device's blocks `shift` devices up the ring (r -> r + shift)."""
  perm = [(i, (i + shift) % n) for i in range(n)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


class _Source:
  """Where a step's visiting K/V block comes from: the ring (ppermute hops) or
  the all-gathered K/V (a dynamic slice)."""

  def __init__(self, cfg, kv, index):
    self.cfg, self.index, self.n = cfg, index, cfg.num_devices
    if cfg.strategy == "allgather":
      axes = cfg.axis_name
      self.gathered = jax.tree.map(
          lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True), kv)
      self.length = kv[0].shape[1]

  def block(self, step, current):
    """The block of device (r - step) mod n; `current` is the ring's block."""
    if self.cfg.strategy == "ring":
      return current
    src = (self.index - step) % self.n
    return jax.tree.map(
        lambda x: jax.lax.dynamic_slice_in_dim(x, src * self.length, self.length, axis=1),
        self.gathered)


def _unmasked_allgather(cfg) -> bool:
  """No causal or window mask over gathered K/V: every block is fully visible,
  so one kernel call over the whole sequence replaces the n block calls."""
  return cfg.strategy == "allgather" and cfg.window_left < 0 and cfg.window_right < 0


def _ring_forward(cfg, q, k, v, q_ids, kv_ids):
  n = cfg.num_devices
  index = jax.lax.axis_index(cfg.axis_name)
  plan = ring_plan(cfg, q.shape[1], k.shape[1])
  batch, q_len, heads, _ = q.shape
  out = _vary_like(jnp.zeros(q.shape, jnp.float32), q)
  lse = _vary_like(jnp.full((batch, heads, q_len), -jnp.inf, jnp.float32), q)
  kv = (k, v, kv_ids)
  source = _Source(cfg, kv, index)
  if _unmasked_allgather(cfg):
    out, lse = _forward_pairs(cfg, (out, lse), (q, q_ids), source.gathered,
                              [Pair(0, q_len, 0, n * k.shape[1], (-1, -1))])
    return out.astype(q.dtype), lse
  current = kv
  for i, (step, own, other) in enumerate(plan):
    # Issue the hop to the next computed step before this step's kernels.
    if cfg.strategy == "ring" and i + 1 < len(plan):
      upcoming = _hop(current, cfg.axis_name, n, plan[i + 1][0] - step)
    block = source.block(step, current)
    out, lse = _run_step(_forward_pairs, cfg, (out, lse), (q, q_ids), block, step, own, other,
                         index)
    if cfg.strategy == "ring" and i + 1 < len(plan):
      current = upcoming
  return out.astype(q.dtype), lse


def _ring_backward(cfg, res, cotangents):
  q, k, v, q_ids, kv_ids, out, lse = res
  d_out, d_lse = cotangents
  n = cfg.num_devices
  index = jax.lax.axis_index(cfg.axis_name)
  plan = ring_plan(cfg, q.shape[1], k.shape[1])
  d_out = _vary_like(d_out.astype(out.dtype), q)
  d_lse = _vary_like(d_lse.astype(jnp.float32), q)
  fixed = (q, q_ids, out, lse, d_out, d_lse)
  dq = _vary_like(jnp.zeros(q.shape, jnp.float32), q)
  kv = (k, v, kv_ids)
  if cfg.strategy == "allgather":
    source = _Source(cfg, kv, index)
    length = k.shape[1]
    full = source.gathered[0].shape
    dk = _vary_like(jnp.zeros(full, jnp.float32), q)
    dv = _vary_like(jnp.zeros(full, jnp.float32), q)
    if _unmasked_allgather(cfg):
      plan = []  # one call against the whole gathered K/V
      dq, dk, dv = _backward_pairs(cfg, (dq, dk, dv), fixed, source.gathered,
                                   [Pair(0, q.shape[1], 0, full[1], (-1, -1))])
    for step, own, other in plan:
      block = source.block(step, None)
      src = (index - step) % n
      blk_dk = jax.lax.dynamic_slice_in_dim(dk, src * length, length, axis=1)
      blk_dv = jax.lax.dynamic_slice_in_dim(dv, src * length, length, axis=1)
      dq, blk_dk, blk_dv = _run_step(_backward_pairs, cfg, (dq, blk_dk, blk_dv), fixed, block,
                                     step, own, other, index)
      dk = jax.lax.dynamic_update_slice_in_dim(dk, blk_dk, src * length, axis=1)
      dv = jax.lax.dynamic_update_slice_in_dim(dv, blk_dv, src * length, axis=1)
    # The transpose of the all-gather: each device's own block, summed.
    dk = jax.lax.psum_scatter(dk, cfg.axis_name, scatter_dimension=1, tiled=True)
    dv = jax.lax.psum_scatter(dv, cfg.axis_name, scatter_dimension=1, tiled=True)
  else:
    # K and V travel as one [2, B, S/n, K, D] message, and so do the dK, dV
    # accumulators. Packed, the backward's K/V hops also differ from the
    # forward's: XLA would merge equal collective-permutes of the two passes
    # and keep every visiting block alive from the forward to the backward
    # (O(S), not O(S/n), per device).
    grads = _vary_like(jnp.zeros((2,) + k.shape, jnp.float32), q)
    current = (jnp.stack([k, v]), None if kv_ids is None else kv_ids[None])
    for i, (step, own, other) in enumerate(plan):
      last = i + 1 == len(plan)
      if not last:
        upcoming = _hop(current, cfg.axis_name, n, plan[i + 1][0] - step)
      packed, ids = current
      block = (packed[0], packed[1], None if ids is None else ids[0])
      dq, dk, dv = _run_step(_backward_pairs, cfg, (dq, grads[0], grads[1]), fixed, block, step,
                             own, other, index)
      grads = jnp.stack([dk, dv])
      # The accumulators travel with their block; after the last step they
      # are sent straight home (the block of device j is then at j + step).
      shift = -step if last else plan[i + 1][0] - step
      if shift % n:
        grads = _hop(grads, cfg.axis_name, n, shift)
      if not last:
        current = upcoming
    dk, dv = grads[0], grads[1]
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, q_ids, kv_ids):
  return _ring_forward(cfg, q, k, v, q_ids, kv_ids)


def _ring_fwd(cfg, q, k, v, q_ids, kv_ids):
  out, lse = _ring_forward(cfg, q, k, v, q_ids, kv_ids)
  return (out, lse), (q, k, v, q_ids, kv_ids, out, lse)


def _ring_bwd(cfg, res, cotangents):
  dq, dk, dv = _ring_backward(cfg, res, cotangents)
  return dq, dk, dv, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


# Public entry points.


def _check_window(window_size, causal) -> tuple[int, int]:
  if not isinstance(causal, bool):
    raise TypeError(f"ring_attention: causal must be a bool; got {causal!r}")
  try:
    left, right = window_size
  except (TypeError, ValueError):
    raise ValueError(
        f"ring_attention: window_size must be a pair (left, right); got {window_size!r}") from None
  for name, value in (("left", left), ("right", right)):
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < -1:
      raise ValueError(f"ring_attention: window_size {name} must be an int >= -1 "
                       f"(-1 = unbounded); got {value!r}")
  if causal:
    right = 0 if right < 0 else min(right, 0)
  return int(left), int(right)


def _axis_size(axis_name) -> int:
  try:
    return int(jax.lax.axis_size(axis_name))
  except NameError as e:
    raise ValueError(
        f"ring_attention: axis_name {axis_name!r} is not a bound mesh axis; call ring_attention "
        "inside jax.shard_map over a mesh with that axis (or use "
        "context_parallel_attention)") from e


def ring_attention(q, k, v, *, axis_name, causal: bool = False, layout: str = "contiguous",
                   strategy: str = "ring", softmax_scale: float | None = None,
                   window_size: tuple[int, int] = (-1, -1), segment_ids=None,
                   softcap: float = 0.0, sinks=None, return_lse: bool = False):
  """Exact attention over a sequence split along mesh axis `axis_name`; call
  it inside jax.shard_map.

  Args:
    q: this device's shard [B, T/n, H, D] of the queries; k, v: its shards
      [B, S/n, K, D] (n = the size of `axis_name`). GQA/MQA: only the K heads
      travel.
    axis_name: the mesh axis (or tuple of axes) the sequence is split over.
    causal, softmax_scale, window_size, softcap: as flash_attention, over the
      global positions. causal and window_size need T == S.
    layout: "contiguous" (device r holds the r-th of n equal parts) or
      "zigzag" (device r holds chunks r and 2n-1-r of 2n equal parts; see
      to_zigzag). zigzag takes no window_size.
    strategy: "ring" (K/V blocks passed around with ppermute) or
      "allgather" (K/V gathered once).
    segment_ids: None or (q_segment_ids [B, T/n], kv_segment_ids [B, S/n]),
      this device's shards (in the same layout as q, k); the kv ids travel
      with K/V, so packed documents may span devices.
    sinks: None or float32 [H], as flash_attention (replicated): joined once,
      to the merged (out, lse), not per ring step; its gradient is summed
      over the devices.
    return_lse: also return this device's shard of the LSE, [B, H, T/n]
      float32.

  Returns:
    out [B, T/n, H, D] (and lse). Differentiable in q, k, v by jax.grad
    (a custom_vjp: forward-mode AD, jax.jvp, is not supported); works under
    jax.checkpoint, vmap of leading batch axes and jax.export.

  The steps are unrolled (n of them at most, fewer with a window): each is
  one or a few kernel calls of static shape, and XLA sees every hop beside
  the kernels it can overlap with. Per device the ring holds two K/V blocks
  and, in the backward, a packed dK/dV accumulator in float32.
  """
  api.check_bool("return_lse", return_lse)
  ids = None if segment_ids is None else tuple(segment_ids) if isinstance(
      segment_ids, (tuple, list)) else segment_ids
  # Arrays, ids, scale and softcap are checked as flash_attention checks them;
  # the window is over global positions, so it is checked here (the shards'
  # lengths say nothing about which bounds are unbounded).
  config = api.make_config(q, k, v, softmax_scale=softmax_scale, softcap=softcap,
                           segment_ids=ids, sinks=sinks)
  left, right = _check_window(window_size, causal)
  if layout not in LAYOUTS:
    raise ValueError(f"ring_attention: layout must be one of {LAYOUTS}; got {layout!r}")
  if strategy not in STRATEGIES:
    raise ValueError(f"ring_attention: strategy must be one of {STRATEGIES}; got {strategy!r}")
  n = _axis_size(axis_name)
  q_len, k_len = q.shape[1], k.shape[1]
  positional = left >= 0 or right >= 0
  if positional and q_len != k_len:
    raise ValueError(
        "ring_attention: causal and window_size need equal query and key shards (T == S); got "
        f"q.shape[1] = {q_len}, k.shape[1] = {k_len}")
  if layout == "zigzag":
    if q_len % 2 or k_len % 2:
      raise ValueError(
          f"ring_attention: layout='zigzag' needs T and S divisible by 2n = {2 * n}, i.e. even "
          f"shards; got shards of T/n = {q_len}, S/n = {k_len} rows")
    if left >= 0 or right > 0:
      raise NotImplementedError(
          f"ring_attention: layout='zigzag' with window_size={tuple(window_size)} is not "
          "implemented; a window balances the 'contiguous' layout already, use that")
  cfg = RingConfig(axis_name=tuple(axis_name) if isinstance(axis_name, list) else axis_name,
                   num_devices=n, layout=layout, strategy=strategy, causal=bool(causal),
                   softmax_scale=config.softmax_scale, window_left=left, window_right=right,
                   softcap=config.softcap)
  q_ids = kv_ids = None
  if ids is not None:
    q_ids, kv_ids = (_vary_like(jnp.asarray(x).astype(jnp.int32), q) for x in ids)
  out, lse = _ring(cfg, q, k, v, q_ids, kv_ids)
  if sinks is not None:
    # Replicated sinks against varying rows: the transpose of the cast sums
    # the sinks' cotangent over the devices.
    out, lse = _scores.add_sinks(out, lse, _vary_like(jnp.asarray(sinks), q))
  return (out, lse) if return_lse else out


def context_parallel_attention(q, k, v, *, mesh, axis_name, batch_axis=None, segment_ids=None,
                               return_lse=False, **kwargs):
  """ring_attention on global arrays: q [B, T, H, D], k, v [B, S, K, D] (and
  segment ids [B, T], [B, S]) split along T/S over mesh axis `axis_name` (and
  along B over `batch_axis`, if given) with jax.shard_map. The arrays are in
  the layout's order (for "zigzag", as to_zigzag leaves them). Other keyword
  arguments: as ring_attention."""
  names = _axis_names(axis_name)
  for argument, axes in (("axis_name", names),
                         ("batch_axis", () if batch_axis is None else _axis_names(batch_axis))):
    for name in axes:
      if name not in mesh.shape:
        raise ValueError(f"context_parallel_attention: {argument} {name!r} is not an axis of the "
                         f"mesh {dict(mesh.shape)}")
  if segment_ids is not None and (not isinstance(segment_ids, (tuple, list))
                                  or len(segment_ids) != 2):
    raise ValueError("context_parallel_attention: segment_ids must be a pair (q_segment_ids "
                     f"[B, T], kv_segment_ids [B, S]) or None; got {type(segment_ids).__name__}")
  n = math.prod(mesh.shape[a] for a in names)
  parts = 2 * n if kwargs.get("layout", "contiguous") == "zigzag" else n
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "ndim") or x.ndim != 4:
      raise ValueError(f"context_parallel_attention: {name} must be rank 4 [B, T|S, H|K, D]; got "
                       f"{getattr(x, 'shape', type(x).__name__)}")
    if x.shape[1] % parts:
      what = f"2n = {parts}" if parts != n else f"n = {n}"
      raise ValueError(
          f"context_parallel_attention: {name}.shape[1] = {x.shape[1]} must be divisible by "
          f"{what} (the devices of mesh axis {axis_name!r}"
          f"{', 2 chunks each for layout=zigzag' if parts != n else ''})")
  if batch_axis is not None:
    batch = math.prod(mesh.shape[a] for a in _axis_names(batch_axis))
    if q.shape[0] % batch:
      raise ValueError(f"context_parallel_attention: B = {q.shape[0]} must be divisible by the "
                       f"{batch} devices of batch_axis {batch_axis!r}")
  seq = axis_name if len(names) > 1 else names[0]
  x_spec, ids_spec, lse_spec = P(batch_axis, seq, None, None), P(batch_axis, seq), P(
      batch_axis, None, seq)

  def local(q, k, v, ids):
    return ring_attention(q, k, v, axis_name=axis_name, segment_ids=ids, return_lse=True,
                          **kwargs)

  ids = None if segment_ids is None else tuple(segment_ids)
  ids_specs = None if ids is None else (ids_spec, ids_spec)
  if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
    # Explicit axes: shard_map takes the operands only as their types say.
    q, k, v = (jax.reshard(x, NamedSharding(mesh, x_spec)) for x in (q, k, v))
    if ids is not None:
      ids = tuple(jax.reshard(x, NamedSharding(mesh, ids_spec)) for x in ids)
  out, lse = shard_map(local, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, ids_specs),
                       out_specs=(x_spec, lse_spec))(q, k, v, ids)
  return (out, lse) if return_lse else out


# Sequence-sharded operands under plain jax.jit: jax_flash2._sharding's
# custom partitioning calls these when q's T and k's S are split over the same
# mesh axes, instead of gathering q, k and v.


def sequence_config(config, mesh, seq_axes: tuple, q_shape, k_shape) -> RingConfig | None:
  """The ring for a flash call (its AttentionConfig `config`) on q [*L, T, H, D],
  k [*L, S, K, D] whose T and S are split over mesh axes `seq_axes`; None when
  the ring cannot serve it (then the caller gathers T and S as before)."""
  if not seq_axes:
    return None
  n = math.prod(mesh.shape[a] for a in seq_axes)
  positional = config.window_left >= 0 or config.window_right >= 0
  if (n < 2 or q_shape[-3] % n or k_shape[-3] % n or config.has_alibi
      or config.dropout_rate > 0 or (positional and q_shape[-3] != k_shape[-3])):
    return None
  heads, kv_heads = q_shape[-2], k_shape[-2]
  # All-gather K/V when they are a quarter of q's size or less (GQA, MQA):
  # one collective, no per-step hops; else the ring, O(S/n) memory.
  strategy = "allgather" if heads >= 4 * kv_heads else "ring"
  axis = seq_axes[0] if len(seq_axes) == 1 else tuple(seq_axes)
  return RingConfig(axis_name=axis, num_devices=n, layout="contiguous", strategy=strategy,
                    causal=config.window_right == 0, softmax_scale=config.softmax_scale,
                    window_left=config.window_left, window_right=config.window_right,
                    softcap=config.softcap)


def _merged(x, trailing):
  return x.reshape((-1,) + x.shape[x.ndim - trailing:])


def sequence_forward(cfg: RingConfig, config, q, k, v, extras):
  """(out, lse) on this device's sequence shards, leading axes [*L] kept."""
  lead = q.shape[:-3]
  q_ids = kv_ids = None
  if config.has_segment_ids:
    q_ids, kv_ids = _merged(extras.q_segment_ids, 1), _merged(extras.kv_segment_ids, 1)
  out, lse = _ring_forward(cfg, _merged(q, 3), _merged(k, 3), _merged(v, 3), q_ids, kv_ids)
  return out.reshape(lead + out.shape[1:]), lse.reshape(lead + lse.shape[1:])


def sequence_backward(cfg: RingConfig, config, q, k, v, out, lse, d_out, d_lse, extras):
  """(dq, dk, dv) on this device's sequence shards, leading axes [*L] kept."""
  lead = q.shape[:-3]
  q_ids = kv_ids = None
  if config.has_segment_ids:
    q_ids, kv_ids = _merged(extras.q_segment_ids, 1), _merged(extras.kv_segment_ids, 1)
  res = (_merged(q, 3), _merged(k, 3), _merged(v, 3), q_ids, kv_ids, _merged(out, 3),
         _merged(lse, 2))
  grads = _ring_backward(cfg, res, (_merged(d_out, 3), _merged(d_lse, 2)))
  return tuple(g.reshape(lead + g.shape[1:]) for g in grads)


# The custom partitioning of the kernels (jax_flash2._sharding) calls the
# functions above when it meets q, k, v split along the sequence under jit.
_sharding.sequence_parallel = sys.modules[__name__]
