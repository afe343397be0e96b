"""Where exercises are declared: each chapter module under grader/checks/ decorates its checks
with `@exercise(...)`, so an exercise's id, points, time limit and check live side by side."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

# Chapter name -> module holding its checks. The chapter is also the exercise id prefix.
CHAPTER_MODULES = {
    "memory": "grader.checks.memory",
    "dp": "grader.checks.dp",
}

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Exercise:
    id: str
    points: int
    check: Callable  # check(student) -> feedback on success; raises CheckFailed otherwise
    reads: tuple[str, ...]  # the notebook's top-level names the check reads (extraction keeps what binds them)
    timeout_s: float

    @property
    def chapter(self) -> str:
        return self.id.split(".", 1)[0]


_EXERCISES: dict[str, Exercise] = {}


def exercise(exercise_id: str, *, points: int, reads: tuple[str, ...], timeout_s: float = DEFAULT_TIMEOUT_S):
    """Register the decorated function as the check of `exercise_id` (`<chapter>.<name>`)."""
    chapter = exercise_id.split(".", 1)[0]
    if chapter not in CHAPTER_MODULES or "." not in exercise_id:
        raise ValueError(f"exercise id {exercise_id!r} must be <chapter>.<name> with a known chapter")

    def register(check: Callable) -> Callable:
        if exercise_id in _EXERCISES:
            raise ValueError(f"exercise {exercise_id} is declared twice")
        _EXERCISES[exercise_id] = Exercise(exercise_id, points, check, tuple(reads), timeout_s)
        return check

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
