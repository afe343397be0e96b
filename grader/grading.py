"""Grading: each exercise's check runs against the learner's code in its own sandbox child."""
from __future__ import annotations

import time
import traceback
from pathlib import Path

from dtp.world import WorldError

from .compare import CheckFailed
from .notebook import UnusableInput, extract_definitions, notebook_chapter, read_notebook
from .registry import CHAPTER_MODULES, Exercise, chapter_exercises
from .report import ExerciseResult, NotebookReport
from .sandbox import run_isolated
from .student import MissingDefinition, StudentCode


def _where_in_notebook(exc: BaseException) -> str:
    """' (in ring_all_reduce, line 3 of its cell)' for the innermost frame of the learner's code."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.startswith("<notebook cell") or "ipykernel_" in frame.filename:
            return f" (in {frame.name}, line {frame.lineno} of its cell)"
    return ""


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:240]}" if text else type(exc).__name__


def run_check(exercise: Exercise, student: StudentCode) -> tuple[str, str]:
    """(status, feedback) of one check; runs inside the sandbox child."""
    try:
        return "passed", exercise.check(student)
    except CheckFailed as failed:
        return "failed", str(failed)
    except MissingDefinition as missing:
        return "missing", str(missing)
    except NotImplementedError as exc:
        return "missing", f"not implemented yet{_where_in_notebook(exc)}: replace the `raise NotImplementedError` with your code"
    except WorldError as world:
        if world.exc_type == "NotImplementedError":
            return "missing", "not implemented yet: a rank hit `raise NotImplementedError`"
        if world.exc_type == "CheckFailed":
            return "failed", str(world).split("CheckFailed: ", 1)[-1]
        status = "timeout" if world.kind in ("collective_timeout", "timeout") else "error"
        return status, str(world)
    except SystemExit as exc:
        return "error", f"your code called sys.exit({exc.code!r}){_where_in_notebook(exc)}; return a value instead"
    except BaseException as exc:  # noqa: BLE001 - anything the learner's code raises costs only this exercise
        return "error", f"{_short(exc)}{_where_in_notebook(exc)}"


def grade_exercise(exercise: Exercise, load_student, timeout_s: float | None = None,
                   workdir: str | None = None) -> ExerciseResult:
    """Grade one exercise in a sandbox; `load_student()` runs in the child and returns StudentCode."""
    limit = timeout_s if timeout_s is not None else exercise.timeout_s
    outcome = run_isolated(lambda: run_check(exercise, load_student()), limit, workdir)
    if outcome.kind == "returned":
        status, feedback = outcome.value
    elif outcome.kind == "timeout":
        status, feedback = "timeout", f"stopped after {limit:g}s: an endless loop, or a collective that never completes?"
    else:
        status, feedback = "error", (f"the process running your code ended abruptly (exit code {outcome.exitcode}): "
                                     "os._exit, a crash, or running out of memory")
    points = exercise.points if status == "passed" else 0
    return ExerciseResult(exercise.id, points, exercise.points, status, str(feedback))


def grade_notebook(path: str, only: list[str] | None = None, timeout_s: float | None = None) -> NotebookReport:
    """Grade every exercise (or those in `only`) of the notebook at `path`."""
    started = time.monotonic()
    notebook = read_notebook(path)
    chapter = notebook_chapter(notebook)
    if chapter not in CHAPTER_MODULES:
        known = ", ".join(CHAPTER_MODULES)
        what = f"chapter {chapter!r} is unknown" if chapter else "it names no chapter (metadata dtp.chapter)"
        raise UnusableInput(f"{path}: not a course notebook: {what}; known chapters: {known}")
    exercises = chapter_exercises(chapter)
    if only:
        exercises = [ex for ex in exercises if ex.id in only]
        if not exercises:
            raise UnusableInput(f"{path}: none of the --only exercises belongs to its chapter, {chapter}")
    definitions = extract_definitions(notebook, {name for ex in exercises for name in ex.reads})
    report = NotebookReport(path=str(path), chapter=chapter)
    workdir = str(Path(path).resolve().parent)  # where the learner's kernel would have run
    for exercise in exercises:
        report.add(grade_exercise(exercise, lambda: StudentCode.from_definitions(definitions), timeout_s, workdir))
    report.elapsed_s = round(time.monotonic() - started, 3)
    return report
