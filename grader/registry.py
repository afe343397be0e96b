"""Where exercises are declared. Each chapter module under grader/checks/ decorates one `Check`
class per exercise with `@exercise(id, points=...)`, so an exercise's id, points, time limit and
check live side by side.

A check reaches its verdict in three steps that run in two places:

    prepare(rng) -> inputs        the grader: draw this run's random inputs
    collect(student, inputs)      the sandbox: run the learner's code on them, return plain data
                                  (numbers, arrays, lists, dicts: see grader/transport.py)
    judge(inputs, data) -> str    the grader: compare the data with an oracle computed here;
                                  raise CheckFailed, or return what was verified

Only `collect` runs beside learner code. Whatever the learner's code does there (patch numpy,
replace this module's checks, forge its own result) it can only change the data, and the data
is judged in a process that never ran it, against inputs it did not choose.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

# The course's chapters in reading order; a chapter's checks live in grader/checks/<chapter>.py
# and the chapter is also the exercise id prefix. A chapter whose module is not written yet is
# simply not offered.
COURSE_CHAPTERS = ("memory", "dp", "tp", "pp", "ep", "zero", "overlap", "cp", "topology")
CHAPTER_MODULES = {chapter: f"grader.checks.{chapter}" for chapter in COURSE_CHAPTERS
                   if importlib.util.find_spec(f"grader.checks.{chapter}") is not None}

DEFAULT_TIMEOUT_S = 60.0


class Check:
    """One exercise's check. Subclasses set the class attributes and the three steps; their
    docstring says what is verified (`Verifies:`) and how a learner could fake it and what stops
    that (`Fakes:`), so that every check states its threat model."""

    reads: tuple[str, ...] = ()  # the notebook's top-level names collect reads
    references: tuple[str, ...] = ()  # dotted names of course code that solves this exercise
    timeout_s: float = DEFAULT_TIMEOUT_S
    runs_world: bool = False  # collect starts gloo worlds (slow: fewer repeats in tests)
    # Modules the grader imports before forking the sandbox, where this check's ranks would import
    # them on first use (dtp.common.world.LAZY_TORCH_MODULES, set on the world checks); a check whose
    # ranks use neither optimizers nor nn.Modules leaves it empty and saves a second of grading.
    preimport: tuple[str, ...] = ()

    def prepare(self, rng):
        """Random inputs for this run, drawn in the grader."""
        return None

    def collect(self, student, inputs):
        """In the sandbox: call the learner's code (attributes of `student`) on `inputs` and
        return plain data. Raise CheckFailed for an answer of the wrong form."""
        raise NotImplementedError

    def judge(self, inputs, data) -> str:
        """In the grader: raise CheckFailed with actionable feedback, or return what was verified."""
        raise NotImplementedError


@dataclass(frozen=True)
class Exercise:
    id: str
    points: int
    check: Check

    @property
    def chapter(self) -> str:
        return self.id.split(".", 1)[0]

    @property
    def reads(self) -> tuple[str, ...]:
        return self.check.reads

    @property
    def timeout_s(self) -> float:
        return self.check.timeout_s


_EXERCISES: dict[str, Exercise] = {}


def exercise(exercise_id: str, *, points: int):
    """Register the decorated Check subclass as the check of `exercise_id` (`<chapter>.<name>`)."""
    chapter = exercise_id.split(".", 1)[0]
    if chapter not in CHAPTER_MODULES or "." not in exercise_id:
        raise ValueError(f"exercise id {exercise_id!r} must be <chapter>.<name> with a known chapter")

    def register(check_class: type[Check]) -> type[Check]:
        if exercise_id in _EXERCISES:
            raise ValueError(f"exercise {exercise_id} is declared twice")
        if not issubclass(check_class, Check):
            raise TypeError(f"{check_class.__name__} must subclass grader.registry.Check")
        _EXERCISES[exercise_id] = Exercise(exercise_id, points, check_class())
        return check_class

    return register


def chapter_exercises(chapter: str) -> list[Exercise]:
    """The exercises of a chapter, in the order they are declared (the notebook's order)."""
    importlib.import_module(CHAPTER_MODULES[chapter])
    return [ex for ex in _EXERCISES.values() if ex.chapter == chapter]


def find_exercise(exercise_id: str) -> Exercise | None:
    chapter = exercise_id.split(".", 1)[0]
    if chapter not in CHAPTER_MODULES:
        return None
    importlib.import_module(CHAPTER_MODULES[chapter])
    return _EXERCISES.get(exercise_id)


def all_exercise_ids() -> list[str]:
    return [ex.id for chapter in CHAPTER_MODULES for ex in chapter_exercises(chapter)]
