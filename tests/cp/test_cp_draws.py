"""The context-parallel checks' draws: no right answer refused by float rounding, and every named
slip refused on every draw (the slip's data computed here, judged by the check's own judge)."""
import math

import numpy as np
import pytest

from grader.compare import CheckFailed
from grader.registry import find_exercise

DRAWS = range(100)


def prepared(exercise_id: str, seed: int):
    return find_exercise(exercise_id).check.prepare(np.random.default_rng(seed))


def tokens_to_hide_in_another_order(flops, bandwidth, hidden, kv_hidden, dtype_bytes):
    # algebraically the same as the solution's kv·bytes·F / (2·h·B), rounded differently
    return math.ceil(flops / bandwidth * kv_hidden * dtype_bytes / (2 * hidden))


def test_tokens_to_hide_computed_in_another_order_is_right_on_every_draw():
    """Where kv·bytes·F / (2·h·B) is an integer (22500), this order gave 22501 and was refused: 257 of
    the 23,232 questions the check could draw. They are no longer drawn."""
    check = find_exercise("cp.interview").check
    for seed in range(300):
        questions = prepared("cp.interview", seed)
        answers = {name: [check.expected(name, *args) for args in cases] for name, cases in questions.items()}
        answers["interview_tokens_to_hide"] = [tokens_to_hide_in_another_order(*args)
                                               for args in questions["interview_tokens_to_hide"]]
        check.judge(questions, answers)


def test_an_integer_answer_one_off_says_so():
    check = find_exercise("cp.interview").check
    questions = {"interview_tokens_to_hide": [(989e12, 50e9, 16384, 1024, 2)]}
    with pytest.raises(CheckFailed) as failure:
        check.judge(questions, {"interview_tokens_to_hide": [1238]})
    assert "is 1238, expected 1237 (yours is 1 more than the answer)" in str(failure.value)
