"""The pipeline chapter's interview questions and its registry: wrong answers are named, the
course's functions refused, every check registered with its points."""
import numpy as np
import pytest

from conftest import assert_fails, graded
from dtp.pp import schedules as pipeline
from grader.checks import pp


# --- interview ---

INTERVIEW_RIGHT = dict(bubble="(p - 1) / (m + p - 1)", peak="min(p, m)", messages="2 * m",
                       gib="2 * m * micro_batch * sequence * hidden * bytes_per_value / 2**30")


def interview(**changes) -> str:
    answers = {**INTERVIEW_RIGHT, **changes}
    return (f"def interview_bubble_fraction(p, m):\n    return {answers['bubble']}\n\n"
            f"def interview_peak_micro_batches(p, m):\n    return {answers['peak']}\n\n"
            f"def interview_boundary_messages(p, m):\n    return {answers['messages']}\n\n"
            "def interview_boundary_gib(m, micro_batch, sequence, hidden, bytes_per_value):\n"
            f"    return {answers['gib']}\n")


@pytest.mark.parametrize("changes, feedback", [
    (dict(bubble="(p - 1) / (m + p - 2)"), "the source notes' slip"),
    (dict(bubble="(p - 1) / m"), "relative to the ideal time"),
    (dict(bubble="7 / 71"), "interview_bubble_fraction("),  # the page's number: right only for the question asked
    (dict(peak="m"), "that is GPipe's m"),
    (dict(peak="p"), "never more than the m there are"),
    (dict(messages="1"), "does not send once per step"),
    (dict(messages="m"), "counts one direction"),
    (dict(messages="2 * m * (p - 1)"), "counts every boundary"),
    (dict(messages="128"), "interview_boundary_messages("),
    (dict(gib="m * micro_batch * sequence * hidden * bytes_per_value / 2**30"), "counts one direction"),
    (dict(gib="micro_batch * sequence * hidden * bytes_per_value / 2**30"), "as if the pipeline sent once per step"),
    (dict(gib="2 * m * micro_batch * sequence * hidden * bytes_per_value / 1e9"), "that is in GB"),
    (dict(gib="8.0"), "interview_boundary_gib("),
], ids=["7-over-70", "over-ideal", "copied-bubble", "gpipe-memory", "p-without-min", "once-per-step",
        "one-direction", "every-boundary", "copied-messages", "one-direction-gib", "one-activation", "gb",
        "copied-gib"])
def test_interview_rejects(tmp_notebook, changes, feedback):
    assert_fails(graded(tmp_notebook, "pp.interview", {"interview_bubble_fraction": interview(**changes)}), feedback)


def test_interview_refuses_the_course_functions(tmp_notebook):
    source = interview(bubble="__import__('dtp.pp.schedules').pp.schedules.bubble_fraction(p, m)")
    result = graded(tmp_notebook, "pp.interview", {"interview_bubble_fraction": source})
    assert result.status == "failed" and "course's reference" in result.feedback, result


def test_interview_asks_the_question_the_notebook_states():
    questions = pp.interview.Interview().prepare(np.random.default_rng(0))
    assert questions["interview_bubble_fraction"][0] == (8, 64)
    assert questions["interview_boundary_gib"][0] == (64, 1, 4096, 8192, 2)


def test_every_check_is_registered_with_its_points():
    from grader.registry import chapter_exercises
    points = {exercise.id: exercise.points for exercise in chapter_exercises("pp")}
    assert points == {"pp.gpipe_schedule": 1, "pp.one_f_one_b_schedule": 2, "pp.interleaved_schedule": 2,
                      "pp.zb_h1_schedule": 2, "pp.simulator": 3, "pp.closed_forms": 2, "pp.pipeline_1f1b": 4,
                      "pp.measured_bubble": 2, "pp.interview": 2}
    assert np.isclose(7 / 71, pipeline.bubble_fraction(8, 64))
