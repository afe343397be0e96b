"""Verdicts do not depend on how busy the machine is. A learner's laptop running other work, or a
CI machine shared with other jobs, must get the same verdicts as an idle one: here CPU-bound
processes keep every core busy (a load of about twice the cores, as on the fresh clone that once
refused the course's own pipeline) while the course's solutions are graded.

Two runs under load:
- every solution notebook through the command line, as a learner grades it (sandboxes, time
  limits, gloo worlds): every exercise must pass;
- the checks that start gloo worlds (the ones whose ranks wait on each other, where load shows
  first), their draws run again against the solutions: no draw may be refused.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from conftest import CHAPTER_NOTEBOOKS, REPO, solution_path
from grader.registry import chapter_exercises
from grader.student import StudentCode
from grader.transport import dumps, loads, plain

DRAWS_PER_WORLD_CHECK = 1  # test_check_draws runs more; this one adds the load


@pytest.fixture(scope="module")
def busy_machine():
    """One spinning process per core, for the duration of the module; all of them are killed
    (their own process group) when it ends, also when a test fails."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
                for _ in range(os.cpu_count() or 2)]
    try:
        yield len(spinners)
    finally:
        for spinner in spinners:
            os.killpg(spinner.pid, signal.SIGKILL)
            spinner.wait()


def test_every_solution_scores_full_marks_on_a_busy_machine(busy_machine, tmp_path):
    report_path = tmp_path / "report.json"
    finished = subprocess.run([sys.executable, "-m", "grader", "solutions", "--json", str(report_path)], cwd=REPO,
                              capture_output=True, text=True, timeout=1200)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    report = json.loads(report_path.read_text())
    refused = [f"{exercise['id']}: {exercise['status']}: {exercise['feedback']}"
               for notebook in report["notebooks"] for exercise in notebook["exercises"]
               if exercise["status"] != "passed"]
    assert not refused, f"with {busy_machine} spinning processes:\n" + "\n".join(refused)
    assert {notebook["chapter"] for notebook in report["notebooks"]} == set(CHAPTER_NOTEBOOKS)


WORLD_EXERCISES = [exercise for chapter in sorted(CHAPTER_NOTEBOOKS) for exercise in chapter_exercises(chapter)
                   if exercise.check.runs_world]


@pytest.mark.parametrize("exercise", WORLD_EXERCISES, ids=lambda exercise: exercise.id)
def test_world_checks_accept_the_solution_on_a_busy_machine(exercise, busy_machine):
    student = StudentCode.from_notebook(str(solution_path(exercise.chapter)), set(exercise.reads))
    rng = np.random.default_rng(20261201)
    for _ in range(DRAWS_PER_WORLD_CHECK):
        inputs = exercise.check.prepare(rng)
        data = loads(dumps(plain(exercise.check.collect(student, inputs))))
        exercise.check.judge(inputs, data)  # raises CheckFailed on a refused draw
