"""The repository's text describes the code, not its history: README, docs,
sources, tests, benchmarks and tools never narrate work periods or device
runs (git log holds the story)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("docs", "src", "jax_flash2", "tests", "benchmarks", "tools", "examples", "cmake")
SUFFIXES = {".md", ".py", ".h", ".cuh", ".cu", ".cc", ".sh", ".txt", ".toml", ".cmake"}
# Spelled in pieces so that this file does not match itself.
WORK_LOG = re.compile(r"\b(" + "ses" + r"sions?|device " + r"calls?)\b", re.IGNORECASE)


def _texts():
  yield ROOT / "README.md"
  for folder in FOLDERS:
    for path in sorted((ROOT / folder).rglob("*")):
      if path.suffix in SUFFIXES and path.is_file() and "build" not in path.parts:
        yield path


def test_no_work_log_in_the_repository_text():
  found = []
  for path in _texts():
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
      if WORK_LOG.search(line):
        found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
  assert len(found) == 0, "\n".join(found)


def test_the_pattern_finds_a_work_log_line():
  assert WORK_LOG.search("measured in the third " + "ses" + "sion")
  assert WORK_LOG.search("Device " + "call 2 showed")
  assert not WORK_LOG.search("a decode step, one kernel call per device")
