"""The library's layout, read from its imports: one package per chapter plus `dtp.common`, no two
modules that import each other (directly or around a longer circle), and nothing in `dtp` that
imports the grader."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

CHAPTERS = ("memory", "dp", "tp", "pp", "ep", "zero", "overlap", "cp", "topology")  # reading order
# The memory chapter's calculator adds up what every later chapter shards (ZeRO's states among them).
LATER_CHAPTER_ALLOWED = {("dtp.memory.calculator", "zero"), ("dtp.memory.widgets", "zero")}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for package in ("dtp", "grader") for path in (REPO / package).rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The course modules `name` imports, at top level or inside functions (`from pkg import mod` counts
    as importing `pkg.mod` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` imports the module a.b.c
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that reach each other."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_import_circles(graph):
    circles = [group for group in strongly_connected(graph) if len(group) > 1]
    assert circles == []


def test_the_circle_finder_finds_a_circle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"], ["d"]]


def test_the_library_never_imports_the_grader(graph):
    assert {(name, target) for name, targets in graph.items() if name.startswith("dtp")
            for target in targets if target.startswith("grader")} == set()


def test_the_library_is_one_package_per_chapter_plus_common():
    top = REPO / "dtp"
    packages = sorted(entry.name for entry in top.iterdir() if (entry / "__init__.py").is_file())
    assert packages == sorted(CHAPTERS + ("common",))
    assert sorted(entry.name for entry in top.glob("*.py")) == ["__init__.py"]
    assert sorted(entry.name for entry in (REPO / "grader" / "checks").iterdir()
                  if entry.is_dir() and entry.name != "__pycache__") == sorted(set(CHAPTERS) - {"memory"})


def test_a_chapter_builds_on_common_and_earlier_chapters_only(graph):
    later = set()
    for name, targets in graph.items():
        parts = name.split(".")
        if parts[0] != "dtp" or len(parts) < 2 or parts[1] not in CHAPTERS:
            continue
        for target in targets:
            chapter = target.split(".")[1] if target.startswith("dtp.") and target.count(".") else None
            if chapter in CHAPTERS and CHAPTERS.index(chapter) > CHAPTERS.index(parts[1]) \
                    and (name, chapter) not in LATER_CHAPTER_ALLOWED:
                later.add((name, target))
    assert later == set()
