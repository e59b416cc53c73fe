"""The package's import structure: no import cycle between modules or packages, and every package
imports only packages below it. Every import counts: module-level, inside functions, under TYPE_CHECKING."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "exporter" / "trainpatrol"

ENTRY_POINTS = frozenset({"cli", "demo", "stack", "__main__"})
LEAVES = frozenset({"protocol", "handshake", "catalogue", "actions", "faults", "shipped", "_version", "_torch",
                    "_process", "loader_audit", "__init__"})
ORDER = ("leaves", "report", "collectors", "agent", "control", "probe", "integrations", "entry points")
"""Lowest first: a package may import only those before it (entry points among themselves and leaves among
themselves too, as long as no cycle forms)."""



def module_name(path: Path) -> str:
    parts = ["trainpatrol", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The trainpatrol modules ``name`` imports, anywhere in its file. ``from pkg import x`` names the
    module ``pkg.x`` when there is one, else ``pkg`` itself."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in MODULES else source for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in MODULES and t != name)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_of(package: str) -> str:
    if package in ENTRY_POINTS:
        return "entry points"
    if package in LEAVES:
        return "leaves"
    return package


def edges() -> set[tuple[str, str]]:
    return {(a, b) for a, targets in GRAPH.items() for b in targets}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    return ", ".join(f"{a} → {b}" for a in component for b in sorted(graph[a] & members))


def test_every_module_belongs_to_a_layer() -> None:
    packages = {package_of(m) for m in MODULES}
    assert {layer_of(p) for p in packages} <= set(ORDER), sorted(p for p in packages if layer_of(p) not in ORDER)


def test_no_module_imports_form_a_cycle() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for a, b in edges():
        graph[a].add(b)
    found = cycles(graph)
    assert not found, "import cycles: " + " | ".join(describe(c, graph) for c in found)


def test_no_package_imports_form_a_cycle() -> None:
    graph: dict[str, set[str]] = {}
    via: dict[tuple[str, str], str] = {}
    for a, b in sorted(edges()):
        pa, pb = package_of(a), package_of(b)
        if pa != pb and "__init__" not in (pa, pb):  # the root only re-exports (Patrol lazily)
            graph.setdefault(pa, set()).add(pb)
            via.setdefault((pa, pb), f"{a} → {b}")
    found = cycles(graph)
    assert not found, "package cycles: " + " | ".join(
        ", ".join(via[(a, b)] for a in c for b in sorted(graph.get(a, set()) & set(c))) for c in found)


def allowed(importer: str, imported: str) -> bool:
    pa, pb = package_of(importer), package_of(imported)
    if pa == pb or pa == "__init__":  # within a package; the root exports Patrol lazily
        return True
    la, lb = layer_of(pa), layer_of(pb)
    if la == lb:
        return la in ("entry points", "leaves")
    return ORDER.index(lb) < ORDER.index(la)


def test_packages_import_only_packages_below_them() -> None:
    upward = sorted(f"{a} → {b}" for a, b in edges() if not allowed(a, b))
    assert not upward, "imports of a package above (or beside) the importer: " + "; ".join(upward)


@pytest.mark.parametrize(("importer", "imported"), [
    ("trainpatrol.control.executor", "trainpatrol.probe.patrol"),
    ("trainpatrol.protocol", "trainpatrol.control.checkpoint"),
    ("trainpatrol.report.story", "trainpatrol.control.coordinator"),
])
def test_an_upward_import_is_named(importer: str, imported: str) -> None:
    assert not allowed(importer, imported)


def test_a_cycle_is_named_by_its_imports() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    found = cycles(graph)
    assert found == [["a", "b", "c"]]
    assert describe(found[0], graph) == "a → b, b → c, c → a"
