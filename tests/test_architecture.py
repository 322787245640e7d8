"""The import graph of planner/, probes/ and emit/ against the layering docs/architecture.md documents: no cycles,
no import of a higher layer, few function-local imports and each with its reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "probes", "emit")
#: function-local imports of project modules allowed in all (issue: at most 20, each deliberately lazy)
MAX_LOCAL_IMPORTS = 20


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(f): f for package in PACKAGES for f in (ROOT / package).rglob("*.py")}


def imports(path: Path, modules: dict[str, Path]):
    """(imported module, line, inside a function?) for every import of a project module in `path`."""
    tree = ast.parse(path.read_text())
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:  # `from a.b import c`: c is a module or a name in a.b
                name = name.rpartition(".")[0]
            if name:
                yield name, node.lineno, id(node) in inside


def layers() -> dict[str, int]:
    """docs/architecture.md's layer table: module pattern -> layer."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = {}
    for line in text.splitlines():
        row = re.match(r"\|\s*(\d+)\s*\|(.*)\|\s*$", line)
        if row:
            table.update({pattern: int(row.group(1)) for pattern in re.findall(r"`([\w.]+)`", row.group(2))})
    return table


def layer_of(module: str, table: dict[str, int]) -> int | None:
    matches = [p for p in table if module == p or module.startswith(p + ".")]
    return table[max(matches, key=len)] if matches else None


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: {target for target, _, _ in imports(path, modules) if target != m} for m, path in modules.items()}


def test_every_module_has_a_documented_layer():
    table = layers()
    assert len(table) >= 10
    assert [m for m in project_modules() if layer_of(m, table) is None] == []


def test_no_module_imports_a_higher_layer():
    table = layers()
    upward = [f"{m} (layer {layer_of(m, table)}) imports {t} (layer {layer_of(t, table)})"
              for m, targets in graph().items() for t in targets if layer_of(t, table) > layer_of(m, table)]
    assert upward == []


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_function_local_imports_are_few_and_say_why():
    modules = project_modules()
    local = [(path, line) for path in modules.values() for _, line, inside in imports(path, modules) if inside]
    unexplained = []
    for path, line in local:
        lines = path.read_text().splitlines()
        if not any("# lazy:" in lines[i] for i in (line - 2, line - 1) if 0 <= i < len(lines)):
            unexplained.append(f"{path.relative_to(ROOT)}:{line}")
    assert len(set(local)) <= MAX_LOCAL_IMPORTS
    assert unexplained == []
