"""The package against the layers table of docs/ARCHITECTURE.md: no circle, no import up or into the tools.

The table is read from the document, so the document and the code cannot drift. The
import graph is read from the source with :mod:`ast` (nothing is imported): one arrow
per module named by an import, at module level or inside a function; ``from
zerolearn import comm`` is an arrow to ``zerolearn.comm``, ``from zerolearn.dist import
ConfigError`` one to ``zerolearn.dist``; imports under ``if TYPE_CHECKING:`` are left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "zerolearn"
DOCUMENT = ROOT / "docs" / "ARCHITECTURE.md"
TOOLS = "tools"


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """The dotted name of the module in ``path``: ``zerolearn.memory.ledger``; a package's
    ``__init__.py`` is the package (``zerolearn.memory``)."""
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {module_name(p, package): p for p in sorted(package.rglob("*.py"))}


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _known(name: str, known) -> str:
    """``name`` itself if it is a module of the package, else the closest package above it."""
    while name not in known:
        name = name.rpartition(".")[0]
    return name


def imported(name: str, path: Path, known) -> set[str]:
    """The package's modules that module ``name`` (the file ``path``) imports, itself excluded.

    Raises:
        SyntaxError: the file does not parse.
    """
    top = name.split(".")[0]
    is_package = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(_known(a.name, known) for a in node.names if a.name.split(".")[0] == top)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            if source.split(".")[0] == top:
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    found.add(sub if sub in known else _known(source, known))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), filename=str(path)))
    found.discard(name)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules it imports, for every module of the package."""
    known = modules(package)
    return {name: imported(name, path, known) for name, path in known.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return sorted(found)


def layers(document: Path = DOCUMENT) -> list[tuple[str, list[str]]]:
    """(layer, module names) of every row of the table under ``## Layers``, in the document's order.

    Raises:
        ValueError: the document has no ``## Layers`` section with a table.
    """
    text = document.read_text()
    section = re.search(r"^## Layers\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    rows = [line for line in (section.group(1) if section else "").splitlines() if line.startswith("|")]
    if len(rows) < 3:
        raise ValueError(f"{document}: no table under '## Layers'")
    table = []
    for line in rows[2:]:  # after the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        table.append((cells[0].strip("`* "), re.findall(r"`(zerolearn(?:\.\w+)*)`", cells[1])))
    return table


def rows_of(module: str, table: list[tuple[str, list[str]]]) -> list[str]:
    """The rows ``module`` belongs to: those naming the most specific entry that covers it.

    An entry covers itself and, unless it is the top-level package, every module under it.
    """
    covering = [(entry, layer) for layer, entries in table for entry in entries
                if module == entry or ("." in entry and module.startswith(entry + "."))]
    if not covering:
        return []
    closest = max(len(entry) for entry, _ in covering)
    return [layer for entry, layer in covering if len(entry) == closest]


def layer_of(names, table: list[tuple[str, list[str]]]) -> dict[str, str]:
    """Module -> its layer, for every module of ``names`` that belongs to exactly one row."""
    return {m: rows[0] for m in names if len(rows := rows_of(m, table)) == 1}


def upward_arrows(graph: dict[str, set[str]], table: list[tuple[str, list[str]]]) -> list[str]:
    """``a -> b (layer -> layer)`` for every core module ``a`` importing a core module of a higher layer."""
    rank = {layer: i for i, (layer, _) in enumerate(table) if layer != TOOLS}
    where = layer_of(graph, table)
    return [f"{a} -> {b} ({where[a]} -> {where[b]})" for a in sorted(graph) for b in sorted(graph[a])
            if where.get(a) in rank and where.get(b) in rank and rank[where[b]] > rank[where[a]]]


def tool_arrows(graph: dict[str, set[str]], table: list[tuple[str, list[str]]]) -> list[str]:
    """``a -> b`` for every core module ``a`` importing a tool ``b``."""
    where = layer_of(graph, table)
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a])
            if where.get(a, TOOLS) != TOOLS and where.get(b) == TOOLS]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


@pytest.fixture(scope="module")
def table() -> list[tuple[str, list[str]]]:
    return layers()


def test_the_table_has_core_layers_and_the_tools_last(table):
    names = [layer for layer, _ in table]
    assert names[-1] == TOOLS and TOOLS not in names[:-1] and len(names) > 1, (
        f"{DOCUMENT.name}: the layers are {names}; the core's, bottom first, then one row {TOOLS!r}")
    assert len(set(names)) == len(names), f"{DOCUMENT.name}: a layer named twice in {names}"


def test_every_module_belongs_to_exactly_one_row(table):
    known = modules()
    unplaced = [m for m in known if not rows_of(m, table)]
    doubled = [f"{m} ({', '.join(rows)})" for m in known if len(rows := rows_of(m, table)) > 1]
    stale = [e for _, entries in table for e in entries
             if e not in known and not any(m.startswith(e + ".") for m in known)]
    assert not unplaced, f"modules in no row of {DOCUMENT.name}'s layers: {', '.join(unplaced)}"
    assert not doubled, f"modules in more than one row of {DOCUMENT.name}'s layers: {'; '.join(doubled)}"
    assert not stale, f"entries of {DOCUMENT.name}'s layers that name no module: {', '.join(stale)}"


def test_the_import_graph_has_no_circle(graph):
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_core_module_imports_a_tool(graph, table):
    arrows = tool_arrows(graph, table)
    assert not arrows, "core modules importing tools: " + "; ".join(arrows)


def test_no_core_module_imports_a_higher_layer(graph, table):
    arrows = upward_arrows(graph, table)
    assert not arrows, "core modules importing a higher layer: " + "; ".join(arrows)
