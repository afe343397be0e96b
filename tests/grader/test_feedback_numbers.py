"""Numbers in feedback are printed with the digits that tell the learner's from the right one
(grader.compare.distinct): six significant digits once printed "is 1.13202e+10, expected
1.13202e+10", and a ratio "1x the answer"."""
import numpy as np
import pytest

from grader.compare import CheckFailed, distinct, expect_answer, expect_close


def refusal(function, *args, **kwargs) -> str:
    with pytest.raises(CheckFailed) as failure:
        function(*args, **kwargs)
    return str(failure.value)


def test_numbers_that_agree_in_six_digits_are_printed_until_they_differ():
    feedback = refusal(expect_answer, 1.1320234e10 + 0.5, 1.1320234e10 + 9.25, "bytes_per_layer(...)", rel=1e-12)
    mine, right = feedback.split(" is ", 1)[1].split(", expected ")
    assert mine != right.split(" ")[0] and "1.13202e+10" not in feedback, feedback


def test_whole_numbers_are_printed_whole_with_their_difference():
    feedback = refusal(expect_answer, 22501, 22500, "interview_tokens_to_hide(...)", rel=1e-9)
    assert "is 22501, expected 22500 (yours is 1 more than the answer)" in feedback
    feedback = refusal(expect_answer, 11320200000, 11320210000, "ring_bytes_per_layer(...)", rel=1e-9)
    assert "is 11320200000, expected 11320210000 (yours is 10000 less than the answer)" in feedback


def test_a_ratio_is_given_only_where_it_shows():
    assert "(yours is 2.188x the answer)" in refusal(expect_answer, 0.4375, 0.2, "bubble_fraction(8, 16)")
    feedback = refusal(expect_answer, 1.0000001, 1.0, "f()", rel=1e-9)
    assert "1x" not in feedback and "1e-07 of the answer too high" in feedback


def test_arrays_show_the_differing_element_with_enough_digits():
    feedback = refusal(expect_close, np.array([1.0, 2.00000011]), np.array([1.0, 2.0]), "out", rtol=1e-9, atol=0)
    assert "it is 2.0000001 instead of 2 " in feedback


@pytest.mark.parametrize("a, b", [(1.5, 1.5000004), (123456.7, 123456.8), (3e-9, 3.0000001e-9), (7.0, 7.5)])
def test_distinct_always_tells_two_different_numbers_apart(a, b):
    mine, right = distinct(a, b)
    assert mine != right and float(mine) == pytest.approx(a, rel=1e-15) and float(right) == pytest.approx(b, rel=1e-15)
