"""What the benchmark scripts' markdown tables share: the command they quote,
the device line, and the table written to --out."""

from __future__ import annotations

import datetime
import os
import pathlib
import subprocess
import sys

import jax


def commit() -> str:
  """The source commit: git's short hash of this checkout (with "+" when it
  has uncommitted changes), else $JAX_FLASH2_COMMIT (a copied tree without
  .git), else "unknown"."""
  root = pathlib.Path(__file__).resolve().parent.parent

  def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()

  try:
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return git("rev-parse", "--short", "HEAD") + ("+" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return os.environ.get("JAX_FLASH2_COMMIT", "unknown")


def command() -> str:
  """The command line that ran this script, as the tables quote it."""
  return "python " + " ".join(sys.argv)


def header(command: str, *details: str) -> list[str]:
  """The table's first lines: the command, then the date, commit, device and
  jax version (and `details`)."""
  device = [f"Date: {datetime.date.today().isoformat()}", f"commit {commit()}",
            f"device: {jax.devices()[0].device_kind}", f"jax {jax.__version__}", *details]
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
