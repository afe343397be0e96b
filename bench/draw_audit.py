"""Is every wrong answer refused on every draw, not just on the one a test happened to get?

A pytest plugin: each test that grades a notebook (tests/conftest.py `graded`) and gets a refusal
has that same notebook re-judged here, in this process, on seeds 0..N-1 of the check's random
draw. A wrong answer accepted on any seed is a check that lets it through at random (two were
found so: pp.simulator's message time and tp.costs' t = 2, each accepted about 1 grading in 100).

    PYTHONPATH=bench:. DRAW_AUDIT_SEEDS=100 .venv/bin/python -m pytest -p draw_audit tests/tp

Prints one line per refusal that any seed accepted, at the end. In-process means without the
sandbox: an answer refused for calling the course's own functions (the sandbox's guard) is
accepted here on every seed, and is listed as such, not as a hole. Checks that run gloo worlds
are not re-judged (seconds per draw); their draws are forced in `prepare` and read by eye.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

SEEDS = int(os.environ.get("DRAW_AUDIT_SEEDS", "100"))
_found: list[str] = []
_current = {"test": "?"}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current["test"] = item.nodeid
    yield


def _accepted_seeds(exercise, path: str) -> int:
    from grader.compare import CheckFailed
    from grader.student import StudentCode
    from grader.transport import dumps, loads, plain

    accepted = 0
    for seed in range(SEEDS):
        student = StudentCode.from_notebook(path, set(exercise.reads))
        inputs = exercise.check.prepare(np.random.default_rng(seed))
        try:
            exercise.check.judge(inputs, loads(dumps(plain(exercise.check.collect(student, inputs)))))
            accepted += 1
        except CheckFailed:
            pass
        except Exception:  # noqa: BLE001 - the wrong answer raised: refused, as the grader would
            pass
    return accepted


def pytest_configure(config):
    import grader.grading as grading
    from grader.registry import find_exercise

    grade_notebook = grading.grade_notebook

    def audited(path, only=None, timeout_s=None):
        report = grade_notebook(path, only, timeout_s)
        for result in report.exercises:
            exercise = find_exercise(result.id)
            if result.status == "failed" and not exercise.check.runs_world:
                accepted = _accepted_seeds(exercise, str(path))
                if accepted:
                    why = ("the sandbox's guard refused it" if "course's" in result.feedback or "grader" in result.feedback
                           else "A HOLE")
                    _found.append(f"{_current['test']} | {result.id} | accepted on {accepted}/{SEEDS} seeds | {why}")
        return report

    grading.grade_notebook = audited


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"draw audit over {SEEDS} seeds: "
                                + ("every refused answer refused on every seed" if not _found else ""))
    for line in _found:
        terminalreporter.write_line("  " + line)
