"""Every check accepts the course's own solution on every random draw (a check that fails a
correct answer once in a hundred fails learners, and CI, at random), reads only the notebook
names it declares, and judges what `collect` returns after it crossed from the sandbox.

The checks that start gloo worlds (whose ranks wait on each other, where load shows first) draw
while CPU-bound processes keep every core busy: no draw may be refused because the machine is
busy."""
import numpy as np
import pytest

from conftest import CHAPTER_NOTEBOOKS, solution_path
from grader.registry import chapter_exercises
from grader.student import StudentCode
from grader.transport import dumps, loads, plain

EXERCISES = [exercise for chapter in sorted(CHAPTER_NOTEBOOKS) for exercise in chapter_exercises(chapter)]
WORLD_EXERCISES = [exercise for exercise in EXERCISES if exercise.check.runs_world]
# The known random rejections of correct answers came 1 in 9 to 1 in 30 gradings: 50 draws find them.
DRAWS_WITHOUT_WORLDS, DRAWS_WITH_WORLDS = 50, 2
# Checks whose every draw runs a whole planner or layout search, or simulates rings over large
# arrays (a second or more each under load): fewer draws, each of which prepare() already forces to
# contain every case the check must cover.
FEWER_DRAWS = {"topology.planner": 10, "topology.interview": 25, "dp.ring_allreduce_numpy": 20}


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


def _draw_and_judge(exercise, solutions, draws: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(draws):
        student = RecordingStudent(solutions[exercise.chapter])
        inputs = exercise.check.prepare(rng)
        data = loads(dumps(plain(exercise.check.collect(student, inputs))))
        exercise.check.judge(inputs, data)  # raises CheckFailed on a rejected draw
        assert student.read <= set(exercise.reads), f"{exercise.id} reads undeclared names {student.read - set(exercise.reads)}"


@pytest.mark.parametrize("exercise", [e for e in EXERCISES if not e.check.runs_world], ids=lambda exercise: exercise.id)
def test_the_solution_passes_every_draw(exercise, solutions):
    _draw_and_judge(exercise, solutions, FEWER_DRAWS.get(exercise.id, DRAWS_WITHOUT_WORLDS), 20261130)


def _rounded_quotients() -> dict:
    """(exercise, function) -> the quotient its answer rounds up or down, from the question's numbers:
    every answer of the course that is a ceil() or floor() of a quotient of floats."""
    from dtp.zero import formulas as zero
    from grader.checks.cp.costs import _hiding_quotient
    from grader.checks.zero.interview import _rooms

    return {("cp.interview", "interview_tokens_to_hide"): lambda *question: [_hiding_quotient(*question)],
            ("zero.interview", "interview_fewest_gpus_zero3"):
                lambda *question: [zero.model_state_bytes_per_gpu(question[0], 1, 3) / room for room in _rooms(*question)],
            ("overlap.interview", "interview_fewest_chunks"): lambda allgather, gemm: [gemm / (gemm - allgather)]}


def test_answers_that_round_a_quotient_are_asked_only_where_it_is_clear_of_an_integer():
    """Where the exact quotient is an integer, another order of the same arithmetic lands just above it
    and its ceiling is one more: a right answer refused by rounding (cp.interview's 22501 for 22500)."""
    from grader.checks.common import clear_of_integers
    from grader.registry import find_exercise

    for (exercise_id, name), quotients in _rounded_quotients().items():
        check = find_exercise(exercise_id).check
        for seed in range(300):
            for question in check.prepare(np.random.default_rng(seed))[name]:
                assert all(clear_of_integers(q) for q in quotients(*question)), (exercise_id, question)


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda exercise: exercise.id)
def test_every_check_states_what_it_verifies_and_how_it_could_be_faked(exercise):
    doc = type(exercise.check).__doc__ or ""
    assert "Verifies:" in doc and "Fakes:" in doc, f"{exercise.id}: say what is verified and what stops a fake"


# Last in the module: the spinning processes start with the first of these tests and end with the module.
@pytest.mark.parametrize("exercise", WORLD_EXERCISES, ids=lambda exercise: exercise.id)
def test_world_checks_accept_the_solution_on_a_busy_machine(exercise, solutions, busy_machine):
    _draw_and_judge(exercise, solutions, DRAWS_WITH_WORLDS, 20261201)
