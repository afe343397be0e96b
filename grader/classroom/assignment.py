"""What the class was asked to hand in: the assignment's chapters and their exercises. The
gradebook's totals and the summary's scores are both out of this one definition.

The chapters come from `--chapters memory,dp` (chapter names, or the course's notebook names such
as `01_memory.ipynb`); without it, from the exercises `--only` names; without either, they are
every chapter some student handed in a notebook of, and the summary and the progress lines say so."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..notebook import UnusableInput

NOT_HANDED_IN = "not handed in"  # an exercise of a chapter the student handed no gradable notebook of


@dataclass(frozen=True)
class Assignment:
    exercises: dict[str, list[tuple[str, int]]]  # chapter -> [(exercise id, max points)], in the course's order
    source: str  # how the chapters were chosen, in words

    @property
    def chapters(self) -> list[str]:
        return list(self.exercises)

    @property
    def exercise_ids(self) -> list[str]:
        return [exercise_id for exercises in self.exercises.values() for exercise_id, _ in exercises]

    @property
    def max_total(self) -> int:
        return sum(points for exercises in self.exercises.values() for _, points in exercises)

    def describe(self) -> str:
        named = f"chapters {', '.join(self.chapters)}" if self.chapters else "no chapter"
        return f"{named} ({self.source}), {len(self.exercise_ids)} exercises, {self.max_total} points"


def _course_notebook_chapters() -> dict[str, str]:
    """The course's notebook names (`01_memory`) -> their chapters, from the handouts' metadata."""
    from ..notebook import notebook_chapter, read_notebook
    from ..release import EXERCISES

    names = {}
    for path in sorted(EXERCISES.glob("*.ipynb")):
        try:
            chapter = notebook_chapter(read_notebook(path))
        except (UnusableInput, OSError):
            continue
        if chapter:
            names[path.stem] = chapter
    return names


def parse_chapters(text: str) -> list[str]:
    """`--chapters memory,dp` (or `01_memory,02_data_parallel.ipynb`) as chapter names, in the
    course's order; UnusableInput (one line) for anything that is not a chapter of the course."""
    from ..registry import CHAPTER_MODULES

    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise UnusableInput("--chapters names no chapter (give them separated by commas: --chapters memory,dp)")
    chapters, unknown, by_notebook = set(), [], None
    for item in items:
        if item in CHAPTER_MODULES:
            chapters.add(item)
            continue
        by_notebook = _course_notebook_chapters() if by_notebook is None else by_notebook
        stem = Path(item).name.removesuffix(".ipynb")
        if by_notebook.get(stem) in CHAPTER_MODULES:
            chapters.add(by_notebook[stem])
        else:
            unknown.append(repr(item))
    if unknown:
        raise UnusableInput(f"--chapters: unknown chapter {', '.join(unknown)}; the course's chapters are "
                            f"{', '.join(CHAPTER_MODULES)} (or their notebooks' names, such as 01_memory)")
    return [chapter for chapter in CHAPTER_MODULES if chapter in chapters]


def check_only_within(chapters: list[str] | None, only: list[str] | None) -> None:
    """`--only` ids must belong to the assignment's chapters when both are given."""
    if chapters and only:
        outside = sorted(exercise_id for exercise_id in set(only) if exercise_id.split(".", 1)[0] not in chapters)
        if outside:
            raise UnusableInput(f"--only {', '.join(outside)}: not in the assignment's chapters "
                                f"({', '.join(chapters)})")


def make_assignment(chapters: list[str] | None, only: list[str] | None, handed_in: set[str]) -> Assignment:
    """The assignment from `--chapters` (`chapters`), else `--only`, else the chapters handed in."""
    from ..registry import CHAPTER_MODULES, chapter_exercises

    if chapters:
        chosen, source = set(chapters), "set by --chapters"
    elif only:
        chosen, source = {exercise_id.split(".", 1)[0] for exercise_id in only}, "the chapters of the --only exercises"
    else:
        chosen, source = handed_in, "every chapter a notebook was handed in for; --chapters sets them"
    exercises = {}
    for chapter in (c for c in CHAPTER_MODULES if c in chosen):
        listed = [(exercise.id, exercise.points) for exercise in chapter_exercises(chapter)
                  if not only or exercise.id in only]
        if listed:  # a chapter none of whose exercises --only names is not graded
            exercises[chapter] = listed
    if only:
        source += ", only the exercises --only names"
    return Assignment(exercises, source)
