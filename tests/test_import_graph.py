"""The package's structure: no import cycle, and a runtime that is a facade (issue 19).

Read from the source with ``ast``, not by importing: an import under
``if TYPE_CHECKING:`` or inside a function counts like any other, since a cycle
that only ``TYPE_CHECKING`` hides is still a cycle in the design.

* No import cycle between torpor's modules. ``from pkg import name`` is an
  import of ``pkg.name`` when that is a module, else of ``pkg``. A package is not
  counted as imported by its own submodules (Python runs ``pkg/__init__`` first,
  but that is the package's choice of what to export, not a dependency).
* Only ``torpor.runtime.host`` knows the Runtime's insides: no other module in
  ``torpor.runtime`` imports it, and no module but it reads or writes a private
  attribute (``rt._x``) of a runtime (the rule ``grep -nE "\\b(rt|runtime)\\._[a-z]"``
  checks, also in its ``self._rt._x`` form).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import torpor

ROOT = Path(torpor.__file__).resolve().parent
HOST = "torpor.runtime.host"
RUNTIME_NAMES = frozenset({"rt", "runtime", "_rt", "_runtime"})
"""What the runtime is called where it is held: ``rt``, ``runtime``, ``self._rt``..."""


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported torpor module, line) for every import statement in the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in known:
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package, up level - 1
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in known:
                    yield submodule, node.lineno
                elif source in known:
                    yield source, node.lineno


def graph() -> dict[str, dict[str, int]]:
    """module -> {imported module: line of its first import}."""
    known = modules()
    edges: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        out: dict[str, int] = {}
        for target, line in imports(name, path, known):
            if target != name:
                out.setdefault(target, line)
        edges[name] = out
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(edges[target]))))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
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
    return found


def one_cycle(component: list[str], edges: dict[str, dict[str, int]]) -> list[str]:
    """A shortest cycle through the component's first module (breadth first)."""
    members, start = set(component), component[0]
    came: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(edges[node]):
                if target not in members:
                    continue
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came[path[-1]])
                    return [*reversed(path), start]
                if target not in came:
                    came[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle in {component}")


def describe(component: list[str], edges: dict[str, dict[str, int]]) -> str:
    members = set(component)
    inside = [
        f"    {source} -> {target}  ({source.replace('.', '/')}.py:{line})"
        for source in component
        for target, line in sorted(edges[source].items())
        if target in members
    ]
    return "\n".join(
        [f"cycle: {' -> '.join(one_cycle(component, edges))}", "  imports among them:", *inside]
    )


def test_the_package_has_no_import_cycle() -> None:
    edges = graph()
    assert HOST in edges and "torpor.runtime.admin" in edges[HOST]  # the graph was read
    found = cycles(edges)
    assert not found, "import cycles (TYPE_CHECKING imports count):\n" + "\n".join(
        describe(component, edges) for component in found
    )


def test_the_cycle_finder_finds_a_cycle_a_type_checking_import_hides() -> None:
    # What the test above would report if a runtime part imported the host for its type.
    edges = graph()
    edges["torpor.runtime.admission"] = {**edges["torpor.runtime.admission"], HOST: 1}
    found = cycles(edges)
    assert any({HOST, "torpor.runtime.admission"} <= set(c) for c in found)
    text = describe(next(c for c in found if HOST in c), edges)
    assert "torpor.runtime.admission -> torpor.runtime.host" in text


def private_runtime_reads(path: Path) -> list[str]:
    """``rt._x``, ``runtime._x``, ``self._rt._x``...: a private attribute of a runtime."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__"):
            continue  # a dunder (``runtime.__aenter__()``) is public protocol
        held = node.value
        name = (
            held.id if isinstance(held, ast.Name)
            else held.attr if isinstance(held, ast.Attribute) else None
        )
        if name in RUNTIME_NAMES:
            found.append((node.lineno, ast.unparse(node)))
    return [f"{path.relative_to(ROOT.parent)}:{line}: {text}" for line, text in sorted(found)]


def test_only_the_host_module_knows_the_runtime_insides() -> None:
    edges = graph()
    importers = sorted(
        name for name, targets in edges.items()
        if HOST in targets and name.startswith("torpor.runtime.") and name != HOST
    )
    reads = [
        read
        for name, path in modules().items()
        if name != HOST
        for read in private_runtime_reads(path)
    ]
    assert not importers and not reads, (
        "runtime parts that import the host: " + ", ".join(importers)
        + "\nprivate attributes of a runtime read outside the host:\n" + "\n".join(reads)
    )
