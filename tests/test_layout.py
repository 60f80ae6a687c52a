"""The package's shape, checked with the project's own rules: no import cycles between modules
(lazy imports inside functions count too), no module over 500 lines, the README's layout
section naming only folders and modules that exist, and a README of at most 600 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "clipserve"
MAX_LINES = 500
MAX_README_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that `path` imports, wherever in the file the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from .x import y
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                # `from clipserve.http import health` imports a module; `from x import Name` not
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(path, name, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycles() -> None:
    graph = _graph()
    assert len(graph) > 50 and graph["clipserve.http.app"], "the graph must see the package"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_no_module_is_over_500_lines() -> None:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    assert len(lengths) > 60
    assert {p: n for p, n in lengths.items() if n > MAX_LINES} == {}


def test_the_readme_layout_names_what_exists() -> None:
    """Every path in the README's layout block exists, and every folder of the package is
    in it."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1]
    block = section.split("```", 2)[1]
    listed = re.findall(r"^\s*([\w./-]+/|[\w./-]+\.py)", block, re.M)
    assert listed, "no paths in the layout block"
    missing = [p for p in listed if not (ROOT / p).exists()]
    assert missing == []
    folders = {
        str(p.parent.relative_to(ROOT)) + "/"
        for p in PACKAGE.rglob("__init__.py")
        if p.parent != PACKAGE
    }
    assert folders - set(listed) == set()


def test_the_readme_is_at_most_600_lines() -> None:
    """The README is for users (issue 16): install, run, API, configuration, deployment and the
    headline benchmarks; the details live in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move detail to docs/"
