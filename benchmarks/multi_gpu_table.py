"""The 1-vs-2-GPU table of the training example, from its --compare JSON outputs.

  python benchmarks/multi_gpu_table.py ONE.json TWO.json [--checks LOG] --out h200x2.md

ONE.json and TWO.json are written by `examples/train_lm.py --compare --json-out`
on one and on two GPUs (tools/multi_gpu_suite.sh makes both). The table:
tokens/s and scaling efficiency, flash against jax.nn.dot_product_attention in
speed and peak memory, and the loss at the first and last step. A missing file
is reported in the table rather than failing, so a partial run still leaves
its numbers.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def load(path: str):
  p = pathlib.Path(path)
  return json.loads(p.read_text()) if p.is_file() else None


def mib(x: float) -> str:
  return f"{x / 2**20:,.0f}"


def table(runs: dict[int, dict | None], command: str, checks: str | None) -> str:
  done = {n: r for n, r in runs.items() if r}
  lines = ["# Training example on H200s: 1 vs 2 GPUs", ""]
  if not done:
    return "\n".join(lines + ["No results: " + ", ".join(
        f"{n} GPU(s) not run" for n in runs), ""])
  first = next(iter(done.values()))["flash"]
  cfg = first["config"]
  lines += [
      f"Command: `{command}`", "",
      f"Model: byte-level decoder, {cfg['layers']} layers, dim {cfg['dim']}, "
      f"{cfg['heads']} heads / {cfg['kv_heads']} KV heads (head dim "
      f"{cfg['dim'] // cfg['heads']}), causal; sequence {cfg['seq_len']}, global batch "
      f"{cfg['batch']} (split over the GPUs, data parallel), {cfg['steps']} steps, "
      f"{cfg['dtype']} compute, float32 parameters, AdamW. Device: {first['device_kind']}. "
      "tokens/s leaves out the first (compiling) step; peak memory is the "
      f"{first['peak_memory_source']} (the largest over the devices), each implementation "
      "in its own process.", "",
      "| GPUs | attention | tokens/s | tokens/s per GPU | median step (ms) | peak MiB per GPU "
      "| loss step 1 | loss last step |",
      "|---|---|---|---|---|---|---|---|"]
  for n, r in runs.items():
    if not r:
      lines.append(f"| {n} | not run (no JSON) | | | | | | |")
      continue
    for key, name in (("flash", "jax_flash2"), ("xla", "jax.nn.dot_product_attention")):
      x = r[key]
      lines.append(
          f"| {x['devices']} | {name} | {x['tokens_per_s']:,.0f} | "
          f"{x['tokens_per_s_per_device']:,.0f} | {1e3 * x['median_step_s']:.1f} | "
          f"{mib(x['peak_memory_bytes'])} | {x['losses'][0]:.4f} | {x['losses'][-1]:.4f} |")
  lines += ["", "| | jax_flash2 | jax.nn.dot_product_attention |", "|---|---|---|"]
  if 1 in done and 2 in done:
    eff = {k: done[2][k]["tokens_per_s"] / (2 * done[1][k]["tokens_per_s"])
           for k in ("flash", "xla")}
    lines.append(f"| scaling efficiency, 2 GPUs (tokens/s 2 GPUs / 2x 1 GPU) | "
                 f"{eff['flash']:.0%} | {eff['xla']:.0%} |")
  for n, r in done.items():
    f, x = r["flash"], r["xla"]
    lines.append(f"| {n} GPU(s): speed, flash / jax.nn | "
                 f"{f['tokens_per_s'] / x['tokens_per_s']:.2f}x | 1 |")
    lines.append(f"| {n} GPU(s): peak memory, flash / jax.nn | "
                 f"{f['peak_memory_bytes'] / x['peak_memory_bytes']:.2f}x | 1 |")
  lines += [""]
  for n, r in done.items():
    lines.append(
        f"- {n} GPU(s): loss curves {'agree' if r['loss_curves_agree'] else 'DIFFER'} "
        f"(max |flash - jax.nn| {r['max_loss_diff']:.2e} over {len(r['flash']['losses'])} "
        f"steps); flash kernel input dtype in the compiled model: "
        f"{', '.join(r['flash']['flash_kernel_dtypes'])}.")
  if checks:
    lines.append(f"- `tests/multi_device_checks.py --platform gpu` on both GPUs: {checks}.")
  return "\n".join(lines + [""])


def checks_summary(path: str | None) -> str | None:
  """The closing 'N passed, N skipped, N failed' line of a multi_device_checks log."""
  if not path or not pathlib.Path(path).is_file():
    return None
  ends = [line for line in pathlib.Path(path).read_text().splitlines() if " failed" in line
          and line.split()[0].isdigit()]
  return ends[-1] if ends else "did not finish (no summary line in the log)"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("one", help="--compare JSON of the 1-GPU run")
  p.add_argument("two", help="--compare JSON of the 2-GPU run")
  p.add_argument("--checks", help="log of tests/multi_device_checks.py on the GPUs")
  p.add_argument("--command", default="bash tools/multi_gpu_suite.sh",
                 help="the command that made the runs, quoted in the table")
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  text = table({1: load(args.one), 2: load(args.two)}, args.command, checks_summary(args.checks))
  pathlib.Path(args.out).write_text(text)
  print(text)


if __name__ == "__main__":
  sys.exit(main())
