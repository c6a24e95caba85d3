"""The Hopper backward's rotated deterministic dQ order, checked on the host."""
from conftest import run_host_test


def test_rotated_dq_order_on_host(tmp_path):
  """src/cuda/sm90/dq_order.h: each query iteration's turns rank the key
  blocks by the step at which their walks reach it, and the turn counters
  never deadlock with tiles started at random times (built for the host)."""
  run = run_host_test(tmp_path, "dq_order_host_test.cc")
  assert run.returncode == 0 and " 0 failures" in run.stdout, run.stdout + run.stderr
