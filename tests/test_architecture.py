"""The layers hold: the import contracts in pyproject.toml pass, no module of `tenon` reaches
itself through its imports, and the controller and policy code stay in short functions.

Function-level imports count (a lazy import is still a dependency); imports made only for
type checking do not (they run under no interpreter).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "tenon"
PACKAGES = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())
MAX_FUNCTION_LINES = 60
SHORT_FUNCTION_PACKAGES = ("policy", "runtime")


def test_import_contracts_pass() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("tenon", exclude_type_checking_imports=True, cache_dir=None)


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan,
    iterative: the graph is deep enough to matter for recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    work: list[tuple[str, Iterator[str]]] = []  # the depth-first path, each with what is left

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        work.append((module, iter(sorted(graph.find_modules_directly_imported_by(module)))))

    for root in sorted(graph.modules):
        if root in index:
            continue
        visit(root)
        while work:
            module, imported = work[-1]
            for target in imported:
                if target not in index:
                    visit(target)
                    break
                if target in on_stack:
                    low[module] = min(low[module], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[module])
                if low[module] == index[module]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == module:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))
    return components


def cycle_chain(graph: grimp.ImportGraph, component: list[str]) -> str:
    """One cycle through the component's first module, each import with its line."""
    first = component[0]
    for imported in sorted(graph.find_modules_directly_imported_by(first)):
        if imported not in component:
            continue
        back = graph.find_shortest_chain(importer=imported, imported=first)
        if back is None:
            continue
        chain = [first, *back]
        hops = []
        for importer, target in zip(chain, chain[1:], strict=False):
            lines = sorted(d["line_number"] for d in
                           graph.get_import_details(importer=importer, imported=target))
            hops.append(f"{importer} -> {target} (l.{', '.join(map(str, lines))})")
        return "\n  ".join(hops)
    return " <-> ".join(component)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(graph: grimp.ImportGraph, package: str) -> None:
    prefix = f"tenon.{package}."
    cycles = [cycle_chain(graph, c) for c in strongly_connected(graph)
              if any(m.startswith(prefix) for m in c)]
    assert not cycles, "import cycles:\n  " + "\n\n  ".join(cycles)


def test_cycle_finder_reports_a_chain() -> None:
    """The finder itself: a graph with one cycle of three and an acyclic tail."""
    graph = grimp.ImportGraph()
    for importer, imported in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=importer, imported=imported, line_number=1,
                         line_contents=f"import {imported}")
    assert strongly_connected(graph) == [["p.a", "p.b", "p.c"]]
    assert cycle_chain(graph, ["p.a", "p.b", "p.c"]) == (
        "p.a -> p.b (l.1)\n  p.b -> p.c (l.1)\n  p.c -> p.a (l.1)")


def long_functions(path: Path) -> list[str]:
    """`path:line name (N lines)` for every function longer than the limit."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                             f"({length} lines)")
    return found


@pytest.mark.parametrize("package", SHORT_FUNCTION_PACKAGES)
def test_functions_are_short(package: str) -> None:
    offenders = [f for path in sorted((SRC / package).rglob("*.py")) for f in long_functions(path)]
    assert not offenders, (f"functions over {MAX_FUNCTION_LINES} lines:\n  "
                           + "\n  ".join(offenders))
