"""Which part of the context-parallel ring makes XLA:CPU's compile crash.

Each probe runs in a fresh CPU-only process over two host devices and prints
its exit status (-11: the segfault). The probes add the ring's parts one at
a time: the kernel inside shard_map, an lse output sharded on its last axis,
pcast zeros, the logsumexp merge, the all-gather strategy, the ring itself.

  python3 tools/probe_ring_compile.py [--dump DIR]   (--dump: XLA's HLO dumps
                                                       of the crashing probes)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap

PRELUDE = """
import os
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=2 " +
                           os.environ.get("PROBE_XLA_FLAGS", ""))
import jax, jax.numpy as jnp, numpy as np
import jax_flash2
from jax_flash2 import context_parallel as cp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
shard_map = getattr(jax, "shard_map", None)
if shard_map is None:
  from jax.experimental.shard_map import shard_map
mesh = Mesh(np.array(jax.devices()[:2]), ("seq",))
x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 64, 2, 16)), jnp.float32)
X, L = P(None, "seq", None, None), P(None, None, "seq")
def sm(f, out_specs=X):
  return jax.jit(shard_map(f, mesh=mesh, in_specs=(X,) * 3, out_specs=out_specs))
fa = lambda q, k, v, **kw: jax_flash2.flash_attention(q, k, v, **kw)
"""

PROBES = {
    "kernel": "sm(fa)(x, x, x)",
    "kernel_lse_out": "sm(lambda q, k, v: fa(q, k, v, return_lse=True), (X, L))(x, x, x)",
    "pcast_zeros": """
def f(q, k, v):
  z = jax.lax.pcast(jnp.zeros(q.shape, jnp.float32), ("seq",), to="varying")
  return z + fa(q, k, v)
sm(f)(x, x, x)""",
    "merge_two_blocks": """
def f(q, k, v):
  o1, l1 = fa(q[:, :16], k, v, return_lse=True)
  o2, l2 = fa(q[:, 16:], k, v, return_lse=True)
  out = jnp.zeros(q.shape, jnp.float32).at[:, :16].set(o1).at[:, 16:].set(o2)
  lse = jnp.concatenate([l1, l2], axis=2)
  return out, lse
sm(f, (X, L))(x, x, x)""",
    "custom_vjp": """
@jax.custom_vjp
def g(q, k, v):
  return fa(q, k, v)
g.defvjp(lambda q, k, v: (fa(q, k, v), None), lambda _, t: (t, t, t))
sm(g)(x, x, x)""",
    "merge_under_cond": """
def f(q, k, v):
  o1, l1 = fa(q, k, v, return_lse=True)
  k2 = jax.lax.ppermute(k, "seq", [(0, 1), (1, 0)])  # collectives outside the cond
  def other(o, l):
    o2, l2 = fa(q, k2, v, return_lse=True)
    return o + o2.astype(jnp.float32), jnp.logaddexp(l, l2)
  o, l = jax.lax.cond(jax.lax.axis_index("seq") > 0, other, lambda o, l: (o, l),
                      o1.astype(jnp.float32), l1)
  return o, l
sm(f, (X, L))(x, x, x)""",
    "allgather_alone": """
g = lambda x: jax.lax.all_gather(x, "seq", axis=1, tiled=True)
sm(lambda q, k, v: q + g(k)[:, :q.shape[1]] + g(v)[:, q.shape[1]:])(x, x, x)""",
    "allgather_then_kernel": """
g = lambda x: jax.lax.all_gather(x, "seq", axis=1, tiled=True)
sm(lambda q, k, v: fa(q, g(k), g(v)))(x, x, x)""",
    "allgather_then_kernel_lse": """
g = lambda x: jax.lax.all_gather(x, "seq", axis=1, tiled=True)
sm(lambda q, k, v: fa(q, g(k), g(v), return_lse=True), (X, L))(x, x, x)""",
    "allgather_under_jit": ("jax.jit(lambda q, k, v: cp.context_parallel_attention(q, k, v, "
                            "mesh=mesh, axis_name='seq', strategy='allgather'))(x, x, x)"),
    "allgather_unmasked": ("cp.context_parallel_attention(x, x, x, mesh=mesh, axis_name='seq', "
                           "strategy='allgather')"),
    "allgather_causal": ("cp.context_parallel_attention(x, x, x, mesh=mesh, axis_name='seq', "
                         "strategy='allgather', causal=True)"),
    "ring_unmasked": "cp.context_parallel_attention(x, x, x, mesh=mesh, axis_name='seq')",
    "ring_causal": "cp.context_parallel_attention(x, x, x, mesh=mesh, axis_name='seq', causal=True)",
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dump", help="folder for XLA's HLO dumps of the probes that crash")
  args = parser.parse_args(argv)
  crashed = 0
  for name, code in PROBES.items():
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(code) + "\nprint('ok')\n"
    env = dict(os.environ)
    run = lambda: subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], env=env,
                                 capture_output=True, text=True, timeout=300)
    result = run()
    line = f"{name}: exit {result.returncode}"
    if result.returncode != 0:
      crashed += 1
      # faulthandler's Python stack of the crashing thread: where it died.
      frames = [ln.strip() for ln in result.stderr.splitlines()
                if ln.strip().startswith("File ") or ln.startswith("Fatal")]
      line += "\n    " + "\n    ".join(frames[:14] or result.stderr.strip().splitlines()[-3:])
      if args.dump:
        env["PROBE_XLA_FLAGS"] = f"--xla_dump_to={os.path.join(args.dump, name)}"
        run()
    print(line, flush=True)
  return 1 if crashed else 0


if __name__ == "__main__":
  sys.exit(main())
