"""Imports point one way: the layers of pyproject.toml's [tool.importlinter], and no import cycle.

Every import counts: module level, inside functions and under TYPE_CHECKING
(a lower layer that must call up gets a callable or a Protocol of its own).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]


def _lint_imports() -> str:
    path = Path(sys.executable).with_name("lint-imports")
    if not path.exists():
        pytest.fail("lint-imports is not installed: ./scripts/setup installs it with the test extra")
    return str(path)


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("nan_magic", exclude_type_checking_imports=False, cache_dir=None)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's, iterative)."""
    edges = {module: sorted(graph.find_modules_directly_imported_by(module)) for module in sorted(graph.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in edges:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            node, position = work.pop()
            if position == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            children = edges[node]
            if position < len(children):
                work.append((node, position + 1))
                child = children[position]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_type_checking_and_function_level_imports_count() -> None:
    assert CONFIG["exclude_type_checking_imports"] is False
    graph = _graph()
    # One import of each kind the graph must hold: one made only under TYPE_CHECKING (a call record's
    # RNG state type), one made only inside a function (the extension's magics, imported on %load_ext).
    assert graph.direct_import_exists(importer="nan_magic.hot.kept.call_records", imported="nan_magic.hot.kept.rng")
    assert graph.direct_import_exists(importer="nan_magic", imported="nan_magic.ipython.magics")


def test_the_import_contracts_hold() -> None:
    result = subprocess.run(
        [_lint_imports(), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_every_module_has_a_layer() -> None:
    layers = {
        name.strip()
        for contract in CONFIG["contracts"] if contract["type"] == "layers"
        for layer in contract["layers"]
        for name in re.split(r"[|:]", layer)
    }

    def placed(module: str) -> bool:
        # In a layer, inside one, or a package that only holds layers (scene/).
        return any(module == layer or module.startswith(layer + ".") or layer.startswith(module + ".")
                   for layer in layers)

    # A new module outside every layer would escape the contract: give it one in pyproject.toml.
    assert sorted(module for module in _graph().modules if module != "nan_magic" and not placed(module)) == []


def test_every_module_inside_a_layered_package_has_a_layer_there() -> None:
    graph = _graph()
    unplaced = []
    for contract in CONFIG["contracts"]:
        names = [name.strip() for layer in contract.get("layers", []) for name in re.split(r"[|:]", layer)]
        for container in contract.get("containers", []):
            layers = [f"{container}.{name}" for name in names]
            unplaced += [module for module in graph.find_descendants(container)
                         if not any(module == layer or module.startswith(layer + ".") for layer in layers)]
    # A new module in hot/ or localize/ outside the contract's layers would escape the order inside it.
    assert sorted(unplaced) == []


def test_no_import_cycle_among_the_package_modules() -> None:
    graph = _graph()
    # The layers contract's known upward imports (pyproject.toml) are the only ones allowed to close a cycle.
    for contract in CONFIG["contracts"]:
        for ignored in contract.get("ignore_imports", []):
            importer, imported = (part.strip() for part in ignored.split("->"))
            graph.remove_import(importer=importer, imported=imported)
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(module)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert _cycles(graph) == [["a.x", "a.y"]]
