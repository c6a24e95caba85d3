"""Partitioning of the kernels across 8 CPU devices (jit with shardings,
shard_map, pmap, vmap), checked in a subprocess: the device count is fixed when
jax initializes, and the rest of the suite runs on one device.

The checks themselves live in tests/multi_device_checks.py, which also runs
directly on a multi-GPU host (`--platform gpu`).
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

from conftest import package_env

SCRIPT = pathlib.Path(__file__).with_name("multi_device_checks.py")
# Read the names without importing the script: importing it would set XLA_FLAGS
# in this process.
NAMES = re.findall(r"^@check\ndef (\w+)", SCRIPT.read_text(), flags=re.M)


@pytest.fixture(scope="module")
def results():
  proc = subprocess.run([sys.executable, str(SCRIPT), "--platform", "cpu", "--devices", "8",
                         "--json"], env=package_env(), capture_output=True, text=True, timeout=600)
  found = {}
  for line in proc.stdout.splitlines():
    if line.startswith("{"):
      entry = json.loads(line)
      found[entry["name"]] = entry
  return found, proc


def test_found_checks():
  assert len(NAMES) >= 8, NAMES


@pytest.mark.parametrize("name", NAMES)
def test_multi_device(results, name):
  found, proc = results
  if name not in found:
    pytest.fail(f"{name} did not report (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
  entry = found[name]
  assert entry["ok"], entry["detail"]
  # On 8 CPU devices every layout can be formed and every feature is served.
  assert not entry["skipped"], entry["detail"]
