"""Assertions for checks, each failing with feedback a learner can act on, and what a failed gloo
world of the learner's ranks tells them (`world_failure`, `RanksFailed`)."""
from __future__ import annotations

import decimal
import numbers

import numpy as np
import torch


class CheckFailed(AssertionError):
    """The learner's answer is wrong; the message says how."""


class RanksFailed(Exception):
    """Raised by a judge for a gloo world whose ranks failed in the sandbox (raised, deadlocked,
    hit `raise NotImplementedError`): the exercise gets that status, not "failed"."""

    def __init__(self, status: str, feedback: str):
        super().__init__(feedback)
        self.status = status


def world_failure(world) -> tuple[str, str]:
    """(status, feedback) for a gloo world whose ranks failed."""
    if world.exc_type == "NotImplementedError":
        return "missing", "not implemented yet: a rank hit `raise NotImplementedError`"
    if world.exc_type == "UsesCourseReference":
        return "reference", str(world).split("UsesCourseReference: ", 1)[-1]
    if world.exc_type == "CheckFailed":
        return "failed", str(world).split("CheckFailed: ", 1)[-1]
    if world.exc_type == "MemoryError" or "can't allocate memory" in str(world):
        from .sandbox import MEMORY_BUDGET_BYTES
        return "error", (f"{str(world)[:200]}: the grader allows each exercise {MEMORY_BUDGET_BYTES / 2**30:g} GiB "
                         "per process")
    return ("timeout" if world.kind in ("collective_timeout", "timeout") else "error"), str(world)


def distinct(actual, expected, least: int = 6) -> tuple[str, str]:
    """The two numbers as text, each in the shortest form (at least `least` significant digits)
    that tells them apart: 1.13202e+10 and 1.13202e+10 hide a difference that 11320210000 and
    11320200000 show. Whole numbers print as integers."""
    actual, expected = float(actual), float(expected)
    if all(x.is_integer() and abs(x) < 1e16 for x in (actual, expected)):
        return str(int(actual)), str(int(expected))
    for digits in range(least, 18):
        shown = f"{actual:.{digits}g}", f"{expected:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return repr(actual), repr(expected)


def _relation(actual: float, expected: float) -> str:
    """How a wrong number relates to the right one, in words that show the difference: a ratio
    where it is far from 1, the difference where a ratio would print as 1x."""
    if not expected:
        return "the answer is 0"
    difference = actual - expected
    if float(actual).is_integer() and float(expected).is_integer() and abs(difference) < 1e6:
        return f"yours is {abs(int(difference))} {'more' if difference > 0 else 'less'} than the answer"
    ratio = actual / expected
    if abs(ratio - 1) >= 1e-3:
        return f"yours is {ratio:.4g}x the answer"
    return f"yours is {abs(difference) / abs(expected):.2g} of the answer too {'high' if difference > 0 else 'low'}"


def expect(condition: bool, feedback: str) -> None:
    if not condition:
        raise CheckFailed(feedback)


def as_numpy(value, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, (int, float, np.number)):
        return np.asarray(value)
    raise CheckFailed(f"{what} should be an array or tensor, but it is a {type(value).__name__}")


def expect_close(actual, expected, what: str, *, rtol: float = 1e-5, atol: float = 1e-6,
                 check_dtype: bool = True) -> None:
    """`actual` must have the shape (and dtype) of `expected`, be finite, and match it."""
    expected_np = as_numpy(expected, "the reference")
    actual_np = as_numpy(actual, what)
    if actual_np.shape != expected_np.shape:
        raise CheckFailed(f"{what} has shape {actual_np.shape}, expected {expected_np.shape}")
    if check_dtype and actual_np.dtype != expected_np.dtype:
        raise CheckFailed(f"{what} has dtype {actual_np.dtype}, expected {expected_np.dtype}")
    if actual_np.dtype.kind in "fc" and not np.all(np.isfinite(actual_np)):
        raise CheckFailed(f"{what} contains NaN or inf")
    if not np.allclose(actual_np, expected_np, rtol=rtol, atol=atol):
        error = np.abs(actual_np.astype(np.float64) - expected_np.astype(np.float64))
        worst = np.unravel_index(np.argmax(error), error.shape) if error.ndim else ()
        mine, right = distinct(actual_np[worst], expected_np[worst])
        raise CheckFailed(f"{what} differs from the reference: at index {tuple(int(i) for i in worst)} it is {mine} "
                          f"instead of {right} (max abs error {error.max():.3g})")


def expect_number(actual, expected: float, what: str, *, rel: float = 1e-6) -> None:
    """A scalar answer within a relative tolerance, with the ratio reported when it is off."""
    if not _is_number(actual):
        raise CheckFailed(f"{what} should be a number, but it is a {type(actual).__name__}")
    actual = float(actual)
    if not np.isfinite(actual):
        raise CheckFailed(f"{what} is {actual}, not a finite number")
    if not np.isclose(actual, expected, rtol=rel, atol=0.0):
        mine, right = distinct(actual, expected)
        raise CheckFailed(f"{what} is {mine}, expected {right} ({_relation(actual, expected)})")


def _is_number(value) -> bool:
    """A real number of any type (int, float, numpy scalars, Fraction, Decimal), but not a bool. Data
    from the sandbox holds builtin numbers only (transport converts the others); this also serves
    checks judged in-process, as the tests do."""
    return isinstance(value, (numbers.Real, decimal.Decimal)) and not isinstance(value, (bool, np.bool_))


def expect_answer(actual, expected: float, what: str, *, rel: float = 1e-6, slips: dict[str, float] | None = None) -> None:
    """A scalar answer within a relative tolerance of `expected`. Only a wrong answer is compared
    with `slips` (feedback -> the value that mistake gives), so a slip that happens to equal the
    right answer for some inputs (busbw = algbw at n = 2) never fails a correct one."""
    if not _is_number(actual):
        raise CheckFailed(f"{what} should be a number, but it is a {type(actual).__name__}")
    actual = float(actual)
    if not np.isfinite(actual):
        raise CheckFailed(f"{what} is {actual}, not a finite number")
    if np.isclose(actual, expected, rtol=rel, atol=0.0):
        return
    matching = [feedback for feedback, value in (slips or {}).items() if np.isclose(actual, value, rtol=rel, atol=0.0)]
    mine, right = distinct(actual, expected)
    if len(matching) == 1:
        raise CheckFailed(f"{what} is {mine}, expected {right}: {matching[0]}")
    if matching:  # slips that coincide for these inputs (at p = 2, p - 2 vanishes): any may be yours
        raise CheckFailed(f"{what} is {mine}, expected {right}; for these inputs more than one mistake gives "
                          "that value: " + "; or ".join(matching))
    expect_number(actual, expected, what, rel=rel)
