"""The Hopper backward's rotated deterministic dQ order, checked on the host."""
import pathlib
import shutil
import subprocess

import pytest


def test_rotated_dq_order_on_host(tmp_path):
  """src/cuda/sm90/dq_order.h: each query iteration's turns rank the key
  blocks by the step at which their walks reach it, and the turn counters
  never deadlock with tiles started at random times (built for the host)."""
  compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
  if compiler is None:
    pytest.skip("no C++ compiler")
  root = pathlib.Path(__file__).resolve().parents[1]
  binary = tmp_path / "dq_order_host_test"
  subprocess.run([compiler, "-std=c++17", "-O2", f"-I{root}",
                  str(root / "tests" / "cuda" / "dq_order_host_test.cc"), "-o", str(binary)],
                 check=True)
  run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=300)
  assert run.returncode == 0 and " 0 failures" in run.stdout, run.stdout + run.stderr
