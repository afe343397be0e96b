"""Reading a learner's notebook (never writing it) and taking its graded definitions out of it.

Graded definitions are the top-level imports, functions and classes of the code cells, plus the
assignments that they need: to UPPER_CASE constants, to the answer names a chapter declares, and
to any name that a kept function, class or assignment reads (`chunk_count = 4` used inside a
function). Everything else (demo calls, plots, `check(...)` lines, training loops whose results
nothing reads) is left out, so grading does not re-run a learner's experiments.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

import nbformat


class UnusableInput(Exception):
    """The input cannot be graded at all (missing file, not a notebook, unknown chapter)."""


def read_notebook(path: str | Path) -> nbformat.NotebookNode:
    """Read and validate a notebook; raise UnusableInput with a one-line reason otherwise."""
    path = Path(path)
    if not path.exists():
        raise UnusableInput(f"{path}: no such file")
    if not path.is_file():
        raise UnusableInput(f"{path}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnusableInput(f"{path}: not a notebook (not valid JSON: {exc})") from None
    if not isinstance(raw, dict) or "cells" not in raw or "nbformat" not in raw:
        raise UnusableInput(f"{path}: not a notebook (JSON without 'cells' and 'nbformat')")
    try:
        notebook = nbformat.reads(text, as_version=4)
        nbformat.validate(notebook)
    except Exception as exc:  # nbformat raises several unrelated types for broken files
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnusableInput(f"{path}: not a valid notebook ({first_line[:200]})") from None
    return notebook


def notebook_chapter(notebook: nbformat.NotebookNode) -> str | None:
    """The chapter a notebook belongs to, from the metadata the course writes into every notebook."""
    chapter = notebook.metadata.get("dtp", {}).get("chapter")
    return chapter if isinstance(chapter, str) else None


@dataclass
class Definition:
    """One top-level statement kept for grading, and the names it defines."""
    cell_index: int
    node: ast.stmt
    names: tuple[str, ...]

    def compile(self):
        module = ast.Module(body=[self.node], type_ignores=[])
        return compile(module, f"<notebook cell {self.cell_index}>", "exec")


@dataclass
class Definitions:
    """What a notebook defines, plus the cells that could not be parsed."""
    statements: list[Definition] = field(default_factory=list)
    syntax_errors: dict[int, str] = field(default_factory=dict)  # cell index -> message


def _defined_names(node: ast.stmt) -> tuple[str, ...]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return (node.name,)
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return tuple((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return tuple(_assigned_names(node) or ())


_ALWAYS_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _assigned_names(node: ast.stmt) -> list[str] | None:
    """Names a plain assignment binds, or None for anything else (tuple targets included)."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if len(names) == len(targets):
            return names
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Tuple) \
            and all(isinstance(e, ast.Name) for e in node.targets[0].elts):
        return [e.id for e in node.targets[0].elts]
    return None


def _names_read(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _graded_statements(nodes: list[tuple[int, ast.stmt]], answer_names: frozenset[str]) -> list[tuple[int, ast.stmt]]:
    """Definitions, and the assignments they (transitively) read, in notebook order."""
    kept = {i for i, (_, node) in enumerate(nodes) if isinstance(node, _ALWAYS_KEPT)}
    needed: set[str] = set()
    for i in kept:
        needed |= _names_read(nodes[i][1])
    changed = True
    while changed:  # an assignment that is kept may read another one
        changed = False
        for i, (_, node) in enumerate(nodes):
            names = _assigned_names(node)
            if i in kept or names is None:
                continue
            if any(n.isupper() or n in answer_names or n in needed for n in names):
                kept.add(i)
                needed |= _names_read(node)
                changed = True
    return [nodes[i] for i in sorted(kept)]


def _python_source(cell_source: str) -> str:
    """Cell source with IPython syntax (%magics, !shell) turned into plain Python calls."""
    from IPython.core.inputtransformer2 import TransformerManager
    return TransformerManager().transform_cell(cell_source)


def extract_definitions(notebook: nbformat.NotebookNode, answer_names=frozenset()) -> Definitions:
    found = Definitions()
    top_level: list[tuple[int, ast.stmt]] = []
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        try:
            tree = ast.parse(_python_source(cell.source), filename=f"<notebook cell {index}>")
        except SyntaxError as exc:
            found.syntax_errors[index] = f"line {exc.lineno}: {exc.msg}"
            continue
        top_level.extend((index, node) for node in tree.body)
    for index, node in _graded_statements(top_level, frozenset(answer_names)):
        found.statements.append(Definition(index, node, _defined_names(node)))
    return found
