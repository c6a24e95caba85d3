"""What the benchmark scripts' markdown tables share: the command they quote,
the device line, and the table written to --out."""

from __future__ import annotations

import sys

import jax


def command() -> str:
  """The command line that ran this script, as the tables quote it."""
  return "python " + " ".join(sys.argv)


def header(command: str, *details: str) -> list[str]:
  """The table's first lines: the command, then the device and jax version (and `details`)."""
  device = [f"Device: {jax.devices()[0].device_kind}", f"jax {jax.__version__}", *details]
  return [f"Command: `{command}`", ", ".join(device)]


def save(text: str, out: str | None) -> None:
  """Writes `text` to the file `out` (the --out argument), when one is given."""
  if out:
    with open(out, "w") as f:
      f.write(text)


def emit(text: str, out: str | None) -> None:
  """Prints the finished table and saves it to `out`."""
  print(text)
  save(text, out)
