"""Every check accepts the course's own solution on every random draw (a check that fails a
correct answer once in a hundred fails learners, and CI, at random), reads only the notebook
names it declares, and judges what `collect` returns after it crossed from the sandbox."""
import numpy as np
import pytest

from conftest import CHAPTER_NOTEBOOKS, solution_path
from grader.registry import chapter_exercises
from grader.student import StudentCode
from grader.transport import dumps, loads, plain

EXERCISES = [exercise for chapter in sorted(CHAPTER_NOTEBOOKS) for exercise in chapter_exercises(chapter)]
DRAWS_WITHOUT_WORLDS, DRAWS_WITH_WORLDS = 300, 3


class RecordingStudent:
    """The course's solution, recording which of its names a check reads."""

    def __init__(self, student):
        self._student, self.read = student, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._student, name)


@pytest.fixture(scope="module")
def solutions():
    return {chapter: StudentCode.from_notebook(str(solution_path(chapter)),
                                               {name for exercise in chapter_exercises(chapter) for name in exercise.reads})
            for chapter in CHAPTER_NOTEBOOKS}


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda exercise: exercise.id)
def test_the_solution_passes_every_draw(exercise, solutions):
    rng = np.random.default_rng(20261130)
    draws = DRAWS_WITH_WORLDS if exercise.check.runs_world else DRAWS_WITHOUT_WORLDS
    for _ in range(draws):
        student = RecordingStudent(solutions[exercise.chapter])
        inputs = exercise.check.prepare(rng)
        data = loads(dumps(plain(exercise.check.collect(student, inputs))))
        exercise.check.judge(inputs, data)  # raises CheckFailed on a rejected draw
        assert student.read <= set(exercise.reads), f"{exercise.id} reads undeclared names {student.read - set(exercise.reads)}"


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda exercise: exercise.id)
def test_every_check_states_what_it_verifies_and_how_it_could_be_faked(exercise):
    doc = type(exercise.check).__doc__ or ""
    assert "Verifies:" in doc and "Fakes:" in doc, f"{exercise.id}: say what is verified and what stops a fake"
