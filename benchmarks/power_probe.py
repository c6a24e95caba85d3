"""The forward at B1 T=S=16k H16 D128 (bf16), ours beside cuDNN, for three
input distributions, with nvidia-smi sampling the SM clock and board power
meanwhile: at this shape both kernels run at the H200's 700 W limit, so
their speed moves with the clock the power manager allows (benchmarks/results/h200.md,
"Clock and power").

  python benchmarks/power_probe.py
"""

from __future__ import annotations

import subprocess
import tempfile

import jax
import jax.numpy as jnp

import jax_flash2
from forward_isolated import median_time  # this directory (run as benchmarks/power_probe.py)

B, T, H, D = 1, 16384, 16, 128
FLOPS = 4 * B * T * T * H * D


def inputs():
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  shape = (B, T, H, D)
  return {
      "normal": [jax.random.normal(k, shape, jnp.bfloat16) for k in keys],
      "uniform(-1,1)": [jax.random.uniform(k, shape, jnp.bfloat16, -1, 1) for k in keys],
      "0.1*normal": [(0.1 * jax.random.normal(k, shape)).astype(jnp.bfloat16) for k in keys],
  }


def main():
  impls = {
      "jax_flash2": jax.jit(lambda q, k, v: jax_flash2.flash_attention(q, k, v)),
      "cudnn": jax.jit(
          lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")),
  }
  with tempfile.NamedTemporaryFile("r", suffix=".csv") as log:
    smi = subprocess.Popen(
        ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
         "-lms", "200", "-f", log.name])
    try:
      for rnd in range(2):
        for name, args in inputs().items():
          for impl, fn in impls.items():
            t = median_time(fn, args)
            print(f"round {rnd} {name:14s} {impl:10s} {t * 1e3:7.3f} ms "
                  f"{FLOPS / t / 1e12:6.1f} TFLOP/s", flush=True)
    finally:
      smi.terminate()
      smi.wait()
    rows = [line.split(",") for line in log.read().splitlines() if line.count(",") == 1]
  loaded = [(int(c), float(w)) for c, w in rows if float(w) > 300]
  if loaded:
    clocks = sorted(c for c, _ in loaded)
    print(f"samples above 300 W: {len(loaded)}; SM clock {clocks[0]}-{clocks[-1]} MHz "
          f"(median {clocks[len(clocks) // 2]}); power up to {max(w for _, w in loaded):.0f} W")


if __name__ == "__main__":
  main()
