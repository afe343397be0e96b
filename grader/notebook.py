"""Reading a learner's notebook (never writing it) and taking its graded definitions out of it.

Graded definitions are the top-level imports, functions and classes of the code cells, plus every
top-level statement that binds or changes a name that is needed: a name the chapter's checks read
(`ring_all_reduce`, an answer variable), or a global that a kept statement reads (`chunk_count = 4`
used inside a function, `TABLE = {}` and the loop that fills it, a top-level `fill_units(TABLE)`
whose function fills its argument, `answer *= 1000`, an `if` or `try` that defines a function or
imports a module). Everything else (demo calls, plots,
`check(...)` lines, training runs whose results nothing reads) is left out, so grading does not
re-run a learner's experiments.
"""
from __future__ import annotations

import ast
import json
import re
import symtable
import sys
from dataclasses import dataclass, field
from pathlib import Path


class UnusableInput(Exception):
    """The input cannot be graded at all (missing file, not a notebook, unknown chapter)."""


def read_notebook(path: str | Path) -> "nbformat.NotebookNode":
    """Read and validate a notebook; raise UnusableInput with a one-line reason otherwise."""
    path = Path(path)
    if not path.exists():
        raise UnusableInput(f"{path}: no such file")
    if not path.is_file():
        raise UnusableInput(f"{path}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UnusableInput(f"{path}: not a notebook (not UTF-8 text: byte {exc.start} cannot be decoded)") from None
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise UnusableInput(f"{path}: not a notebook (not valid JSON: {exc})") from None
    if not isinstance(raw, dict) or "cells" not in raw or "nbformat" not in raw:
        raise UnusableInput(f"{path}: not a notebook (JSON without 'cells' and 'nbformat')")
    _without_uri_grammar()
    import nbformat  # only now: input that is not even a notebook is reported without loading it

    try:
        notebook = nbformat.reads(json.dumps(_without_lone_surrogates(raw)), as_version=4)
        minor = notebook.get("nbformat_minor", 0)
        if isinstance(minor, int) and minor < 5:
            # What Jupyter does on opening: cell ids (which some tools already write into 4.4
            # files, where the schema forbids them) and minor version 5.
            nbformat.v4.upgrade(notebook, from_version=4, from_minor=minor)
        nbformat.validate(notebook)
    except Exception as exc:  # nbformat raises several unrelated types for broken files
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UnusableInput(f"{path}: not a valid notebook ({first_line[:200]})") from None
    return notebook


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_lone_surrogates(value):
    """JSON can hold half of a UTF-16 pair ("\\ud83d", from some editors and copy-pastes), which no
    UTF-8 text can: such a character becomes U+FFFD, as a browser shows it."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_lone_surrogates(item) for item in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(key): _without_lone_surrogates(item) for key, item in value.items()}
    return value


def _without_uri_grammar() -> None:
    """nbformat validates with jsonschema, which loads an optional URI-syntax checker when it is
    installed (rfc3987_syntax, which builds a parser as it is imported: a second here). Notebook
    validation never checks URI formats, so the grader tells Python it is absent."""
    if "jsonschema" not in sys.modules:
        sys.modules.setdefault("rfc3987_syntax", None)


def read_course_notebook(path: str | Path) -> tuple["nbformat.NotebookNode", str]:
    """A notebook of one of the course's chapters, and its chapter; UnusableInput otherwise."""
    from .registry import CHAPTER_MODULES

    notebook = read_notebook(path)
    chapter = notebook_chapter(notebook)
    if chapter not in CHAPTER_MODULES:
        known = ", ".join(CHAPTER_MODULES)
        what = f"chapter {chapter!r} is unknown" if chapter else "it names no chapter (metadata dtp.chapter)"
        raise UnusableInput(f"{path}: not a course notebook: {what}; known chapters: {known}")
    return notebook, chapter


def notebook_chapter(notebook: "nbformat.NotebookNode") -> str | None:
    """The chapter a notebook belongs to, from the metadata the course writes into every notebook."""
    course = notebook.metadata.get("dtp")
    chapter = course.get("chapter") if isinstance(course, dict) else None
    return chapter if isinstance(chapter, str) else None


@dataclass
class Definition:
    """One top-level statement kept for grading, and the names it defines."""
    cell_index: int
    node: ast.stmt
    names: tuple[str, ...]

    def compile(self):
        module = ast.Module(body=[self.node], type_ignores=[])
        # dont_inherit: the learner's code must not run under this module's __future__ imports.
        return compile(module, f"<notebook cell {self.cell_index}>", "exec", dont_inherit=True)


@dataclass
class Definitions:
    """What a notebook defines, plus the cells that could not be parsed."""
    statements: list[Definition] = field(default_factory=list)
    syntax_errors: dict[int, str] = field(default_factory=dict)  # cell index -> message


def _defined_names(node: ast.stmt) -> tuple[str, ...]:
    """The names a kept statement provides (named in feedback when the statement fails)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return (node.name,)
    return tuple(_assigned_names(node) or sorted(_names_changed(node)))


_ALWAYS_KEPT = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _assigned_names(node: ast.stmt) -> list[str] | None:
    """Names a plain assignment binds (`x = ...`, `a, b = ...`), or None for anything else."""
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        if len(targets) == 1 and isinstance(targets[0], ast.Tuple):
            targets = targets[0].elts
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if len(names) == len(targets):
            return names
    return None


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _names_changed(node: ast.stmt, modules: frozenset[str] = frozenset()) -> set[str]:
    """Globals a top-level statement binds or mutates: assignment and loop targets, functions,
    classes and imports (also inside `if`/`try`/`with`), `x[k] = ...`, `x.attr = ...`, `x += ...`
    and method-call statements such as `x.append(...)`, unless `x` is one of the imported
    `modules` (`plt.plot(...)` changes nothing the grader needs)."""
    changed: set[str] = set()
    stack: list[ast.AST] = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and current is not node:
            changed.add(current.name)  # a nested definition binds its name; its body is its own scope
            continue
        if isinstance(current, ast.Lambda):
            continue
        if isinstance(current, (ast.Import, ast.ImportFrom)):
            changed.update((alias.asname or alias.name).split(".")[0] for alias in current.names)
        elif isinstance(current, ast.Name) and isinstance(current.ctx, (ast.Store, ast.Del)):
            changed.add(current.id)
        elif isinstance(current, (ast.Attribute, ast.Subscript)) and isinstance(current.ctx, (ast.Store, ast.Del)):
            changed.add(_root_name(current) or "")
        elif isinstance(current, ast.Expr) and isinstance(current.value, ast.Call) \
                and isinstance(current.value.func, ast.Attribute):  # a statement `x.append(...)`, not `np.ones(...)`
            root = _root_name(current.value.func.value)
            if root not in modules:
                changed.add(root or "")
        stack.extend(ast.iter_child_nodes(current))
    return changed - {""}


def _body_nodes(node: ast.AST):
    """The nodes of a statement or function body, without descending into nested scopes."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        current = stack.pop()
        yield current
        if not isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(current))


def _names_called(node: ast.AST) -> set[str]:
    return {n.func.id for n in _body_nodes(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


@dataclass
class _Effects:
    """What calling a notebook function changes: globals (by name) and the objects passed to some
    of its parameters (by parameter name)."""
    globals: set[str] = field(default_factory=set)
    parameters: set[str] = field(default_factory=set)


def _parameters(function: ast.FunctionDef) -> tuple[list[str], set[str]]:
    """(positional parameter names in order, every parameter name)."""
    arguments = function.args
    positional = [a.arg for a in arguments.posonlyargs + arguments.args]
    every = set(positional) | {a.arg for a in arguments.kwonlyargs}
    every |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    return positional, every


def _mutated_roots(node: ast.AST) -> set[str]:
    """Names whose objects a body mutates directly: `x[k] = v`, `x.attr = v`, `del x[k]`, `x.update(...)`."""
    roots = set()
    for current in _body_nodes(node):
        if isinstance(current, (ast.Attribute, ast.Subscript)) and isinstance(current.ctx, (ast.Store, ast.Del)):
            roots.add(_root_name(current))
        elif isinstance(current, ast.Call) and isinstance(current.func, ast.Attribute):
            roots.add(_root_name(current.func.value))
    return roots - {None}


def _names_passed_to_mutators(node: ast.AST, functions: dict[str, ast.FunctionDef],
                              effects: dict[str, _Effects]) -> set[str]:
    """Names whose objects a body hands to a notebook function's mutated parameter:
    `fill_units(UNITS)` (or `fill_units(table=UNITS)`) when `fill_units` fills its `table`."""
    passed = set()
    for call in _body_nodes(node):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in effects):
            continue
        mutated = effects[call.func.id].parameters
        if not mutated:
            continue
        positional, _ = _parameters(functions[call.func.id])
        bound = [(positional[i] if i < len(positional) else None, arg) for i, arg in enumerate(call.args)]
        bound += [(keyword.arg, keyword.value) for keyword in call.keywords]
        passed |= {_root_name(arg) for parameter, arg in bound if parameter in mutated}
    return passed - {None}


def _function_effects(functions: dict[str, ast.FunctionDef], modules: frozenset[str]) -> dict[str, _Effects]:
    """What each notebook function changes when it is called: globals it declares `global` and
    binds, global objects it mutates (`TABLE[k] = v`, `TABLE.update(...)`), objects passed to its
    parameters that it mutates (`table[k] = v` in `def fill(table)`), also through the notebook
    functions it calls. A top-level `init()`, `_add_units(...)` or `fill_units(UNITS)` therefore
    counts as a statement that fills those globals."""
    effects: dict[str, _Effects] = {}
    global_names: dict[str, set[str]] = {}
    for name, function in functions.items():
        try:
            table = symtable.symtable(ast.unparse(function), "<cell>", "exec").get_children()[0]
        except (SyntaxError, IndexError):
            effects[name], global_names[name] = _Effects(), set()
            continue
        global_names[name] = {s.get_name() for s in table.get_symbols() if s.is_global()}
        declared = {s.get_name() for s in table.get_symbols() if s.is_declared_global() and s.is_assigned()}
        mutated = _mutated_roots(function)
        effects[name] = _Effects(declared | ((mutated & global_names[name]) - modules),
                                 mutated & _parameters(function)[1])
    grew = True
    while grew:  # through calls to other notebook functions
        grew = False
        for name, function in functions.items():
            reached = set().union(*(effects[callee].globals for callee in _names_called(function) if callee in effects))
            passed = _names_passed_to_mutators(function, functions, effects)
            reached |= (passed & global_names[name]) - modules
            parameters = passed & _parameters(function)[1]
            if not (reached <= effects[name].globals and parameters <= effects[name].parameters):
                effects[name].globals |= reached
                effects[name].parameters |= parameters
                grew = True
    return effects


def _globals_read(node: ast.stmt) -> set[str]:
    """Global names a statement reads when it runs or when its functions are called: a
    function's parameters and locals are not globals (symtable knows the scoping rules)."""
    try:
        module = symtable.symtable(ast.unparse(node), "<cell>", "exec")
    except SyntaxError:
        return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    names = set()
    pending = [module]
    while pending:
        table = pending.pop()
        for symbol in table.get_symbols():
            if not symbol.is_referenced():
                continue
            if table.get_type() == "module" or symbol.is_global() or \
                    (table.get_type() == "class" and not symbol.is_assigned()):
                names.add(symbol.get_name())
        pending.extend(table.get_children())
    return names


def _graded_statements(nodes: list[tuple[int, ast.stmt]], graded_names: frozenset[str]) -> list[tuple[int, ast.stmt]]:
    """Imports and definitions (running a `def` costs nothing), and the statements that bind or
    change a needed name. Needed are the graded names, and what a needed statement reads when it
    runs or its functions are called: a function no graded name reaches adds nothing, so a call
    that only feeds another exercise's answer (`ratio = plan(...)`) is not run for this one."""
    kept = {i for i, (_, node) in enumerate(nodes) if isinstance(node, _ALWAYS_KEPT)}
    # No graded names (the book loading a solution): every definition is needed.
    needed: set[str] = set(graded_names) or {name for i in kept for name in _defined_names(nodes[i][1])}
    read: set[int] = set()  # kept statements whose reads are already in `needed`
    modules = frozenset(name for _, node in nodes if isinstance(node, (ast.Import, ast.ImportFrom))
                        for name in _defined_names(node))
    functions = {node.name: node for _, node in nodes if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    effects = _function_effects(functions, modules)
    changes = [_names_changed(node, modules).union(
        *(effects[f].globals for f in _names_called(node) if f in effects),
        _names_passed_to_mutators(node, functions, effects) - modules) for _, node in nodes]
    grew = True
    while grew:  # a needed statement may read names that only another statement provides
        grew = False
        for i in sorted(kept - read):
            if isinstance(nodes[i][1], _ALWAYS_KEPT) and not set(_defined_names(nodes[i][1])) & needed:
                continue  # a definition nothing needed reaches (yet)
            read.add(i)
            needed |= _globals_read(nodes[i][1])
            grew = True
        for i in range(len(nodes)):
            if i not in kept and changes[i] & needed:
                kept.add(i)
                grew = True
    return [nodes[i] for i in sorted(kept)]


# Cell magics that run their body once as ordinary Python: the body's definitions count.
_TRANSPARENT_CELL_MAGICS = ("%%time", "%%capture")


def _python_source(cell_source: str) -> str:
    """Cell source with IPython syntax (%magics, !shell) turned into plain Python calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    first, _, body = cell_source.lstrip().partition("\n")
    if first.split() and first.split()[0] in _TRANSPARENT_CELL_MAGICS:
        cell_source = body
    # `%time x = f()` runs its statement once, like `%%time`.
    cell_source = re.sub(r"^([ \t]*)%time[ \t]+", r"\1", cell_source, flags=re.M)
    return TransformerManager().transform_cell(cell_source)


@dataclass
class NotebookCode:
    """A notebook's top-level statements, parsed once; `definitions` picks what one set of graded
    names needs, so that each exercise's sandbox runs only its own answers' set-up (an answer
    variable of another exercise, say `ratio = planner(...)`, is not recomputed for it)."""
    top_level: list[tuple[int, ast.stmt]] = field(default_factory=list)
    syntax_errors: dict[int, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, notebook: "nbformat.NotebookNode") -> "NotebookCode":
        code = cls()
        for index, cell in enumerate(notebook.cells):
            if cell.cell_type != "code" or not cell.source.strip():
                continue
            try:
                tree = ast.parse(_python_source(cell.source), filename=f"<notebook cell {index}>")
            except SyntaxError as exc:
                code.syntax_errors[index] = f"line {exc.lineno}: {exc.msg}"
                continue
            code.top_level.extend((index, node) for node in tree.body)
        return code

    def definitions(self, graded_names=frozenset()) -> Definitions:
        """The statements to run for grading; `graded_names` are the names the checks will read."""
        found = Definitions(syntax_errors=dict(self.syntax_errors))
        for index, node in _graded_statements(self.top_level, frozenset(graded_names)):
            found.statements.append(Definition(index, node, _defined_names(node)))
        return found


def extract_definitions(notebook: "nbformat.NotebookNode", graded_names=frozenset()) -> Definitions:
    """The statements to run for grading; `graded_names` are the names the checks will read."""
    return NotebookCode.parse(notebook).definitions(graded_names)
