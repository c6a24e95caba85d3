"""tools/test_part.py: its N parts are disjoint and together the whole collection.
tools/ext_stamp.sh: the digest that matches prebuilt extensions to a tree."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _part(k: int, n: int, *args: str) -> list[str]:
  out = subprocess.run([sys.executable, "tools/test_part.py", str(k), str(n), *args], cwd=ROOT,
                       capture_output=True, text=True, check=True)
  return out.stdout.splitlines()


def test_parts_cover_the_collection_once():
  files = ("test_export.py", "test_heuristics.py")
  whole = _part(0, 1, *files)
  assert len(whole) > 10 and all("::" in t for t in whole)
  parts = [_part(k, 3, *files) for k in range(3)]
  assert sorted(sum(parts, [])) == sorted(whole)
  assert all(abs(len(p) - len(whole) / 3) < 1 for p in parts)


def test_part_out_of_range_fails():
  out = subprocess.run([sys.executable, "tools/test_part.py", "3", "3"], cwd=ROOT,
                       capture_output=True, text=True, check=False)
  assert out.returncode != 0 and "0 <= K < N" in out.stderr


def test_left_lists_the_ids_without_a_result(tmp_path):
  ids = ["a.py::t[x]", "a.py::t[y z]", "b.py::u", "b.py::v"]
  (tmp_path / "ids.txt").write_text("\n".join(ids) + "\n")
  (tmp_path / "one.log").write_text("[gw3] [ 10%] PASSED a.py::t[y z] \n"
                                    "[gw1] [ 20%] FAILED b.py::u\n")
  (tmp_path / "two.log").write_text("a.py::t[x] SKIPPED (no GPU)\nb.py::v\n")
  out = subprocess.run([sys.executable, "tools/test_part.py", "--left", str(tmp_path / "ids.txt"),
                        str(tmp_path / "one.log"), str(tmp_path / "two.log")],
                       cwd=ROOT, capture_output=True, text=True, check=True)
  assert out.stdout.splitlines() == ["b.py::v"]


def test_ext_stamp_follows_the_sources(tmp_path):
  """The digest changes with a source file and with nothing outside src/ and
  CMakeLists.txt."""
  shutil.copytree(ROOT / "src", tmp_path / "src")
  shutil.copy(ROOT / "CMakeLists.txt", tmp_path)
  (tmp_path / "tools").mkdir()
  shutil.copy(ROOT / "tools" / "ext_stamp.sh", tmp_path / "tools")

  def stamp() -> str:
    out = subprocess.run(["bash", str(tmp_path / "tools" / "ext_stamp.sh")], capture_output=True,
                         text=True, check=True)
    return out.stdout.strip()

  first = stamp()
  assert len(first) == 16 and first == stamp()
  (tmp_path / "README.md").write_text("not a source\n")
  assert stamp() == first
  with open(tmp_path / "src" / "plan.h", "a") as f:
    f.write("// a change\n")
  assert stamp() != first
