"""The house's layering, read from the source: no import circle anywhere in hetpeer (imports inside functions
count too: a circle of lazy imports still ties its modules together), the protocol imports nothing above it,
peer and coordinator never import each other, and the CLI's command modules import none of their siblings."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "hetpeer"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the hetpeer modules it imports. `from a.b import c` is an edge to a.b.c where that is a module,
    else to a.b; a package's own `__init__` is an edge only where it is named."""
    known = modules()

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(filter(None, (resolve(alias.name) for alias in node.names)))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in known else resolve(base))
        edges.discard(None)
        edges.discard(name)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_of_hetpeer_imports_itself_round_a_circle():
    graph = import_graph()
    assert "hetpeer.cli" in graph and "hetpeer.coordinator.planner.search" in graph  # the graph is read
    found = cycles(graph)
    assert not found, "import circles:\n" + "\n".join(
        " -> ".join(c) + "\n    " + "\n    ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c) for c in found)


def test_the_layers_hold():
    graph = import_graph()
    for module, imported in graph.items():
        if module.startswith("hetpeer.protocol"):
            above = {m for m in imported if m.startswith(("hetpeer.peer", "hetpeer.coordinator", "hetpeer.cli", "hetpeer.swarm"))}
            assert not above, f"{module} (protocol) imports {sorted(above)}"
        for one, other in (("hetpeer.peer", "hetpeer.coordinator"), ("hetpeer.coordinator", "hetpeer.peer")):
            if module.startswith(one):
                assert not {m for m in imported if m.startswith(other)}, f"{module} imports {other}"


def test_the_swarm_peer_sits_above_what_the_fixed_plan_peer_shares_with_it():
    # peer/daemon is the swarm peer (hetpeer join --swarm); the rest of peer/ serves both peers and needs none of it
    graph = import_graph()
    daemon = {m for m in graph if m.startswith("hetpeer.peer.daemon")}
    assert {"hetpeer.peer.daemon.peer", "hetpeer.peer.daemon.following", "hetpeer.peer.daemon.measure"} <= daemon
    for module, imported in graph.items():
        if module.startswith("hetpeer.peer.") and module not in daemon:
            assert not imported & daemon, f"{module} imports the swarm peer's {sorted(imported & daemon)}"
    assert not {m for m in graph if m.startswith("hetpeer.peer.") and m.count(".") == 2} & {
        "hetpeer.peer.announcing", "hetpeer.peer.following", "hetpeer.peer.handover", "hetpeer.peer.probing"}


def test_cli_command_modules_import_only_what_lies_below_them():
    graph = import_graph()
    families = {m for m in graph if m.startswith("hetpeer.cli.") and m not in ("hetpeer.cli.common", "hetpeer.cli.__main__")}
    assert {"hetpeer.cli.plan", "hetpeer.cli.peer", "hetpeer.cli.swarm", "hetpeer.cli.testbed"} <= families
    for family in families:
        siblings = graph[family] & (families | {"hetpeer.cli"})
        assert not siblings, f"{family} imports its siblings {sorted(siblings)}"
    assert not {m for m in graph["hetpeer.cli.common"] if m.startswith("hetpeer.cli")}
