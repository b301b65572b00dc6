"""The host-free core's modules import one another without a circle: every import of a module of
``tokenreduce/`` (at the top, in a function or under ``TYPE_CHECKING``) is an edge, read from the
source with ``ast``; the graph they make has no cycle, so each piece lives in one place and the
modules load in one order."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

PACKAGE = "tokenreduce"


def _modules() -> dict[str, Path]:
    """'tokenreduce.run' -> its file; a package is named by its ``__init__.py``."""
    modules = {}
    for path in sorted((REPO / PACKAGE).rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that the module ``name`` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:  # `from . import run` imports the module run
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {module for module in found if module in modules and module != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph, as the modules along it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_type_checking_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .run import RunState\n"
    (tmp_path / "describe.py").write_text(source, encoding="utf-8")
    modules = {"tokenreduce.describe": tmp_path / "describe.py", "tokenreduce.run": tmp_path / "run.py"}
    assert _imports("tokenreduce.describe", modules["tokenreduce.describe"], modules) == {"tokenreduce.run"}


def test_the_core_modules_import_one_another_without_a_circle():
    modules = _modules()
    assert "tokenreduce.run" in modules and "tokenreduce.families" in modules
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "tokenreduce.describe" in graph["tokenreduce.run"] or "tokenreduce.run" in graph["tokenreduce.describe"]
    cycle = _cycle(graph)
    assert cycle is None, "the modules of tokenreduce/ import one another in a circle: " + " -> ".join(cycle)
