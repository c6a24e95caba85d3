"""The package's modules import in one direction: no import cycle.

Two checks: the import graph read from the sources (every `from jax_flash2
import x` / `import jax_flash2.x` at module level, lazy imports inside
functions included) has no cycle, and every module imports on its own in a
fresh interpreter, first of the package's modules to load.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import jax_flash2

PACKAGE = pathlib.Path(jax_flash2.__file__).parent
ROOT = PACKAGE.parent


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> source file, for every module of the package."""
  modules = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    modules[".".join(parts)] = path
  return modules


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
  """The package modules `name` imports (a package's own __init__ is not an edge
  of its submodules: importing a.b runs a/__init__ first, which is no cycle
  unless a/__init__ imports a.b back, and that is recorded from a's side)."""
  found = set()
  package = name if path.name == "__init__.py" else name.rpartition(".")[0]
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                        + ([base] if base else []))
      found.add(base)
      found.update(f"{base}.{alias.name}" for alias in node.names)
  return {m for m in found if m in modules and m != name and not name.startswith(m + ".")}


def test_import_graph_has_no_cycle():
  modules = _modules()
  graph = {name: _imports(name, path, modules) for name, path in modules.items()}
  assert "jax_flash2._autodiff" in graph and "jax_flash2._config" in graph
  state = {}

  def visit(node, stack):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        cycle = stack[stack.index(nxt):] + [nxt]
        pytest.fail("import cycle: " + " -> ".join(cycle))
      if nxt not in state:
        visit(nxt, stack + [nxt])
    state[node] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])


def test_layers_import_downwards_only():
  """api -> _autodiff -> _sharding -> _primitives -> _lowering -> _ext; the
  config, scores and reference modules never import an upper layer."""
  modules = _modules()
  graph = {name: _imports(name, path, modules) for name, path in modules.items()}
  order = ["api", "_autodiff", "_sharding", "_primitives", "_lowering", "_ext"]
  for i, upper in enumerate(order):
    for lower in order[i + 1:]:
      assert f"jax_flash2.{upper}" not in graph[f"jax_flash2.{lower}"], (lower, upper)
  for base in ("_config", "_scores", "reference", "_blockwise"):
    for upper in ("api", "_autodiff", "_sharding", "_primitives"):
      assert f"jax_flash2.{upper}" not in graph[f"jax_flash2.{base}"], (base, upper)


@pytest.mark.parametrize("module", sorted(
    m for m in _modules() if not m.startswith("jax_flash2.flax")) + ["jax_flash2.flax"])
def test_each_module_imports_first_in_a_fresh_interpreter(module):
  if module == "jax_flash2.flax":
    pytest.importorskip("flax")
  result = subprocess.run(
      [sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True, text=True,
      env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
      timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
