"""The package's layers only look down, and no modules or packages import each other.

Read from the source (every import, function-level ones included), so an import hidden inside
a function counts as much as one at the top of a module.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import jaxdist

PACKAGE = Path(jaxdist.__file__).parent

# Bottom to top, as jaxdist/__init__.py draws them. A module may import its own package and any
# lower layer; packages that share a layer do not import each other.
LAYERS = (
    ("checks",),
    ("ring_order",),
    ("meshes",),
    ("comm",),
    ("runtime",),
    ("models", "data"),
    ("training",),
    ("pipeline",),
    ("tasks",),
    ("run",),
    ("aot", "bench"),
    ("cli",),
    ("__main__",),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the jaxdist modules it imports. ``from P import N`` counts as importing the
    module ``P.N`` when there is one, else ``P``; parent packages imported on the way are not
    counted (Python runs their ``__init__`` but the code does not depend on it)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    targets.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _part(module: str) -> str:
    """The layer part a module belongs to: ``jaxdist.comm.hybrid`` -> ``comm``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "jaxdist"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = itertools.count()

    def visit(node):
        index[node] = low[node] = next(counter)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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


def test_every_package_has_a_layer():
    parts = {_part(m) for m in import_graph()} - {"jaxdist"}
    assert parts <= set(RANK), f"packages without a layer: {sorted(parts - set(RANK))}"


def test_imports_only_look_down():
    upward = []
    for module, targets in import_graph().items():
        source = _part(module)
        for target in targets:
            goal = _part(target)
            if goal == source or goal == "jaxdist":
                continue
            if source == "jaxdist" or RANK[goal] >= RANK[source]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports that do not look down:\n" + "\n".join(sorted(upward))


def test_no_module_cycles():
    assert _cycles(import_graph()) == []


def test_no_package_cycles():
    packages: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        packages.setdefault(_part(module), set()).update(_part(t) for t in targets)
    for name, targets in packages.items():
        targets.discard(name)
    assert _cycles(packages) == []


def test_the_checks_catch_an_upward_import_and_a_cycle():
    graph = {"jaxdist.comm.a": {"jaxdist.run.b"}, "jaxdist.run.b": {"jaxdist.comm.a"}}
    assert _cycles(graph) == [["jaxdist.comm.a", "jaxdist.run.b"]]
    assert RANK[_part("jaxdist.run.b")] > RANK[_part("jaxdist.comm.a")]
