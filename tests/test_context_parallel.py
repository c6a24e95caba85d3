"""Context parallelism (jax_flash2.context_parallel).

The static plans (which block pairs a ring step computes, with which window)
are checked here against a brute-force mask. The multi-device checks run in
fresh processes, as tests/test_sharding.py does (the device count is fixed
when jax initializes): tests/cp_checks.py on 8 CPU devices, and again as 2
processes x 4 CPU devices joined by jax.distributed on localhost.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import re
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flash2
from jax_flash2 import context_parallel as cp
from conftest import package_env

SCRIPT = pathlib.Path(__file__).with_name("cp_checks.py")
SOURCE = SCRIPT.read_text()
NAMES = re.findall(r"^@check\(.*\)\ndef (\w+)", SOURCE, flags=re.M)
MULTI_NAMES = re.findall(r"^@check\(multiprocess=True\)\ndef (\w+)", SOURCE, flags=re.M)


def _env():
  return package_env(drop=("XLA_FLAGS",))


def _parse(stdout):
  found = {}
  for line in stdout.splitlines():
    if line.startswith("{"):
      entry = json.loads(line)
      found[(entry["process"], entry["name"])] = entry
  return found


# Plans, against the mask they stand for.


def _visible(q_len, k_len, delta, left, right):
  i = np.arange(q_len)[:, None]
  j = np.arange(k_len)[None, :]
  ok = np.ones((q_len, k_len), bool)
  if left >= 0:
    ok &= j >= i + delta - left
  if right >= 0:
    ok &= j <= i + delta + right
  return ok


def _flash_mask(pair, q_len, k_len):
  """The mask flash_attention applies inside the pair's box, placed in the block."""
  out = np.zeros((q_len, k_len), bool)
  tq, sk = pair.q1 - pair.q0, pair.k1 - pair.k0
  left, right = pair.window
  i = np.arange(tq)[:, None]
  j = np.arange(sk)[None, :]
  ok = np.ones((tq, sk), bool)
  if left >= 0:
    ok &= j >= i + sk - tq - left
  if right >= 0:
    ok &= j <= i + sk - tq + right
  out[pair.q0:pair.q1, pair.k0:pair.k1] = ok
  return out


@pytest.mark.parametrize("q_len,k_len", [(16, 16), (7, 12), (12, 5)])
def test_block_pair_reproduces_the_mask(q_len, k_len):
  cases = itertools.product(range(-30, 31, 3), (-1, 0, 2, 9, 20), (-1, 0, 3, 11))
  for delta, left, right in cases:
    want = _visible(q_len, k_len, delta, left, right)
    pair = cp.block_pair(0, q_len, 0, k_len, delta, left, right)
    if pair is None:
      assert not want.any(), (delta, left, right)
      continue
    assert min(pair.window) >= -1
    np.testing.assert_array_equal(_flash_mask(pair, q_len, k_len), want,
                                  err_msg=f"delta {delta} window ({left}, {right}): {pair}")


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1)])
def test_ring_plan_covers_the_global_mask(layout, n, window):
  """Every device's steps together cover exactly its rows of the global mask
  (causal or full; zigzag chunks included), each key once."""
  shard = 8
  total = n * shard
  order = np.arange(total)
  if layout == "zigzag":
    order = np.asarray(cp.to_zigzag(order[None], n)[0])
  cfg = cp.RingConfig("seq", n, layout, "ring", window == (-1, 0), 1.0, *window, 0.0)
  plan = cp.ring_plan(cfg, shard, shard)
  pos = order.reshape(n, shard)  # pos[r]: global positions held by device r
  for r in range(n):
    covered = np.zeros((shard, total), int)
    for step, own, other in plan:
      src = (r - step) % n
      for pair in (other if src > r else own):
        block = _flash_mask(pair, shard, shard).astype(int)
        covered[:, pos[src]] += block
    i = pos[r][:, None]
    j = np.arange(total)[None, :]
    want = (j <= i) if window == (-1, 0) else np.ones((shard, total), bool)
    np.testing.assert_array_equal(covered, want.astype(int), err_msg=f"device {r}")


def test_zigzag_balances_causal_work():
  """Per step every device computes the same number of score elements with
  zigzag; with contiguous, the busiest device does about twice the mean."""
  n, shard = 8, 16

  def work(layout):
    cfg = cp.RingConfig("seq", n, layout, "ring", True, 1.0, -1, 0, 0.0)
    per_device = np.zeros(n)
    for step, own, other in cp.ring_plan(cfg, shard, shard):
      for r in range(n):
        pairs = other if (r - step) % n > r else own
        per_device[r] += sum(_flash_mask(p, shard, shard).sum() for p in pairs)
    return per_device

  zigzag, contiguous = work("zigzag"), work("contiguous")
  assert np.ptp(zigzag) == 0, zigzag
  assert zigzag.sum() == contiguous.sum()
  assert contiguous.max() / contiguous.mean() > 1.8


def test_zigzag_round_trip_and_errors():
  x = jnp.arange(2 * 24 * 3).reshape(2, 24, 3)
  for n in (1, 2, 3, 6):
    np.testing.assert_array_equal(cp.from_zigzag(cp.to_zigzag(x, n), n), x)
  np.testing.assert_array_equal(cp.to_zigzag(jnp.arange(8), 2, axis=0),
                                [0, 1, 6, 7, 2, 3, 4, 5])
  with pytest.raises(ValueError, match=r"divisible by 2n = 10"):
    cp.to_zigzag(x, 5)
  with pytest.raises(ValueError, match="n must be an int"):
    cp.from_zigzag(x, 0)
  with pytest.raises(ValueError, match=r"axis must be an int in \[-3, 3\)"):
    cp.to_zigzag(x, 2, axis=3)
  with pytest.raises(ValueError, match="axis must be an int"):
    cp.from_zigzag(x, 2, axis=1.0)


def test_context_parallel_argument_errors():
  x = jnp.ones((1, 8, 2, 16))
  mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))
  with pytest.raises(ValueError, match="batch_axis 'data' is not an axis of the mesh"):
    cp.context_parallel_attention(x, x, x, mesh=mesh, axis_name="seq", batch_axis="data")
  with pytest.raises(ValueError, match="segment_ids must be a pair"):
    cp.context_parallel_attention(x, x, x, mesh=mesh, axis_name="seq",
                                  segment_ids=jnp.zeros((1, 8), jnp.int32))
  with pytest.raises(TypeError, match="return_lse must be a bool"):
    jax.shard_map(lambda q: cp.ring_attention(q, q, q, axis_name="seq", return_lse="no"),
                  mesh=mesh, in_specs=jax.P(None, "seq"), out_specs=jax.P(None, "seq"))(x)


def test_one_device_ring_is_flash_attention():
  """n = 1 on the suite's single device: the ring is one local block."""
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (1, 24, 4, 16))
  k = jax.random.normal(keys[1], (1, 24, 2, 16))
  v = jax.random.normal(keys[2], (1, 24, 2, 16))
  mesh = jax.make_mesh((1,), ("seq",), axis_types=(jax.sharding.AxisType.Auto,))

  def loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

  ring = lambda q, k, v: cp.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", causal=True, layout="zigzag")
  flash = lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True)
  np.testing.assert_allclose(jax.jit(ring)(q, k, v), flash(q, k, v), atol=1e-6)
  got = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(loss(flash), argnums=(0, 1, 2)))(q, k, v)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, atol=1e-5)


# Multi-device checks in subprocesses.


@pytest.fixture(scope="module")
def eight_devices():
  proc = subprocess.run([sys.executable, str(SCRIPT), "--devices", "8", "--json"], env=_env(),
                        capture_output=True, text=True, timeout=900)
  return _parse(proc.stdout), proc


def test_found_checks():
  assert len(NAMES) >= 14 and len(MULTI_NAMES) >= 5, (NAMES, MULTI_NAMES)


@pytest.mark.xdist_group("cp_eight_devices")  # one subprocess per worker that runs any of them
@pytest.mark.parametrize("name", NAMES)
def test_eight_devices(eight_devices, name):
  found, proc = eight_devices
  entry = found.get((0, name))
  if entry is None:
    pytest.fail(f"{name} did not report (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
  assert entry["ok"], entry["detail"]


def _free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_processes():
  address = f"localhost:{_free_port()}"
  procs = [subprocess.Popen(
      [sys.executable, str(SCRIPT), "--devices", "4", "--num-processes", "2", "--process-id",
       str(i), "--coordinator", address, "--json"], env=_env(), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True) for i in range(2)]
  outputs = []
  for proc in procs:
    try:
      outputs.append(proc.communicate(timeout=900))
    except subprocess.TimeoutExpired:
      for p in procs:
        p.kill()
      raise
  found = {}
  for stdout, _ in outputs:
    found.update(_parse(stdout))
  return found, procs, outputs


@pytest.mark.xdist_group("cp_two_processes")
@pytest.mark.parametrize("name", MULTI_NAMES)
def test_two_processes(two_processes, name):
  found, procs, outputs = two_processes
  for i in range(2):
    entry = found.get((i, name))
    if entry is None:
      pytest.fail(f"{name} did not report in process {i} (exit {procs[i].returncode}):\n"
                  f"{outputs[i][1][-4000:]}")
    assert entry["ok"], f"process {i}: {entry['detail']}"
