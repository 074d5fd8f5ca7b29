"""No import cycle in ``selfrl/``: the graph of module-level imports between selfrl modules
is acyclic. (An import inside a function runs when it is called, after every module has
loaded; those are how a module reaches a heavier one lazily and are not edges here.)"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "selfrl"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """``{module: {selfrl modules it imports at module level}}`` for every module of the package."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.parse(path.read_text()).body:  # module level only
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                if t and t.startswith("selfrl") and t != name:
                    edges.add(t)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_selfrl():
    graph = import_graph()
    assert {"selfrl.loop", "selfrl.versions", "selfrl.cycle", "selfrl.serve.background"} <= set(graph)
    assert "selfrl.config" in graph["selfrl.learner"]  # the graph sees real edges
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_config_imports_only_the_engine_registry_at_load():
    graph = import_graph()
    assert graph["selfrl.config"] <= {"selfrl.config_base", "selfrl.config_remote", "selfrl.config_judge",
                                      "selfrl.engines", "selfrl.engines.base"}
    assert graph["selfrl.config_base"] == set()  # the rules every table uses: nothing of selfrl
    assert graph["selfrl.config_remote"] == {"selfrl.config_base"}
    assert graph["selfrl.config_judge"] == {"selfrl.config_base"}  # the judge's values, never the judge itself
