"""The CPU kernels in fresh CPU-only processes, whatever machine runs the suite.

On a GPU machine every other test runs on the GPU, so these are the ones
that compile the CPU custom calls with that machine's jax. Each step is its
own process and its own test, from the smallest program up (one call; its
gradient; ppermute alone over two host devices; a batch split over them,
through custom_partitioning; ring attention over them),
so that a crash in XLA's compile names the step that causes it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import PACKAGE_ROOT, package_env

PRELUDE = """
import os
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count={devices}"
import jax, jax.numpy as jnp, numpy as np
import jax_flash2
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
rng = np.random.default_rng(0)
def inputs(t):
  return [jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32) for _ in range(3)]
def close(a, b, tol=2e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol, rtol=tol)
"""

STEPS = {
    "forward": """
q, k, v = inputs(37)
close(jax.jit(jax_flash2.flash_attention)(q, k, v),
      jax_flash2.reference.attention(q, k, v))
""",
    "gradient": """
q, k, v = inputs(37)
loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v, causal=True) ** 2))
got = jax.jit(jax.grad(loss(jax_flash2.flash_attention), argnums=(0, 1, 2)))(q, k, v)
want = jax.grad(loss(jax_flash2.reference.attention), argnums=(0, 1, 2))(q, k, v)
for a, b in zip(got, want):
  close(a, b, 1e-4)
""",
    "ppermute_two_devices": """
mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
try:
  shard_map = jax.shard_map
except AttributeError:  # older jax
  from jax.experimental.shard_map import shard_map
f = shard_map(lambda x: jax.lax.ppermute(x, "seq", [(0, 1), (1, 0)]), mesh=mesh,
              in_specs=P("seq"), out_specs=P("seq"))
x = jnp.arange(8.0)
close(jax.jit(f)(x), jnp.concatenate([x[4:], x[:4]]))
""",
    "batch_sharded_two_devices": """
mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
q, k, v = (jnp.concatenate([x, x[:, ::-1]]) for x in inputs(37))
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
close(jax.jit(jax_flash2.flash_attention)(put(q), put(k), put(v)),
      jax_flash2.flash_attention(q, k, v))
""",
    # The ring's parts without the ring: the kernel inside shard_map, after a
    # ppermute of its keys, inside a lax.cond on the device index.
    "cond_on_axis_index_two_devices": """
mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
try:
  shard_map = jax.shard_map
except AttributeError:  # older jax
  from jax.experimental.shard_map import shard_map
q, k, v = inputs(64)
def local(q, k, v):
  k = jax.lax.ppermute(k, "seq", [(0, 1), (1, 0)])
  run = lambda: jax_flash2.flash_attention(q, k, v)
  return jax.lax.cond(jax.lax.axis_index("seq") < 1, run, lambda: 2 * run())
spec = P(None, "seq")
f = shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
halves = lambda x: (x[:, :32], x[:, 32:])
(q0, q1), (k0, k1), (v0, v1) = halves(q), halves(k), halves(v)
want = jnp.concatenate([jax_flash2.flash_attention(q0, k1, v0),
                        2 * jax_flash2.flash_attention(q1, k0, v1)], axis=1)
close(jax.jit(f)(put(q), put(k), put(v)), want)
""",
    "ring_two_devices": """
from jax_flash2 import context_parallel as cp
mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
q, k, v = inputs(64)
put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "seq")))
ring = lambda q, k, v: cp.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq",
                                                     causal=True)
close(jax.jit(ring)(put(q), put(k), put(v)), jax_flash2.flash_attention(q, k, v, causal=True))
loss = lambda f: (lambda q, k, v: jnp.sum(f(q, k, v) ** 2))
got = jax.jit(jax.grad(loss(ring), argnums=(0, 1, 2)))(put(q), put(k), put(v))
want = jax.grad(loss(lambda q, k, v: jax_flash2.flash_attention(q, k, v, causal=True)),
                argnums=(0, 1, 2))(q, k, v)
for a, b in zip(got, want):
  close(a, b, 1e-4)
""",
}


@pytest.mark.parametrize("step", list(STEPS))
def test_cpu_platform_step(step):
  devices = 2 if "two_devices" in step else 1
  script = textwrap.dedent(PRELUDE.format(devices=devices)) + STEPS[step] + "\nprint('ok')\n"
  env = package_env(drop=("XLA_FLAGS", "JAX_PLATFORMS"))
  result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], cwd=PACKAGE_ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
      f"{step}: exit {result.returncode}\n{result.stderr[-4000:]}")
