"""Context-parallel checks: ring_attention against single-device flash_attention.

Run by tests/test_context_parallel.py in fresh processes (the device count is
fixed when jax initializes):

  PYTHONPATH=. python3 tests/cp_checks.py [--devices 8] [--json] [name ...]
  # one process of a multi-process run (2 processes x 4 CPU devices):
  PYTHONPATH=. python3 tests/cp_checks.py --devices 4 --num-processes 2 \\
      --process-id I --coordinator localhost:PORT --json

Each check prints one line (with --json, {"name", "ok", "detail"}); a check
that raises is reported failed and the others still run. With several
processes only the checks marked for it run, on meshes spanning every
process's devices; inputs are made from the same seeds in every process and
results are gathered to each of them for the comparison.
"""

from __future__ import annotations

import argparse
import os


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("names", nargs="*")
  p.add_argument("--devices", type=int, default=8, help="CPU devices per process")
  p.add_argument("--num-processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--coordinator", default=None, help="host:port of process 0")
  p.add_argument("--json", action="store_true")
  return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else parse_args([])
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={ARGS.devices}")

import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

if ARGS.num_processes > 1:
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError):  # older jax: gloo is the default or absent
    pass
  jax.distributed.initialize(coordinator_address=ARGS.coordinator,
                             num_processes=ARGS.num_processes, process_id=ARGS.process_id)

import jax_flash2  # noqa: E402
from jax_flash2 import context_parallel as cp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

MULTI = ARGS.num_processes > 1
FWD_TOL = dict(atol=2e-5, rtol=2e-5)
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
CHECKS, MULTI_CHECKS = {}, set()


def check(multiprocess=False):
  def register(fn):
    CHECKS[fn.__name__] = fn
    if multiprocess:
      MULTI_CHECKS.add(fn.__name__)
    return fn
  return register


def seq_mesh(n, extra=None):
  """A mesh with a "seq" axis of n devices (and a "data" axis of `extra`),
  over the first devices; the axis order makes "seq" span processes."""
  auto = jax.sharding.AxisType.Auto
  if extra is None:
    return jax.make_mesh((n,), ("seq",), devices=jax.devices()[:n], axis_types=(auto,))
  devices = np.asarray(jax.devices()[:n * extra]).reshape(n, extra).T
  return jax.sharding.Mesh(devices, ("data", "seq"), axis_types=(auto, auto))


def put(x, mesh, spec):
  """A global array of the numpy value x with the given sharding (in every
  process: each contributes its addressable shards)."""
  sharding = NamedSharding(mesh, spec)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def fetch(x):
  """The whole value of a (possibly multi-process) global array."""
  if MULTI:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def inputs(b=1, t=128, h=4, kv=2, d=16, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((b, t, h, d), np.float32)
  k = rng.standard_normal((b, t, kv, d), np.float32)
  v = rng.standard_normal((b, t, kv, d), np.float32)
  w = rng.standard_normal((b, t, h, d), np.float32)  # output weights of the loss
  return q, k, v, w


def packed_ids(b, t, seed=1):
  """Segment ids of packed documents of random lengths (several span shards)."""
  rng = np.random.default_rng(seed)
  ids = np.zeros((b, t), np.int32)
  for row in ids:
    cuts = np.sort(rng.choice(np.arange(1, t), size=4, replace=False))
    row[:] = np.searchsorted(cuts, np.arange(t), side="right")
  return ids


def loss_of(fn, w, aux=False):
  def loss(q, k, v):
    out, lse = fn(q, k, v)
    # Both outputs enter the loss, so dLSE != 0 is exercised too.
    value = jnp.sum(out * w) + jnp.sum(jnp.sin(lse))
    return (value, (out, lse)) if aux else value
  return loss


def results(fn, w):
  """((out, lse), (dq, dk, dv)) of fn in one compiled program."""
  return jax.grad(loss_of(fn, w, aux=True), argnums=(0, 1, 2), has_aux=True)


def compare(n, *, layout="contiguous", strategy="ring", extra=None, seg=False, shape=None,
            **options):
  """ring_attention over n devices against flash_attention on one device:
  out, lse and the gradients of a loss of both."""
  b, t, h, kv, d = shape or ((extra or 1), 128, 4, 2, 16)
  q, k, v, w = inputs(b, t, h, kv, d)
  ids = packed_ids(b, t) if seg else None
  mesh = seq_mesh(n, extra)
  batch_axis = "data" if extra else None

  def reference(q, k, v):
    segment_ids = None if ids is None else (ids, ids)
    return jax_flash2.flash_attention(q, k, v, segment_ids=segment_ids, return_lse=True,
                                      **options)

  def perm(x, axis=1):
    return cp.to_zigzag(x, n, axis) if layout == "zigzag" else x

  def unperm(x, axis=1):
    return cp.from_zigzag(x, n, axis) if layout == "zigzag" else x

  # The layout is applied to the data, as a model would: permuted inputs in,
  # permuted outputs out.
  spec, ids_spec = P(batch_axis, "seq"), P(batch_axis, "seq")
  qs, ks, vs, ws = (put(np.asarray(perm(x)), mesh, spec) for x in (q, k, v, w))
  ids_s = None if ids is None else put(np.asarray(perm(ids)), mesh, ids_spec)

  # Global arrays are arguments, never closed over: a multi-process array
  # cannot become a constant of the program.
  def sharded(q, k, v, ids):
    segment_ids = None if ids is None else (ids, ids)
    return cp.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq",
                                         batch_axis=batch_axis, layout=layout,
                                         strategy=strategy, segment_ids=segment_ids,
                                         return_lse=True, **options)

  def sharded_results(q, k, v, w, ids):
    grads, outs = results(lambda q, k, v: sharded(q, k, v, ids), w)(q, k, v)
    return outs, grads

  (out, lse), grads = jax.jit(sharded_results)(qs, ks, vs, ws, ids_s)
  ref_grads, (ref_out, ref_lse) = jax.jit(results(reference, w))(q, k, v)
  np.testing.assert_allclose(unperm(fetch(out)), ref_out, **FWD_TOL)
  np.testing.assert_allclose(unperm(fetch(lse), 2), ref_lse, **FWD_TOL)
  for name, g, r in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(unperm(fetch(g)), r, err_msg=f"d{name}", **GRAD_TOL)
  err = float(np.max(np.abs(unperm(fetch(out)) - np.asarray(ref_out))))
  return f"n={n}: max |out - ref| {err:.1e}"


# Correctness against the single-device kernels.


@check(multiprocess=True)
def causal_contiguous():
  return "; ".join(compare(n, causal=True) for n in ((2, 4, 8) if not MULTI else (8,)))


@check(multiprocess=True)
def causal_zigzag():
  return "; ".join(compare(n, causal=True, layout="zigzag")
                   for n in ((2, 4, 8) if not MULTI else (8,)))


@check()
def full_attention():
  # Unmasked all-gather: one kernel call over the whole gathered K/V.
  return "; ".join([compare(4), compare(8, layout="zigzag"),
                    compare(4, strategy="allgather", seg=True),
                    compare(8, strategy="allgather", layout="zigzag", softcap=3.0)])


@check(multiprocess=True)
def allgather_strategy():
  if MULTI:
    return compare(8, causal=True, strategy="allgather", layout="zigzag")
  return "; ".join([compare(8, causal=True, strategy="allgather"),
                    compare(4, causal=True, strategy="allgather", layout="zigzag")])


@check()
def mha_and_mqa():
  return "; ".join([compare(4, causal=True, shape=(1, 64, 2, 2, 32)),
                    compare(4, causal=True, layout="zigzag", shape=(1, 64, 4, 1, 16))])


@check(multiprocess=True)
def segment_ids_across_devices():
  if MULTI:
    return compare(8, causal=True, seg=True, layout="zigzag")
  return "; ".join([compare(8, causal=True, seg=True),
                    compare(4, causal=True, seg=True, layout="zigzag")])


@check(multiprocess=True)
def window():
  # Causal window of 20 over shards of 16: the ring stops after two hops. A
  # two-sided window reaches blocks before and after; with the all-gather
  # strategy too.
  if MULTI:
    return compare(8, causal=True, window_size=(20, 0))
  return "; ".join([compare(8, causal=True, window_size=(20, 0)),
                    compare(8, window_size=(9, 21)),
                    compare(8, window_size=(5, 3), strategy="allgather")])


@check()
def softcap_and_scale():
  return compare(4, causal=True, layout="zigzag", softcap=2.0, softmax_scale=0.3)


@check()
def batch_and_sequence_mesh():
  """A (data, seq) mesh: batch over "data", sequence over "seq"."""
  return compare(4, causal=True, layout="zigzag", extra=2)


@check()
def vmap_and_checkpoint():
  n, (q, k, v, w) = 4, inputs(2, 64, 4, 2, 16)
  mesh = seq_mesh(n)
  spec = P(None, None, "seq")

  def ring(q, k, v):  # q [V, B, T/n, H, D]: vmap over the leading axis
    fn = jax.vmap(lambda q, k, v: jax_flash2.ring_attention(
        q, k, v, axis_name="seq", causal=True, return_lse=True))
    return fn(q, k, v)

  sharded = jax.checkpoint(cp.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3,
                                        out_specs=(spec, P(None, None, None, "seq"))))

  def reference(q, k, v):
    return jax.vmap(lambda q, k, v: jax_flash2.flash_attention(
        q, k, v, causal=True, return_lse=True))(q, k, v)

  args = [x[:, None] for x in (q, k, v)]  # [V=2, B=1, T, ...]
  wv = w[:, None]
  got = jax.jit(jax.value_and_grad(loss_of(sharded, wv), argnums=(0, 1, 2)))(*args)
  want = jax.jit(jax.value_and_grad(loss_of(reference, wv), argnums=(0, 1, 2)))(*args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, r in zip(got[1], want[1]):
    np.testing.assert_allclose(g, r, **GRAD_TOL)
  return f"loss {float(got[0]):.4f}"


@check()
def export_round_trip():
  """jax.export of a jitted ring (zigzag, causal) with its VJP: the
  deserialized function and its gradient equal the live ones."""
  n, (q, k, v, w) = 4, inputs(1, 64, 4, 2, 16)
  mesh = seq_mesh(n)
  sharding = NamedSharding(mesh, P(None, "seq"))
  args = [jax.device_put(x, sharding) for x in (q, k, v)]
  fn = jax.jit(lambda q, k, v: cp.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", causal=True, layout="zigzag"),
      in_shardings=(sharding,) * 3, out_shardings=sharding)
  exported = jax.export.export(fn, disabled_checks=jax_flash2.export.disabled_checks())(*args)
  restored = jax.export.deserialize(exported.serialize(vjp_order=1))
  np.testing.assert_array_equal(restored.call(*args), fn(*args))
  grad = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w), argnums=(0, 1, 2)))
  for a, b in zip(grad(restored.call)(*args), grad(fn)(*args)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  return f"{len(exported.mlir_module_serialized)} bytes"


@check()
def jit_sequence_sharded():
  """Plain jax.jit of flash_attention on q, k, v split along the sequence
  (NamedSharding): the custom partitioning runs the ring (GQA) or the
  all-gather of K/V (MQA) instead of gathering q; Shardy and GSPMD alike."""
  mesh = seq_mesh(4, 2)
  sharding = NamedSharding(mesh, P("data", "seq"))
  details = []
  for shardy in (True, False):
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
      for heads, kv_heads, want in ((4, 2, "collective-permute"), (8, 1, "all-gather")):
        q, k, v, _ = inputs(2, 64, heads, kv_heads, 16)
        args = [jax.device_put(x, sharding) for x in (q, k, v)]
        fn = jax.value_and_grad(
            lambda q, k, v: jnp.sum(jnp.sin(jax_flash2.flash_attention(q, k, v, causal=True))),
            argnums=(0, 1, 2))
        compiled = jax.jit(fn).lower(*args).compile()
        hlo = compiled.as_text()
        assert want in hlo, f"no {want}"
        gathered = re.findall(r"= f32\[([\d,]+)\][^ ]* all-gather(?:-start)?\(", hlo)
        assert all(g == f"1,64,{kv_heads},16" for g in gathered), gathered  # K/V only
        assert not [s for s in _shapes(hlo) if len(s) == 4 and s[1] == 64 and s[2] == heads]
        got, ref = compiled(*args), jax.jit(fn)(q, k, v)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
        for g, r in zip(got[1], ref[1]):
          np.testing.assert_allclose(g, r, **GRAD_TOL)
        details.append(f"{'Shardy' if shardy else 'GSPMD'} K={kv_heads}: {want}")
    finally:
      jax.config.update("jax_use_shardy_partitioner", True)
  return "; ".join(details)


# The compiled programs.


def _shapes(hlo: str):
  return [tuple(int(d) for d in dims.split(",") if d)
          for dims in re.findall(r"\b(?:f32|s32|pred|bf16|f16)\[([\d,]*)\]", hlo)]


def _compiled(n, strategy, layout="contiguous", t=128, **options):
  q, k, v, w = inputs(1, t, 4, 2, 16)
  mesh = seq_mesh(n)
  spec = P(None, "seq")
  args = [put(x, mesh, spec) for x in (q, k, v, w)]

  def sharded(q, k, v):
    return cp.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq", causal=True,
                                         layout=layout, strategy=strategy, return_lse=True,
                                         **options)

  def fn(q, k, v, w):  # w an argument, not a [B, T, H, D] constant in the program
    return jax.grad(loss_of(sharded, w), argnums=(0, 1, 2))(q, k, v)

  return jax.jit(fn).lower(*args).compile().as_text()


@check()
def ring_hlo():
  """The ring moves K/V with collective-permutes and gathers nothing: no
  all-gather, and no value in the program has the global length T. The
  first K/V hop does not wait for the kernels (it is scheduled before the
  first flash custom call)."""
  n, t = 8, 128
  details = []
  for layout in ("contiguous", "zigzag"):
    hlo = _compiled(n, "ring", layout, t)
    assert "all-gather" not in hlo, "all-gather in the ring's program"
    assert "all-reduce" not in hlo and "all-to-all" not in hlo
    permutes = len(re.findall(r"collective-permute(?:-start)?\(", hlo))
    # Forward: K and V, n - 1 hops each. Backward: K/V packed, n - 1 hops
    # (its own, not the forward's: those blocks are not kept), and dK/dV
    # packed, n - 1 hops and one home.
    assert permutes == 2 * (n - 1) + (n - 1) + n, permutes
    long = [s for s in _shapes(hlo) if t in s]
    assert not long, f"values of global length {t}: {long[:4]}"
    entry = hlo[hlo.index("\nENTRY"):]
    first_permute = re.search(r"collective-permute(?:-start)?\(", entry).start()
    first_kernel = re.search(r'custom_call_target="jax_flash2_', entry)
    if first_kernel is not None:  # else every kernel is inside a conditional
      assert first_permute < first_kernel.start(), "the first hop waits for a kernel"
    details.append(f"{layout}: {permutes} collective-permutes, no all-gather")
  # A causal window of 20 over shards of 16 computes steps 0-2 only: two K/V
  # hops per pass, dK/dV carried twice and sent home once.
  hlo = _compiled(n, "ring", "contiguous", t, window_size=(20, 0))
  permutes = len(re.findall(r"collective-permute(?:-start)?\(", hlo))
  assert permutes == 2 * 2 + 2 + 3, permutes
  details.append(f"window (20, 0): {permutes} collective-permutes")
  return "; ".join(details)


@check()
def allgather_hlo():
  """The all-gather strategy gathers only K and V (and nothing q-shaped)."""
  n, t = 8, 128
  hlo = _compiled(n, "allgather", "contiguous", t)
  gathered = re.findall(r"= (\w+)\[([\d,]+)\][^ ]* all-gather(?:-start)?\(", hlo)
  assert gathered, "no all-gather"
  shapes = {(dtype, dims) for dtype, dims in gathered}
  assert shapes <= {("f32", f"1,{t},2,16")}, shapes  # [B, S, K, D] only, K = 2 != H = 4
  assert "collective-permute" not in hlo
  return f"all-gathers of {sorted(shapes)}"


# Errors.


@check()
def errors():
  mesh = seq_mesh(4)
  q = jnp.ones((1, 60, 2, 16))

  def expect(exc, pattern, fn):
    try:
      fn()
    except exc as e:
      assert re.search(pattern, str(e)), str(e)
      return
    raise AssertionError(f"no {exc.__name__} matching {pattern!r}")

  attn = cp.context_parallel_attention
  expect(ValueError, r"q.shape\[1\] = 62 must be divisible by n = 4",
         lambda: attn(jnp.ones((1, 62, 2, 16)), q[:, :62], q[:, :62], mesh=mesh,
                      axis_name="seq"))
  expect(ValueError, r"must be divisible by 2n = 8",
         lambda: attn(q, q, q, mesh=mesh, axis_name="seq", layout="zigzag", causal=True))
  expect(ValueError, r"divisible by 2n = 8", lambda: cp.to_zigzag(q, 4))
  expect(ValueError, r"not a bound mesh axis",
         lambda: jax_flash2.ring_attention(q, q, q, axis_name="seq"))
  expect(ValueError, r"not an axis of the mesh",
         lambda: attn(q, q, q, mesh=mesh, axis_name="sequence"))
  expect(ValueError, r"layout must be one of",
         lambda: attn(q[:, :64], q[:, :64], q[:, :64], mesh=mesh, axis_name="seq",
                      layout="striped"))
  expect(ValueError, r"strategy must be one of",
         lambda: attn(q, q, q, mesh=mesh, axis_name="seq", strategy="tree"))
  expect(NotImplementedError, r"zigzag.*window_size",
         lambda: attn(jnp.ones((1, 64, 2, 16)), jnp.ones((1, 64, 2, 16)),
                      jnp.ones((1, 64, 2, 16)), mesh=mesh, axis_name="seq", layout="zigzag",
                      window_size=(8, 0)))
  expect(ValueError, r"T == S",
         lambda: attn(q, jnp.ones((1, 32, 2, 16)), jnp.ones((1, 32, 2, 16)), mesh=mesh,
                      axis_name="seq", causal=True))
  x = jnp.arange(16.0).reshape(1, 16)
  np.testing.assert_array_equal(cp.from_zigzag(cp.to_zigzag(x, 4), 4), x)
  # n = 2: chunks 0, 3 on device 0 and 1, 2 on device 1.
  np.testing.assert_array_equal(cp.to_zigzag(x, 2)[0],
                                [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
  return "ok"


def main():
  names = ARGS.names or [n for n in CHECKS if not MULTI or n in MULTI_CHECKS]
  failed = 0
  for name in names:
    try:
      detail, ok = CHECKS[name]() or "ok", True
    except Exception as e:  # noqa: BLE001 - report and go on
      detail, ok = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}", False
    failed += not ok
    if ARGS.json:
      print(json.dumps(dict(name=name, ok=ok, detail=detail,
                            process=ARGS.process_id)), flush=True)
    else:
      print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
