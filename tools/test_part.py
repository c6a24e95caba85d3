"""Prints the test ids of part K of N of the pytest suite (collection order,
every N-th test from the K-th), one per line, so that the whole suite can
run on the GPU machine in runs of at most 10 minutes each:

  mapfile -t ids < <(python3 tools/test_part.py 0 3)   # ids hold spaces: an array
  (cd tests && python3 -m pytest -n 16 "${ids[@]}")    # or: PART=0/3 tools/gpu_suite.sh

Run from the repository root; the ids are relative to tests/. Dealt out
rather than cut into runs, so every part gets a share of each file's slow
cases.

  python3 tools/test_part.py --left IDS LOG...

prints the ids of the file IDS (one per line) that no `pytest -v` log among
LOG... reports a result for: what a run cut by its time limit left to do
(IDS=file tools/gpu_suite.sh runs them).
"""

from __future__ import annotations

import re
import subprocess
import sys

# Result lines of `pytest -v`: "OUTCOME id" under xdist (after "[gwN] [ P%]";
# --dist loadgroup appends "@group" to grouped ids), "id OUTCOME" in one process.
_OUTCOME = r"(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
_RESULTS = (re.compile(rf"\b{_OUTCOME} +(\S+::.*?)(?:@[\w-]+)? *$"),
            re.compile(rf"^(\S+::.*?) {_OUTCOME}\b"))


def collect(extra_args: list[str]) -> list[str]:
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
       *extra_args],
      cwd="tests", capture_output=True, text=True, check=False)
  ids = [line for line in out.stdout.splitlines() if "::" in line]
  if not ids:
    sys.exit(f"test_part: no tests collected:\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
  # Collected from tests/ the ids may still start with "tests/" (rootdir).
  return [i.removeprefix("tests/") for i in ids]


def left(ids_file: str, logs: list[str]) -> list[str]:
  done = set()
  for log in logs:
    with open(log, errors="replace") as f:
      for line in f:
        for pattern in _RESULTS:
          if m := pattern.search(line):
            done.add(m.group(1))
            break
  with open(ids_file) as f:
    ids = [line.rstrip("\n") for line in f if line.strip()]
  return [i for i in ids if i not in done]


def main(argv: list[str]) -> None:
  if argv[:1] == ["--left"]:
    if len(argv) < 3:
      sys.exit("usage: test_part.py --left IDS LOG...")
    print("\n".join(left(argv[1], argv[2:])))
    return
  if len(argv) < 2 or not argv[0].isdigit() or not argv[1].isdigit():
    sys.exit("usage: test_part.py K N [pytest collection args]")
  part, parts = int(argv[0]), int(argv[1])
  if not 0 <= part < parts:
    sys.exit(f"test_part: need 0 <= K < N, got K={part} N={parts}")
  ids = collect(argv[2:])
  print("\n".join(ids[part::parts]))


if __name__ == "__main__":
  main(sys.argv[1:])
