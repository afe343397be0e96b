"""Inside the sandbox only: make the course's own answers unusable while an exercise is graded.

Each check names the course code that solves its exercise (`references`: a `dtp` closed form,
torch's DistributedDataParallel for a DDP written by hand, ...). Before the learner's
definitions load, `install` replaces the code of each such function, so that calling it, by any
name or alias the learner holds, raises `UsesCourseReference`; and an audit hook (which Python
cannot remove once added) refuses to open the solution notebooks or re-read the source of a
guarded module. The sandbox is a throwaway process: nothing here is ever undone.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS_DIR = str(REPO / "solutions")

tripped: list[str] = []  # what the learner's code reached for, in order


class UsesCourseReference(BaseException):
    """Raised where learner code calls the course's own answer. A BaseException, so that an
    `except Exception` in the learner's code does not hide it."""


def trip(what: str) -> None:
    tripped.append(what)
    raise UsesCourseReference(f"calls the course's reference {what}; this exercise asks you to write it yourself")


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


def _tripwire(dotted: str):
    """A function without closure that trips on `dotted` when called."""
    source = (f"def tripwire(*args, **kwargs):\n"
              f"    import grader.guard\n"
              f"    grader.guard.trip({dotted!r})\n")
    namespace: dict = {}
    exec(compile(source, f"<course reference {dotted}>", "exec"), namespace)  # noqa: S102
    return namespace["tripwire"]


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
    if isinstance(target, types.FunctionType) and not target.__code__.co_freevars:
        target.__code__ = wire.__code__  # every alias of this function object now trips
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
                trip(f"source {os.path.basename(path)}")
        elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn") and "solutions" in repr(args):
            trip("solutions folder (through a subprocess)")

    sys.addaudithook(audit)
