"""`check("dp.ring_allreduce_numpy")`: instant feedback inside a notebook, from the live kernel.

The check runs in a child forked from the kernel, so it sees exactly what the learner has run so
far, and a crash, `sys.exit` or endless loop in their code cannot take the kernel down.
"""
from __future__ import annotations

import contextlib
import difflib

from .registry import all_exercise_ids, find_exercise


def _kernel_namespace() -> dict:
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    if shell is not None:
        return shell.user_ns
    import __main__
    return vars(__main__)


def check(exercise_id: str, timeout_s: float | None = None) -> None:
    """Grade one exercise against the definitions in this notebook and print a one-line verdict."""
    from .grading import grade_exercise
    from .student import StudentCode

    exercise = find_exercise(exercise_id)
    if exercise is None:
        close = difflib.get_close_matches(exercise_id, all_exercise_ids(), n=1)
        print(f"unknown exercise id {exercise_id!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
        return
    namespace = _kernel_namespace()
    print(grade_exercise(exercise, lambda: StudentCode(namespace), timeout_s).line())


@contextlib.contextmanager
def demo(exercise_id: str):
    """`with demo("dp.ring_allreduce_numpy"): ...` runs a cell that tries an exercise out. While
    the exercise is unfinished the cell prints one line instead of a traceback, so "Run All" on
    a fresh notebook reaches the end; any other error is the learner's to see, traceback and all."""
    from dtp.common.world import WorldError

    try:
        yield
    except NotImplementedError:
        print(f"· {exercise_id}: not implemented yet; write it above, then run this cell again")
    except WorldError as error:
        if error.exc_type != "NotImplementedError":
            raise
        print(f"· {exercise_id}: not implemented yet (a rank hit `raise NotImplementedError`); write it above, "
              "then run this cell again")
