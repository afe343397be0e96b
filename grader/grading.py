"""Grading: each exercise's check draws inputs here, runs the learner's code on them in a
sandbox (grader/sandbox.py), and judges the plain data that comes back here."""
from __future__ import annotations

import time
import traceback
from pathlib import Path

import numpy as np

from dtp.common.threads import torch_on_one_thread
from dtp.common.world import import_lazy_torch_modules

from . import guard, landlock
from .compare import CheckFailed, RanksFailed, world_failure
from .notebook import NotebookCode, UnusableInput, read_course_notebook
from .registry import Exercise, chapter_exercises
from .report import ExerciseResult, NotebookReport, one_line
from .sandbox import run_isolated
from .student import MissingDefinition, StudentCode
from .transport import plain

NOT_IMPLEMENTED = "not implemented yet{where}: replace the `raise NotImplementedError` with your code"


def _where_in_notebook(exc: BaseException) -> str:
    """' (in ring_all_reduce, line 3 of its cell)' for the innermost frame of the learner's code."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename.startswith("<notebook cell") or "ipykernel_" in frame.filename:
            return f" (in {frame.name}, line {frame.lineno} of its cell)"
    return ""


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:240]}" if text else type(exc).__name__


def collect_in_sandbox(exercise: Exercise, load_student, inputs) -> tuple[str, object]:
    """Runs in the sandbox: guard the course's answers, load the learner's code, run `collect`.
    Returns ("data", plain data) or (status, feedback) with status missing, error, failed,
    timeout or reference."""
    from dtp.common.world import WorldError

    guard.install(exercise.check.references)
    # Learner code can find the check object (the stack, gc): leave it only `collect`.
    guard.seal(exercise.check, inputs, grader_steps=(judge, verdict, grade_exercise, grade_notebook))
    try:
        data = exercise.check.collect(load_student(), inputs)
        if guard.tripped:  # the learner's code caught the trip and went on
            return "reference", guard.tripped[0]
        return "data", plain(data)
    except guard.UsesCourseReference as exc:
        return "reference", str(exc)
    except CheckFailed as failed:
        return "failed", str(failed)
    except MissingDefinition as missing:
        return "missing", str(missing)
    except NotImplementedError as exc:
        return "missing", NOT_IMPLEMENTED.format(where=_where_in_notebook(exc))
    except WorldError as world:
        return world_failure(world)
    except SystemExit as exc:
        return "error", f"your code called sys.exit({exc.code!r}){_where_in_notebook(exc)}; return a value instead"
    except BaseException as exc:  # noqa: BLE001 - anything the learner's code raises costs only this exercise
        if _out_of_memory(exc):
            return "error", _memory_feedback(exc)
        if isinstance(exc, PermissionError) and landlock.abi_version():
            return "error", f"{_short(exc)}{_where_in_notebook(exc)}: {CONFINED}"
        return "error", f"{_short(exc)}{_where_in_notebook(exc)}"


CONFINED = ("the grader lets your code, and any process it starts, read only its notebook's folder, Python and "
            "the course's infrastructure (not the solutions or the course's answers), and write only temporary files")


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or "can't allocate memory" in str(exc) or "out of memory" in str(exc).lower()


def _memory_feedback(exc: BaseException) -> str:
    from .sandbox import MEMORY_BUDGET_BYTES
    return (f"your code ran out of memory{_where_in_notebook(exc)}: the grader allows each exercise "
            f"{MEMORY_BUDGET_BYTES / 2**30:g} GiB per process ({_short(exc)[:120]})")


def judge(exercise: Exercise, inputs, data) -> tuple[str, str]:
    """(status, feedback) from the data the learner's code produced; runs in the grader."""
    try:
        return "passed", exercise.check.judge(inputs, data)
    except CheckFailed as failed:
        return "failed", str(failed)
    except RanksFailed as ranks:
        return _learner_status(ranks.status, str(ranks))
    except Exception as exc:  # noqa: BLE001 - data of an unexpected shape (a dict where a list was due, ...)
        return "failed", f"your code returned data of an unexpected form ({_short(exc)})"


def verdict(exercise: Exercise, inputs, outcome, limit_s: float) -> tuple[str, str]:
    """(status, feedback) for a sandbox outcome: only `judge` can say passed."""
    if outcome.kind == "timeout":
        return "timeout", f"stopped after {limit_s:g}s: an endless loop, or a collective that never completes?"
    if outcome.kind == "unreadable":
        return "error", f"your code's results could not be read back: {outcome.value}"
    if outcome.kind == "unconfined":
        return "error", ("the kernel refused the grader's Landlock rules for the sandbox, so your code was not run; "
                         "grade on a system without Landlock, or report this")
    if outcome.kind != "returned":
        return "error", (f"the process running your code ended abruptly (exit code {outcome.exitcode}): "
                         "os._exit, a crash, or running out of memory")
    value = outcome.value
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str)):
        return "error", "your code's results came back in a form the grader did not send"
    status, body = value
    if status == "data":
        return judge(exercise, inputs, body)
    return _learner_status(status, str(body))


def _learner_status(status: str, feedback: str) -> tuple[str, str]:
    """A status reported from the sandbox, which can lower a score but never raise it."""
    if status == "reference" and feedback.startswith(f"calls {guard.GRADER}"):
        return "failed", f"reaches into the grader instead of answering: {feedback}"
    if status == "reference":
        return "failed", f"uses the course's reference, not your own code: {feedback}"
    if status in ("missing", "error", "failed", "timeout"):
        return status, feedback
    return "error", "your code's results came back in a form the grader did not send"


def grade_exercise(exercise: Exercise, load_student, timeout_s: float | None = None,
                   workdir: str | None = None) -> ExerciseResult:
    """Grade one exercise; `load_student()` runs in the sandbox and returns StudentCode."""
    limit = timeout_s if timeout_s is not None else exercise.timeout_s
    with torch_on_one_thread():  # the oracles' small tensors, here as in the sandbox
        inputs = exercise.check.prepare(np.random.default_rng())
    import_lazy_torch_modules(exercise.check.preimport)  # here, once: the sandbox and its ranks inherit them
    guard.preload(exercise.check)  # the confined sandbox can no longer read these modules' files
    outcome = run_isolated(lambda: collect_in_sandbox(exercise, load_student, inputs), limit, workdir)
    with torch_on_one_thread():
        status, feedback = verdict(exercise, inputs, outcome, limit)
    points = exercise.points if status == "passed" else 0
    return ExerciseResult(exercise.id, points, exercise.points, status, one_line(feedback))


# Libraries a notebook may import that are safe to import in the grader's own process: each
# sandbox is forked from it, so what is imported here once is not imported again per exercise
# (a notebook importing the course's widgets pulls in matplotlib and ipywidgets: most of a second).
PRELOADED_PACKAGES = ("dtp", "torch", "numpy", "matplotlib", "ipywidgets", "IPython")


def preload_library_imports(definitions) -> None:
    """Import, here, the libraries the notebook's import statements name, at top level or inside
    its functions (the confined sandbox cannot read the course's answer modules, so what a
    function imports must already be loaded); never a module of the learner's own (which would
    run their code in the grader)."""
    import ast
    import importlib

    nodes = [node for statement in definitions.statements for node in ast.walk(statement.node)]
    for node in nodes:
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        for name in names:
            if name.split(".")[0] in PRELOADED_PACKAGES:
                try:
                    importlib.import_module(name)
                except Exception:  # noqa: BLE001 - the sandbox will report the learner's broken import
                    pass


def grade_notebook(path: str, only: list[str] | None = None, timeout_s: float | None = None) -> NotebookReport:
    """Grade every exercise (or those in `only`) of the notebook at `path`."""
    started = time.monotonic()
    notebook, chapter = read_course_notebook(path)
    exercises = chapter_exercises(chapter)
    if only:
        exercises = [ex for ex in exercises if ex.id in only]
        if not exercises:
            raise UnusableInput(f"{path}: none of the --only exercises belongs to its chapter, {chapter}")
    code = NotebookCode.parse(notebook)
    preload_library_imports(code.definitions({name for ex in exercises for name in ex.reads}))
    report = NotebookReport(path=str(path), chapter=chapter)
    workdir = str(Path(path).resolve().parent)  # where the learner's kernel would have run
    for exercise in exercises:
        # Only what this exercise reads, and the statements that provide it (grader/notebook.py).
        definitions = code.definitions(exercise.reads)
        report.add(grade_exercise(exercise, lambda definitions=definitions: StudentCode.from_definitions(definitions, as_main=True),
                                  timeout_s, workdir))
    report.elapsed_s = round(time.monotonic() - started, 3)
    return report
