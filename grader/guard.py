"""Inside the sandbox only: make the course's own answers, and the grader's judges, unusable
while an exercise is graded.

Each check names the course code that solves its exercise (`references`: a `dtp` closed form,
torch's DistributedDataParallel for a DDP written by hand, ...). Before the learner's
definitions load, `install` replaces the code of each such function, so that calling it, by any
name or alias the learner holds, raises `UsesCourseReference`; and an audit hook (which Python
cannot remove once added) refuses to open the solution notebooks or re-read the source of a
guarded module. (Landlock, grader/landlock.py, is the first layer: it keeps those files from
the sandbox and every process it starts; the hook is the second.)

The sandbox is forked from the grader, so it holds every check object, and learner code can find
them (the stack, `gc.get_objects()`). `seal` leaves it only the step that runs there: every
function of the checks' modules that the exercise's `collect` cannot reach (each `judge`, the
oracles, `expected` and `slips`, other exercises' checks) gets code that trips instead, as does
the grader's own judging; calling one, through any alias, fails the exercise. The original code
objects are released, and their source files are outside Landlock's rules.

The sandbox is a throwaway process: nothing here is ever undone.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import linecache
import os
import pkgutil
import sys
import tokenize
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS_DIR = str(REPO / "solutions")

tripped: list[str] = []  # what the learner's code reached for, in order, as feedback


class UsesCourseReference(BaseException):
    """Raised where learner code calls the course's own answer. A BaseException, so that an
    `except Exception` in the learner's code does not hide it."""


def trip(what: str, kind: str = "the course's reference") -> None:
    if kind == GRADER:
        message = (f"calls {kind} {what}, which never runs beside your code; the grader judges what your code "
                   "returned in its own process")
    else:
        message = f"calls {kind} {what}; this exercise asks you to write it yourself"
    tripped.append(message)
    raise UsesCourseReference(message)


GRADER = "the grader's"


def _resolve(dotted: str):
    """(owner, attribute name, object) for 'package.module.attribute[.attribute...]'."""
    parts = dotted.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for name in parts[split:-1]:
            owner = getattr(owner, name)
        return owner, parts[-1], getattr(owner, parts[-1])
    raise ImportError(dotted)


_LABEL = "\0label"  # stands for the tripwire's label in its template


@functools.lru_cache(maxsize=None)
def _tripwire_template(free_variables: int, what: str) -> types.CodeType:
    """Code that trips on `_LABEL`, with `free_variables` unused closure cells (a function's code
    can only be swapped for code with as many); compiled once, relabelled per function."""
    cells = [f"_cell{i}" for i in range(free_variables)]
    source = ("def outer():\n" + "".join(f"    {cell} = None\n" for cell in cells)
              + "    def tripwire(*args, **kwargs):\n"
              + (f"        {', '.join(cells)}\n" if cells else "")
              + "        import grader.guard\n"
              + f"        grader.guard.trip({_LABEL!r}, {what!r})\n"
              + "    return tripwire\n")
    namespace: dict = {}
    exec(compile(source, f"<{what} tripwire>", "exec"), namespace)  # noqa: S102
    return namespace["outer"]().__code__


def _tripwire_code(label: str, free_variables: int = 0, what: str = "the course's reference") -> types.CodeType:
    template = _tripwire_template(free_variables, what)
    return template.replace(co_consts=tuple(label if constant == _LABEL else constant for constant in template.co_consts))


def _tripwire(dotted: str):
    """A function without closure that trips on `dotted` when called."""
    return types.FunctionType(_tripwire_code(dotted), {"__builtins__": __builtins__}, dotted.rsplit(".", 1)[-1])


def _course_source(target) -> str | None:
    """The course's own file that defines `target` (through decorators), or None for library code:
    re-reading the course's source could rebuild a guarded function, re-reading torch's cannot."""
    try:
        path = inspect.getsourcefile(inspect.unwrap(target))
    except TypeError:
        return None
    if path and os.path.realpath(path).startswith(str(REPO) + os.sep) and ".venv" not in path:
        return path
    return None


def _guard_callable(dotted: str) -> str | None:
    """Make `dotted` trip when called; returns the course source file to protect, if any."""
    owner, name, target = _resolve(dotted)
    source = _course_source(target)
    if isinstance(target, type):  # a class: constructing it trips
        setattr(target, "__init__", _tripwire(dotted))
        return source
    wire = _tripwire(dotted)
    function = inspect.unwrap(target)  # through functools.wraps and lru_cache, whose aliases stay callable
    if isinstance(function, types.FunctionType) and not function.__code__.co_freevars:
        function.__code__ = wire.__code__  # every alias of this function object now trips
    if callable(getattr(target, "cache_clear", None)):
        target.cache_clear()  # answers it computed in the grader, before this process was forked
    setattr(owner, name, wire)
    return source


def install(references: tuple[str, ...]) -> None:
    """Guard the references of one exercise and the solution notebooks, before learner code loads."""
    protected = set()
    for dotted in references:
        path = _guard_callable(dotted)
        if path:
            protected.add(os.path.realpath(path))
            protected.add(os.path.realpath(importlib.util.cache_from_source(path)))

    def audit(event: str, args: tuple) -> None:
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(SOLUTIONS_DIR + os.sep):
                trip(f"solution notebook {os.path.basename(path)}")
            if path in protected:
                if _showing_a_source_line():  # a warning or traceback: that line stays unreadable, as under Landlock
                    raise PermissionError(13, "the grader keeps this course module's source from the sandbox", path)
                trip(f"source {os.path.basename(path)}")
        elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn") and "solutions" in repr(args):
            trip("solutions folder (through a subprocess)")

    sys.addaudithook(audit)


def _showing_a_source_line() -> bool:
    """Whether the file is being opened by linecache, as Python does to show a warning's or a
    traceback's source line: a harness module that also holds a refused oracle
    (dtp.overlap.runs) must not turn a warning raised in it into a refusal."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_filename in (linecache.__file__, tokenize.__file__):
            return True
        frame = frame.f_back
    return False


# --- the grader's own objects in the sandbox ------------------------------------------------

CHECK_PACKAGE = "grader.checks"


def preload(check) -> None:
    """In the grader (or kernel), before the sandbox is forked: import what the sandbox will need
    and could no longer read once confined: the modules of the exercise's references and every
    module of its chapter's checks (a check may import a sibling module lazily)."""
    for dotted in check.references:
        _resolve(dotted)
    module = sys.modules[type(check).__module__]
    package = module if hasattr(module, "__path__") else sys.modules.get(module.__name__.rpartition(".")[0])
    if package is not None and package.__name__.startswith(CHECK_PACKAGE + ".") and hasattr(package, "__path__"):
        for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
            importlib.import_module(info.name)
    # Worked out here once, not in every sandbox: there, walking sys.modules or freeing a cache
    # writes to pages shared with this process, and each write copies one.
    loaded = tuple(sorted(module.__name__ for module in _check_modules()))
    if _index_cache.get("loaded") != loaded:
        _index_cache.clear()
        _checks_index()
        _index_cache["loaded"] = loaded
    for free_variables in range(3):
        _tripwire_template(free_variables, GRADER)
    for path in [path for path in linecache.cache if path.startswith(str(REPO) + os.sep)]:
        del linecache.cache[path]  # source lines of the checks or the course, read for a traceback


_index_cache: dict = {}


def _checks_index() -> tuple[list, dict]:
    """(every function of the checks' modules, their values by name), as `preload` found them."""
    if not _index_cache:
        _index_cache.update(functions=_functions_of_checks(), by_name=_by_name(), wrappers=_cached_wrappers())
    return _index_cache["functions"], _index_cache["by_name"]


def _check_modules() -> list[types.ModuleType]:
    return [module for name, module in list(sys.modules.items())
            if module is not None and (name == CHECK_PACKAGE or name.startswith(CHECK_PACKAGE + "."))]


def _defined_in_checks(value) -> bool:
    return getattr(value, "__module__", "").startswith(CHECK_PACKAGE + ".")


def _members(value) -> list:
    """What a value of the checks' modules leads to: a class's attributes, a method's function,
    a wrapper's wrapped function, a container's items, an instance's class."""
    if isinstance(value, type):
        if not _defined_in_checks(value):
            return []  # a library's class: what it calls is not the checks' code
        return list(vars(value).values()) + [base for base in value.__mro__[1:] if _defined_in_checks(base)]
    if isinstance(value, (staticmethod, classmethod)):
        return [value.__func__]
    if isinstance(value, property):
        return [value.fget, value.fset, value.fdel]
    if isinstance(value, dict):
        return list(value.keys()) + list(value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    if hasattr(value, "__wrapped__"):  # functools.wraps, lru_cache
        return [value.__wrapped__]
    if isinstance(value, types.FunctionType):
        if not _defined_in_checks(value):
            return []
        return [cell.cell_contents for cell in value.__closure__ or () if _cell_is_set(cell)] + \
            list(value.__defaults__ or ()) + list((value.__kwdefaults__ or {}).values())
    if _defined_in_checks(type(value)):
        return [type(value)]
    return []


def _cell_is_set(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018
        return True
    except ValueError:
        return False


def _names_in(code: types.CodeType) -> set[str]:
    """Every global, attribute and identifier-like string a code object (and the code nested in
    it) mentions: what it can reach by name, `getattr(self, "name")` included."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names_in(constant)
        elif isinstance(constant, str) and constant.isidentifier():
            names.add(constant)
    return names


def _by_name() -> dict[str, list]:
    """name -> the values of the checks' modules known by that name (a module global, a class
    attribute), which code that mentions the name may reach."""
    index: dict[str, list] = {}
    for module in _check_modules():
        for name, value in vars(module).items():
            if not isinstance(value, types.ModuleType):
                index.setdefault(name, []).append(value)
            if isinstance(value, type) and _defined_in_checks(value):
                for attribute, member in vars(value).items():
                    index.setdefault(attribute, []).append(member)
    return index


def _reachable(roots: list, instance_attributes: dict) -> set[int]:
    """ids of the functions of the checks' modules that `roots` can reach: by name, through
    closures, defaults, classes and containers. An over-approximation: a name in common with
    an unrelated method keeps that method too, never the other way round."""
    index, kept, seen, pending = _checks_index()[1], set(), set(), list(roots)
    while pending:
        value = pending.pop()
        if id(value) in seen or value is None or isinstance(value, types.ModuleType):
            continue
        seen.add(id(value))
        if isinstance(value, types.FunctionType) and _defined_in_checks(value):
            kept.add(id(value))
            for name in _names_in(value.__code__):
                pending.extend(index.get(name, ()))
                if name in instance_attributes:  # an attribute the check set on itself
                    pending.append(instance_attributes[name])
        pending.extend(_members(value))
    return kept


def _functions_of_checks() -> list[types.FunctionType]:
    """Every function the checks' modules define: module functions and methods, nested classes."""
    found, seen = [], set()

    def visit(value):
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, types.FunctionType):
            if _defined_in_checks(value):
                found.append(value)
        elif isinstance(value, type):
            if _defined_in_checks(value):
                for member in vars(value).values():
                    visit(member)
        elif isinstance(value, (staticmethod, classmethod, property)) or hasattr(value, "__wrapped__"):
            for member in _members(value):
                visit(member)

    for module in _check_modules():
        for value in vars(module).values():
            visit(value)
    return found


def _neutralize(function: types.FunctionType) -> None:
    function.__code__ = _tripwire_code(function.__qualname__, len(function.__code__.co_freevars), GRADER)
    cache_clear = getattr(function, "cache_clear", None)
    if callable(cache_clear):
        cache_clear()


def seal(check, inputs, grader_steps: tuple = ()) -> None:
    """Leave the sandbox only what `check.collect` can reach of the checks' modules (and the
    classes of the `inputs` it is handed); every other function there, and `grader_steps` (the
    grader's own judging functions), trips when called."""
    collect = inspect.unwrap(type(check).collect)
    kept = _reachable([collect, inputs], vars(check))
    for function in _checks_index()[0]:
        if id(function) not in kept:
            _neutralize(function)
    for wrapper in _index_cache["wrappers"]:
        wrapper.cache_clear()  # results an oracle computed in the grader before this fork
    for function in grader_steps:
        _neutralize(function)


def _cached_wrappers() -> list:
    return [value for module in _check_modules() for value in vars(module).values()
            if _defined_in_checks(value) and callable(getattr(value, "cache_clear", None))]
