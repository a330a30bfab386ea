"""Imports point down only (docs/design.md): no module of the project imports one that imports it back,
counting lazy imports inside functions and those under TYPE_CHECKING, and model / data never import the engine."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the folders that install as syncseg.<name>; model/sync_batchnorm's own tests are not the project's code
FOLDERS = {"syncseg/engine": "syncseg.engine", "syncseg/commands": "syncseg.commands", "model": "syncseg.model",
           "data": "syncseg.data"}


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "tests" in parts or "build" in parts:
                continue
            name = ".".join((package, *parts[:-1], *(() if parts[-1] == "__init__" else parts[-1:])))
            imported = set()
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("syncseg"):
                    imported.add(node.module)
                elif isinstance(node, ast.Import):
                    imported |= {alias.name for alias in node.names if alias.name.startswith("syncseg")}
            graph[name] = imported
    return graph


def _a_circle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(path: list[str]) -> list[str] | None:
        for imported in sorted(graph.get(path[-1], ())):
            if imported in path:
                return path[path.index(imported):] + [imported]
            if imported not in done:
                found = visit(path + [imported])
                if found:
                    return found
        done.add(path[-1])
        return None

    for name in graph:
        found = None if name in done else visit([name])
        if found:
            return found
    return None


def test_no_module_imports_one_that_imports_it_back():
    assert _a_circle(_import_graph()) is None


def test_model_and_data_import_neither_the_engine_nor_the_commands():
    graph = _import_graph()
    below = ("syncseg.model", "syncseg.data")
    assert not {(name, imported) for name, imports in graph.items() if name.startswith(below)
                for imported in imports if imported.startswith(("syncseg.engine", "syncseg.commands"))}
