"""The package's modules import downwards only: no import cycle, whatever module a program imports
first, and no module reaches into another's private names.

The graph comes from the source (every import statement, function-level ones included): a cycle is
a defect even where the current import order happens to hide it. Importing ``a.b.c`` from outside
``a.b`` runs ``a/b/__init__.py`` too, so such an import also depends on that package.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import dsv4jit

ROOT = Path(dsv4jit.__file__).parent
PACKAGE = "dsv4jit"


def module_files() -> dict[str, Path]:
    """Module name -> file of every module of the package (packages by their ``__init__``)."""
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = (PACKAGE, *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


MODULES = module_files()


def _package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[tuple[str, list[str]]]:
    """(imported module of the package, names taken from it) of one import statement."""
    if isinstance(node, ast.Import):
        return [(a.name, []) for a in node.names if a.name.split(".")[0] == PACKAGE]
    if node.level:
        base = _package_of(module).split(".")
        base = base[:len(base) - node.level + 1]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != PACKAGE:
        return []
    found = []
    for alias in node.names:  # `from pkg import sub` imports the module pkg.sub
        sub = f"{source}.{alias.name}"
        found.append((sub, []) if sub in MODULES else (source, [alias.name]))
    return found


def imports() -> dict[str, list[tuple[str, list[str], int]]]:
    """Module -> (module it imports, names taken from it, line) for every import in its source."""
    graph = {}
    for module, path in MODULES.items():
        edges = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges += [(target, names, node.lineno) for target, names in _targets(module, node)]
        graph[module] = edges
    return graph


def dependencies(module: str, target: str) -> list[str]:
    """What importing `target` from `module` runs: the target and every package above it that
    `module` is not itself part of (its own packages are initialising already)."""
    parts = target.split(".")
    outer = [".".join(parts[:i]) for i in range(2, len(parts))]
    return [p for p in outer if not module.startswith(p + ".")] + [target]


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_scan_sees_the_package():
    """The graph is built from real edges: a few that exist must be found (a scan that finds
    nothing would pass the tests below vacuously)."""
    edges = {m: {t for t, _, _ in e} for m, e in imports().items()}
    assert "dsv4jit.ops.common" in edges["dsv4jit.ops.compress"]
    assert "dsv4jit.geometry" in edges["dsv4jit.reference.compress"]
    assert "dsv4jit.jit.loader" in edges["dsv4jit.runtime"]
    assert dependencies("dsv4jit.compat", "dsv4jit.ops.common") == ["dsv4jit.ops", "dsv4jit.ops.common"]
    assert dependencies("dsv4jit.ops.fused", "dsv4jit.ops.common") == ["dsv4jit.ops.common"]


def test_find_cycle_reports_a_cycle():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_no_import_cycle():
    graph = {m: sorted({d for t, _, _ in e for d in dependencies(m, t) if d != m}) for m, e in imports().items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_takes_another_modules_private_names():
    taken = [f"{m}:{line} takes {name} from {t}" for m, e in imports().items() for t, names, line in e
             for name in names if name.startswith("_") and not name.startswith("__")]
    assert taken == []


def test_every_module_imports():
    """Each module imports (in one fresh interpreter, in name order; the entry point excepted)."""
    names = [m for m in MODULES if m != "dsv4jit.__main__"]
    code = "import importlib, json, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\nprint(json.dumps(len(sys.argv) - 1))"
    res = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == len(names)
