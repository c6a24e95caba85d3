"""Plots a gpu_bench.py results table (markdown) as a PNG: TFLOP/s against T,
one panel per (D, causal, pass), one line per implementation.

  python benchmarks/plot.py benchmarks/results/h200.md benchmarks/results/h200.png
"""

from __future__ import annotations

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def parse(path):
  """{(D, causal): {name: [(T, fwd, fwd_bwd)]}} from the first grid table
  (the package grid; other tables with D / causal / T columns follow it)."""
  rows, names = {}, None
  for line in open(path):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if cells[:3] == ["D", "causal", "T"]:
      if names is not None:
        break
      names = cells[3:]
      continue
    if names is None or len(cells) != 3 + len(names) or not cells[0].isdigit():
      continue
    key = (int(cells[0]), cells[1] == "True")
    for name, cell in zip(names, cells[3:]):
      if "/" in cell:
        fwd, both = (float(x) for x in cell.split("/"))
        rows.setdefault(key, {}).setdefault(name, []).append((int(cells[2]), fwd, both))
  return rows


def main(src, dst):
  rows = parse(src)
  keys = sorted(rows)
  fig, axes = plt.subplots(2, len(keys), figsize=(4 * len(keys), 7), squeeze=False)
  for col, key in enumerate(keys):
    for row, (label, index) in enumerate((("forward", 1), ("forward+backward", 2))):
      ax = axes[row][col]
      for name, points in sorted(rows[key].items()):
        ax.plot([p[0] for p in points], [p[index] for p in points], marker="o", label=name)
      ax.set_xscale("log", base=2)
      ax.set_title(f"D={key[0]} causal={key[1]} {label}", fontsize=9)
      ax.set_xlabel("sequence length")
      ax.set_ylabel("TFLOP/s")
      ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(dst, dpi=110)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
