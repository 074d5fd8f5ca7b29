"""The import graph of ``selfrl/``, read from the source (``ast``), and its figures.

    python scripts/import_graph.py [--package selfrl] [--floor-map map.json] [--top 5]

Prints the import circles (strongly connected components of more than one module), every
import that runs from a lower floor back up to a higher one, and the largest modules and
classes. ``tests/test_import_graph.py`` asserts on the same functions.

What counts as an import of module ``a`` by module ``b``:

* every ``import``/``from ... import`` statement in ``b``, at module level or inside a
  function (a lazy import still needs ``a`` at run time, so it still ties the two), except
  those under ``if TYPE_CHECKING:`` (never run);
* ``from p import x`` imports ``p.x`` when that is a module, else ``p``;
* importing ``p.q.m`` also runs ``p/__init__.py`` and ``p/q/__init__.py``: those are edges
  too, unless the package encloses ``b`` (then it is already running when ``b`` runs).

Modules loaded by name at run time (``importlib.import_module``: plug-ins such as a user's
environment by dotted path, or ``selfrl.envs.builtin``'s list) are not edges.

The floors, bottom first, are :data:`FLOORS` (the data flow of ``STYLE.md``); a module's
floor is that of the first package in the list that holds it. ``--floor-map`` maps module
names (or prefixes) of another layout to floor names, to measure an older tree the same way.
"""

from __future__ import annotations

import argparse
import ast
import json
from dataclasses import dataclass
from pathlib import Path

# Bottom floor first; each should import only from its own floor and those below.
FLOORS = (
    "selfrl",  # the package's own __init__: a docstring and the version
    "selfrl.core",
    "selfrl.model",
    "selfrl.chat",
    "selfrl.record",
    "selfrl.engines",
    "selfrl.config",
    "selfrl.rl",
    "selfrl.rollout",
    "selfrl.safety",
    "selfrl.envs",
    "selfrl.judge",  # rewards where no verifier exists: it registers a reward and detectors
    "selfrl.simulate",  # simulated users: clients of a server, built on the environments
    "selfrl.report",
    "selfrl.run",
    "selfrl.serve",
    "selfrl.testing",  # tiny models for tests and benchmarks: nothing in the package imports it
    "selfrl.cli",
)
# Folders under the package that hold data (fixture repositories), not selfrl modules.
SKIP_DIRS = ("swe-repos",)


@dataclass(frozen=True)
class Edge:
    """``source`` imports ``target`` at ``line`` (``lazy``: inside a function or method;
    ``implicit``: ``target`` is a package whose ``__init__`` the import runs on the way)."""

    source: str
    target: str
    line: int
    lazy: bool
    implicit: bool = False


def module_files(package: Path) -> dict[str, Path]:
    """``{dotted module name: path}`` for every ``.py`` file of ``package`` (a folder)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        if any(part in SKIP_DIRS for part in rel.parts):
            continue
        parts = rel.with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module):
    """``(node, lazy)`` for each import statement outside ``if TYPE_CHECKING:`` blocks."""

    def walk(node: ast.AST, lazy: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    yield from walk(ast.Module(body=[sub], type_ignores=[]), lazy)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, lazy
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from walk(child, inner)

    yield from walk(tree, False)


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _packages_run(target: str, source: str) -> list[str]:
    """The packages whose ``__init__`` importing ``target`` runs, less those enclosing ``source``."""
    parts = target.split(".")
    out = []
    for i in range(1, len(parts)):
        pkg = ".".join(parts[:i])
        if not (source == pkg or source.startswith(pkg + ".")):
            out.append(pkg)
    return out


def import_edges(package: Path) -> list[Edge]:
    """Every import of a module of ``package`` by another (see the module docstring)."""
    modules = module_files(package)
    root = package.name
    edges: list[Edge] = []
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]
        for node, lazy in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                candidates = [[a.name] for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = here.split(".")
                    up = up[:len(up) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                candidates = [[f"{base}.{a.name}", base] for a in node.names]
            for options in candidates:
                if not options[0].split(".")[0] == root:
                    continue
                target = next((t for t in options if t in modules), None) or _resolve(options[-1], modules)
                if target is None or target == name:
                    continue
                for pkg in _packages_run(target, name):
                    if pkg in modules and pkg != name:
                        edges.append(Edge(name, pkg, node.lineno, lazy, implicit=True))
                edges.append(Edge(name, target, node.lineno, lazy))
    return edges


def graph_of(edges: list[Edge], modules) -> dict[str, set[str]]:
    """``{module: {modules it imports}}``, every module a key."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for e in edges:
        graph[e.source].add(e.target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted;
    largest first. An empty list means the graph has no circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0

    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out, key=lambda c: (-len(c), c))


def floor_of(module: str, floor_map: dict[str, str] | None = None) -> int:
    """The index in :data:`FLOORS` of ``module``'s floor (``floor_map`` first: module or
    prefix -> floor name, for another layout).

    >>> FLOORS[floor_of("selfrl.rl.losses")], FLOORS[floor_of("selfrl.cli")]
    ('selfrl.rl', 'selfrl.cli')
    """
    if floor_map:
        name = module
        while name:
            if name in floor_map:
                return FLOORS.index(floor_map[name])
            name = name.rpartition(".")[0]
    best = 0
    for i, f in enumerate(FLOORS):
        if module == f or module.startswith(f + "."):
            if len(f) >= len(FLOORS[best]):
                best = i
    return best


def upward(edges: list[Edge], floor_map: dict[str, str] | None = None) -> list[Edge]:
    """The imports from a lower floor to a higher one, each (source, target) once. A package
    ``__init__`` run on the way is left out: the import names a module there, counted itself."""
    seen, out = set(), []
    for e in edges:
        if not e.implicit and floor_of(e.target, floor_map) > floor_of(e.source, floor_map) and (e.source, e.target) not in seen:
            seen.add((e.source, e.target))
            out.append(e)
    return out


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module importing ``start`` runs, directly or through others (``start`` excluded)."""
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen and nxt != start:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def sizes(package: Path) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``(modules, classes)``: ``(lines, name)`` of every module and every class, largest first."""
    mods, classes = [], []
    for name, path in module_files(package).items():
        text = path.read_text()
        mods.append((len(text.splitlines()), name))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                classes.append((node.end_lineno - node.lineno + 1, f"{name}.{node.name}"))
    return sorted(mods, reverse=True), sorted(classes, reverse=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--package", default=str(Path(__file__).resolve().parents[1] / "selfrl"))
    p.add_argument("--floor-map", help="JSON {module or prefix: floor name} for another layout")
    p.add_argument("--top", type=int, default=5, help="largest modules and classes to list")
    a = p.parse_args()
    package = Path(a.package)
    floor_map = json.loads(Path(a.floor_map).read_text()) if a.floor_map else None
    modules = module_files(package)
    edges = import_edges(package)
    graph = graph_of(edges, modules)
    found = circles(graph)
    up = upward(edges, floor_map)
    mods, classes = sizes(package)
    top_level = [m for m in modules if m.count(".") == 1 and modules[m].name != "__init__.py"]
    print(f"{len(modules)} modules, {sum(n for n, _ in mods)} lines, {len(top_level)} at the top level; "
          f"{len({(e.source, e.target) for e in edges})} imports between them")
    print(f"circles: {len(found)}" + "".join(f"\n  {len(c)}: {', '.join(c)}" for c in found))
    print(f"imports that run back up a floor: {len(up)}")
    for e in up:
        print(f"  {e.source}:{e.line} -> {e.target}{' (in a function)' if e.lazy else ''}")
    print("largest modules: " + ", ".join(f"{name} {n}" for n, name in mods[:a.top]))
    print("largest classes: " + ", ".join(f"{name} {n}" for n, name in classes[:a.top]))


if __name__ == "__main__":
    main()
