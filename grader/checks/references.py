"""What an exercise refuses, derived from the course library rather than listed by hand.

A check names the modules that hold its oracle (`refuses_library("dtp.cp.context_parallel")`).
The exercise then refuses every public function and class those modules define, and every
function or class of the course library (outside `dtp.common`, what every chapter stands on)
that they call, directly or not: a learner who assembles the answer from the library's pieces
(`masked_block` and `merge` for a ring, `attention_numpy` for the online softmax) is refused
like one who calls the whole answer. Two kinds of library code stay usable:

- what the check's own sandbox side runs (`collect` and the harness it hands to the gloo
  worlds, with everything they call): refusing it would fail every answer;
- `INFRASTRUCTURE`: code that records or sets up and computes no part of any answer.

The learner's own helpers are never confused with the library's: the guard changes the
library's function objects (grader/guard.py), not names, so a notebook's own `merge` runs.
"""
from __future__ import annotations

import importlib
import inspect
import types

LIBRARY, COMMON = "dtp.", "dtp.common"
CHECKS = "grader.checks."

# Library code that records, sets up or measures, and computes no part of any exercise's answer
# (a module's name stands for everything in it).
INFRASTRUCTURE = frozenset({
    "dtp.zero.measure",  # what a rank holds: the ZeRO and overlap checks' measurements
    "dtp.ep.moe.AllToAllLog",  # records the rows of every all-to-all (the notebook's demos use it)
    "dtp.overlap.runs.plain_events",  # events as plain data
    "dtp.overlap.runs.bucket_overlap_rank",  # the graded runs: the learner's code inside a recorded rank
    "dtp.overlap.runs.collective_matmul_rank",
    "dtp.overlap.runs.zero3_prefetch_rank",
    "dtp.zero.runs.batches", "dtp.zero.runs.rank_rows", "dtp.zero.runs.marked_step", "dtp.zero.runs.gathered_units",
    "dtp.zero.runs.train_zero_rank", "dtp.zero.runs.train_zero3_gpt_rank",
    "dtp.zero.runs.small_gpt", "dtp.zero.runs.gpt_units", "dtp.zero.runs.gpt_batches", "dtp.zero.runs.gpt_loss",
    "dtp.zero.runs.gpt_rows",
})


def dotted(value) -> str | None:
    """'module.name' by which the guard can find a library function or class, or None for
    anything else (a nested function, a builtin, code outside the course library)."""
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if not isinstance(module, str) or not module.startswith(LIBRARY) or "." in name or "<" in name:
        return None
    owner = importlib.import_module(module)
    return f"{module}.{name}" if getattr(owner, name, None) is value else None


def _code_objects(value) -> list[types.CodeType]:
    """The code a function runs, or a class's methods run."""
    value = inspect.unwrap(value) if callable(value) else value
    if isinstance(value, types.FunctionType):
        return [value.__code__]
    if isinstance(value, type):
        codes = []
        for member in vars(value).values():
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                codes += [f.__code__ for f in (member.fget, member.fset, member.fdel) if f is not None]
            elif isinstance(member, types.FunctionType):
                codes.append(member.__code__)
        return codes
    return []


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names(constant)
    return names


def _globals_of(value) -> dict:
    value = inspect.unwrap(value) if callable(value) else value
    if isinstance(value, types.FunctionType):
        return value.__globals__
    module = getattr(value, "__module__", None)
    return vars(importlib.import_module(module)) if isinstance(module, str) else {}


def _mentioned(value) -> list:
    """The functions, classes and modules `value`'s code names: a global, or an attribute of a
    module it holds (`moe.softmax`). An over-approximation: a name is enough."""
    scope, found = _globals_of(value), []
    names = set().union(*(_names(code) for code in _code_objects(value)))
    for name in names:
        target = scope.get(name)
        if isinstance(target, types.ModuleType):  # the course's modules only: torch's and numpy's call no answer
            if target.__name__.startswith((LIBRARY, CHECKS)):
                found += [getattr(target, attribute) for attribute in names if hasattr(target, attribute)]
        elif target is not None:
            found.append(target)
    return found


def _is_library(value) -> bool:
    module = getattr(value, "__module__", None)
    return (isinstance(module, str) and module.startswith(LIBRARY) and not module.startswith(COMMON)
            and (inspect.isfunction(inspect.unwrap(value)) or inspect.isclass(value)))


def library_closure(roots) -> set[str]:
    """Dotted names of the library functions and classes `roots` are or call, directly or not."""
    found, pending, seen = set(), list(roots), set()
    while pending:
        value = pending.pop()
        if id(value) in seen or not _is_library(value):
            continue
        seen.add(id(value))
        name = dotted(value)
        if name:
            found.add(name)
        pending += _mentioned(value)
    return found


def sandbox_side(check_class) -> list:
    """The library code the check's sandbox side can reach: what `collect` names, followed
    through the checks' own functions and classes (a harness, a recorder) into the library."""
    roots, pending, seen = [], [check_class.collect], set()
    while pending:
        value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if _is_library(value):
            roots.append(value)
            continue
        if not (getattr(value, "__module__", None) or "").startswith(CHECKS):
            continue
        pending += _mentioned(value)
        for name in set().union(*(_names(code) for code in _code_objects(value))):  # self.<method>
            pending += [getattr(check_class, name)] if hasattr(check_class, name) else []
    return roots


def public_members(module_name: str) -> list:
    """The functions and classes a module defines under a public name."""
    module = importlib.import_module(module_name)
    return [value for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module_name
            and (inspect.isfunction(inspect.unwrap(value)) or inspect.isclass(value))]


def derived_references(check_class, modules: tuple[str, ...]) -> tuple[str, ...]:
    """The library names an exercise refuses: the public members of `modules` and what they
    call, less what the check's sandbox side runs and `INFRASTRUCTURE`."""
    refused = library_closure([member for module in modules for member in public_members(module)])
    usable = library_closure(sandbox_side(check_class))
    return tuple(sorted(name for name in refused - usable if not is_infrastructure(name)))


def is_infrastructure(name: str) -> bool:
    return any(name == entry or name.startswith(entry + ".") for entry in INFRASTRUCTURE)


def refuses_library(*modules: str):
    """Class decorator (under `@exercise`): the check's `references` become the names it lists
    (torch's own implementations, ...) and everything `derived_references` finds in `modules`."""
    def apply(check_class):
        declared = tuple(check_class.references)  # its own or its base class's: torch's implementations, ...
        check_class.oracle_modules = modules
        check_class.references = tuple(dict.fromkeys(declared + derived_references(check_class, modules)))
        return check_class
    return apply
