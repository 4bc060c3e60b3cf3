"""The package layout's rules (docs/design.md): no import circle between modules of `engines/` or
`deployments/`, and `engines/` never imports `deployments/` (engines are plain Python, usable
without Ray Serve). Imports inside functions count: a lazy import only hides a circle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engines", "deployments")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
            if "__pycache__" not in p.parts}


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports anywhere in it: `import a.b`, `from a.b import c` (the
    module `a.b.c` where it is one, else `a.b`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                     for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) - {name} for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def engines_importing_deployments(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    """Modules of `engines` -> the modules of `deployments` they import (only those that do)."""
    wrong = {name: sorted(m for m in deps if m.split(".")[0] == "deployments")
             for name, deps in graph.items() if name.split(".")[0] == "engines"}
    return {name: deps for name, deps in wrong.items() if deps}


def test_no_import_circle_between_modules():
    assert cycles(import_graph()) == []


def test_engines_never_import_deployments():
    assert engines_importing_deployments(import_graph()) == {}


def test_the_checks_see_a_circle_and_a_wrong_way_import():
    graph = {"engines.a": {"engines.b"}, "engines.b": {"engines.a"}, "engines.c": {"deployments.x"},
             "deployments.x": set()}
    assert cycles(graph) == [["engines.a", "engines.b"]]
    assert engines_importing_deployments(graph) == {"engines.c": ["deployments.x"]}
    source = ROOT / "engines" / "base.py"
    assert "engines.errors" in imports_of(source, set(modules()))
