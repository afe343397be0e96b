"""What crosses from the sandbox to the grader: numbers of every kind as numbers, anything else as a
description named after the learner's type, and never an object that runs code in the grader."""
import decimal
import fractions
import pickle

import numpy as np
import pytest

from conftest import grade
from grader.compare import CheckFailed, expect_answer
from grader.transport import Opaque, UnreadableData, dumps, loads, plain


def across(value):
    """`value` as the grader receives it from the sandbox."""
    return loads(dumps(plain(value)))


@pytest.mark.parametrize("value, expected", [
    (fractions.Fraction(3, 8), 0.375),
    (fractions.Fraction(12, 4), 3),
    (decimal.Decimal("0.125"), 0.125),
    (decimal.Decimal("7.000"), 7),
    (np.float32(0.5), 0.5),
    (np.int64(5), 5),
    (np.uint8(7), 7),
], ids=["fraction", "integral-fraction", "decimal", "integral-decimal", "numpy-scalar", "numpy-int64", "numpy-uint8"])
def test_exact_and_numpy_numbers_arrive_as_builtin_numbers(value, expected):
    arrived = across(value)
    assert type(arrived) is type(expected) and arrived == expected


def test_a_huge_integral_fraction_stays_exact():
    assert across(fractions.Fraction(10**30 * 7, 7)) == 10**30


def test_a_bool_stays_a_bool_and_is_not_a_number_to_compare():
    assert across(True) is True
    with pytest.raises(CheckFailed, match="should be a number, but it is a bool"):
        expect_answer(across(True), 1.0, "answer")


def test_a_fraction_answer_is_compared_as_the_number_it_is():
    expect_answer(across(fractions.Fraction(1, 3)), 1 / 3, "bubble")
    expect_answer(fractions.Fraction(1, 3), 1 / 3, "bubble")  # judged in-process, as in tests
    with pytest.raises(CheckFailed, match="is 0.5, expected"):
        expect_answer(across(fractions.Fraction(1, 2)), 1 / 3, "bubble")


class Bubble:
    def __repr__(self):
        return "Bubble(3/8)"


class SneakyReal(fractions.Fraction):
    """A learner's subclass: whatever it overrides, the grader receives a builtin number."""
    def __eq__(self, other):
        return True


def test_a_learners_number_subclass_arrives_as_a_builtin_number():
    arrived = across(SneakyReal(1, 4))
    assert type(arrived) is float and arrived == 0.25


def test_an_unknown_value_is_described_by_its_own_type_name_never_opaque():
    arrived = across({"answer": Bubble()})["answer"]
    assert isinstance(arrived, Opaque) and not isinstance(arrived, tuple)
    assert type(arrived).__name__ == "Bubble" and repr(arrived) == "Bubble(3/8)"
    with pytest.raises(CheckFailed) as failure:
        expect_answer(arrived, 0.375, "bubble_fraction(3, 5)")
    assert "it is a Bubble" in str(failure.value) and "Opaque" not in str(failure.value)


def test_a_forged_type_name_cannot_break_the_grader():
    forged = pickle.dumps(Opaque("bad\x00name" * 50, 12345))
    arrived = loads(forged)
    assert "\x00" not in type(arrived).__name__ and len(type(arrived).__name__) <= 80 and arrived.text == ""


def test_objects_that_would_run_code_are_refused():
    with pytest.raises(UnreadableData, match="fractions.Fraction"):
        loads(pickle.dumps(fractions.Fraction(1, 3)))  # only plain() output is read, never learner objects
    with pytest.raises(UnreadableData, match="os.system"):
        loads(b"cos\nsystem\n(S'echo hi'\ntR.")


def test_a_fraction_result_passes_a_formula_check(tmp_notebook):
    source = ("from fractions import Fraction\n\n"
              "def model_state_memory(n_params, recipe, unit):\n"
              "    per_parameter = {'fp32_adam': 16, 'mixed_adam': 16, 'mixed_adam_fp32_grad_accum': 20, "
              "'mixed_sgd_momentum': 12}[recipe]\n"
              "    units = {'B': 1, 'MB': 10**6, 'GB': 10**9, 'TB': 10**12, 'GiB': 2**30, 'TiB': 2**40}\n"
              "    return Fraction(int(n_params) * per_parameter, units[unit])\n")
    result = grade(tmp_notebook("memory", {"model_state_memory": source}), "memory.model_states")
    assert result["memory.model_states"].status == "passed", result["memory.model_states"].feedback
