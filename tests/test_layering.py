"""The layering rules of docs/architecture.md, read from the source (no imports executed).

- ``pallas_kernels`` imports nothing from ``jpaged``;
- inside ``jpaged``, no module imports the package face (``import jpaged`` /
  ``from jpaged import x``): each imports the module that defines what it needs;
- the module import graph of both packages has no cycle (imports inside functions count);
- no library, benchmark, tool or example module is over 600 lines (tests may be longer).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jpaged", "pallas_kernels")
MAX_LINES = 600


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``name`` imports (``from a import b`` counts ``a.b`` when that
    is a module, else ``a``)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) - {name} for name, path in mods.items()}


def test_kernels_import_nothing_from_jpaged():
    upward = {
        name: sorted(m for m in deps if m.split(".")[0] == "jpaged")
        for name, deps in _graph().items()
        if name.split(".")[0] == "pallas_kernels"
    }
    assert {k: v for k, v in upward.items() if v} == {}


def test_no_module_imports_the_package_face():
    face = {
        name: sorted(m for m in deps if m in PACKAGES)
        for name, deps in _graph().items()
        if name not in PACKAGES  # the faces themselves re-export
    }
    assert {k: v for k, v in face.items() if v} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_import_graph_has_no_cycle():
    # A package's __init__ importing its own submodules (re-exports) is not a cycle of jobs;
    # leave those edges out, keep every other.
    graph = {
        name: {d for d in deps if not (name in PACKAGES or d.startswith(name + "."))}
        for name, deps in _graph().items()
    }
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("folder", ["jpaged", "pallas_kernels", "benchmarks", "tools", "examples"])
def test_no_module_over_the_line_cap(folder):
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / folder).rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}
