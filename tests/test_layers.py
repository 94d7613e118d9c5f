"""The engine's import graph: no cycle, counting the imports made inside functions.

``lint-imports`` (import-linter, configured in ``pyproject.toml``, run by ``.ci/run``) checks the
layers; this test checks what a layers contract with non-independent siblings cannot: that no two
modules of ``core/`` reach each other, even inside one layer. The graph is grimp's (the one
import-linter builds), which records every ``import`` statement wherever it is, functions included.
"""

from __future__ import annotations

import grimp
import pytest


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative).

    ``edges`` maps a module to the modules it imports. Returns each cycle's modules, sorted.
    """
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
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
                    components.append(sorted(component))
    return components


def test_cycle_finder_finds_a_cycle_and_only_cycles() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": set(), "f": {"f"}}
    assert strongly_connected(edges) == [["a", "b", "c"]]
    assert strongly_connected({"a": {"b"}, "b": set()}) == []


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("rlplug", cache_dir=None)


def test_core_import_graph_has_no_cycle(graph: grimp.ImportGraph) -> None:
    # the package's __init__ re-exports the public API from the modules below it: it is the top, and
    # a module importing ``rlplug`` itself would show here as a cycle through it
    modules = {m for m in graph.modules if not m.startswith(("rlplug.plugins", "rlplug.configs"))}
    edges = {m: {d for d in graph.find_modules_directly_imported_by(m) if d in modules} for m in modules}
    cycles = strongly_connected(edges)
    detail = []
    for cycle in cycles:
        for a in cycle:
            for b in sorted(edges[a] & set(cycle)):
                lines = [d["line_number"] for d in graph.get_import_details(importer=a, imported=b)]
                detail.append(f"{a}:{lines} -> {b}")
    assert not cycles, f"import cycles in core/ ({len(cycles)}): {cycles}\n" + "\n".join(detail)


def test_every_core_module_is_in_a_layer_of_the_import_contract(graph: grimp.ImportGraph) -> None:
    """A module left out of the ``layers`` contract in ``pyproject.toml`` would escape ``lint-imports``."""
    import tomllib
    from pathlib import Path

    config = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    placed = [m.strip() for layer in layers for m in layer.replace("|", ":").split(":")]
    assert len(placed) == len(set(placed)), "a module is in two layers"
    modules = {
        m
        for m in graph.modules
        if m != "rlplug" and not m.startswith(("rlplug.plugins", "rlplug.configs")) and m.count(".") == 1
    }
    assert sorted(modules - set(placed)) == [], "modules of core/ in no layer of pyproject.toml's contract"
    assert sorted(set(placed) - modules) == [], "layers name modules that do not exist"
