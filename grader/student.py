"""The learner's code as the checks see it: a namespace whose missing names explain themselves."""
from __future__ import annotations

import sys
import types

from .notebook import Definitions, extract_definitions, read_notebook


class MissingDefinition(Exception):
    """A name an exercise needs is not defined (not written yet, or its cell failed)."""


class StudentCode:
    """Attribute access to the learner's definitions: `student.ring_all_reduce`."""

    def __init__(self, namespace: dict, problems: dict[str, str] | None = None):
        self._namespace = namespace
        self._problems = problems or {}  # name -> why it could not be defined

    @classmethod
    def from_definitions(cls, definitions: Definitions, as_main: bool = False) -> "StudentCode":
        """Execute a notebook's graded definitions. With `as_main` (in a sandbox) they run as the
        process's `__main__` module, as in a Jupyter kernel, so `if __name__ == "__main__":`
        blocks run; otherwise (in a process that must keep its own `__main__`) as `__notebook__`."""
        # A real, importable module: dataclasses, pickling and typing look their classes up there.
        module = types.ModuleType("__main__" if as_main else "__notebook__")
        sys.modules[module.__name__] = module
        namespace = vars(module)
        problems: dict[str, str] = {}
        for statement in definitions.statements:
            try:
                exec(statement.compile(), namespace)  # noqa: S102 - this is what a grader does
            except BaseException as exc:  # noqa: BLE001 - SystemExit in a definition is the learner's
                reason = _one_line(exc)
                for name in statement.names:
                    problems[name] = f"cell {statement.cell_index} raised {reason}"
        for index, message in definitions.syntax_errors.items():
            problems.setdefault(f"<cell {index}>", f"cell {index} has a syntax error ({message})")
        return cls(namespace, problems)

    @classmethod
    def from_notebook(cls, path: str, graded_names=()) -> "StudentCode":
        """Run a notebook's graded definitions in this process: for trusted notebooks only, such
        as the book using the course's own solutions (the grader always uses a sandbox)."""
        return cls.from_definitions(extract_definitions(read_notebook(path), graded_names))

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._namespace:
            value = self._namespace[name]
            if value is Ellipsis:  # the exercise notebook's placeholder for an answer
                raise MissingDefinition(f"`{name}` is still `...`: replace it with your answer")
            return value
        if name in self._problems:
            raise MissingDefinition(f"`{name}` is not defined: {self._problems[name]}")
        syntax = [why for key, why in self._problems.items() if key.startswith("<cell")]
        hint = f" ({syntax[0]}, so it was skipped)" if syntax else ""
        raise MissingDefinition(f"`{name}` is not defined in the notebook{hint}")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200]}" if text else type(exc).__name__
