"""`python -m grader class SUBMISSIONS --out RESULTS`: grade a whole class.

SUBMISSIONS holds one folder per student (any notebooks inside, each recognised by its chapter) or
one file per student named after them. The assignment (`--chapters`, grader/classroom/assignment.py)
says which chapters count; every notebook of them is graded by the grader's own `grade_notebook`,
several at once (grader/classroom/workers.py); results are cached by content in RESULTS/cache/, so
a rerun grades only what changed (or everything with `regrade`). Each file handed in gets one
numbered progress line, whether graded, unchanged since the last run, or flagged. Then:

    RESULTS/gradebook.csv                one row per student (grader/classroom/gradebook.py)
    RESULTS/summary.md, summary.html     per exercise: passes, common mistakes (mistakes.py), a chart
                                         (chart.py); flags, identical submissions (summary.py)
    RESULTS/students/<name>.json|md|html each student's report, the JSON as `--json` writes it

Nothing is ever written in SUBMISSIONS, and input that cannot be graded (or a notebook of a chapter
outside the assignment) becomes a note on its student's row rather than an error."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..notebook import UnusableInput
from .assignment import NOT_HANDED_IN, Assignment, make_assignment
from .submissions import Student, content_hash, find_students, printable, relative
from .workers import Job, ResultsCache, grade_in_parallel, options_key


@dataclass
class GradedNotebook:
    relpath: str
    report: dict  # the contract's notebook object: path, chapter, score, max_score, elapsed_s, exercises
    exercise_seconds: dict[str, float]
    fingerprint: str
    reused: bool  # taken from an earlier run's cache

    @property
    def untouched(self) -> bool:
        return all(e["status"] == "missing" for e in self.report["exercises"])




@dataclass
class ClassResults:
    students: list[Student]
    assignment: Assignment = field(default_factory=lambda: Assignment({}, "nothing graded"))
    graded: dict[str, list[GradedNotebook]] = field(default_factory=dict)  # student -> notebooks
    chapters_handed_in: dict[str, set[str]] = field(default_factory=dict)  # chapter -> students, assigned or not
    unconfined: str | None = None
    workers: int = 1
    report_stems: dict[str, str] = field(default_factory=dict)  # student -> file name of their reports

    def counted(self, student: str) -> dict[str, GradedNotebook]:
        """chapter -> the notebook that counts in the gradebook: of two for one chapter, the higher
        score (the first by path on a tie); both stay in the student's report, and are flagged."""
        best: dict[str, GradedNotebook] = {}
        for notebook in self.graded.get(student, []):
            chapter = notebook.report["chapter"]
            if chapter not in best or notebook.report["score"] > best[chapter].report["score"]:
                best[chapter] = notebook
        return best

    def outcomes(self, student: str) -> dict[str, dict]:
        """exercise id -> {"status", "points", "feedback"} for every exercise of the assignment, from
        the notebook that counts; status NOT_HANDED_IN where the student handed in no gradable
        notebook of its chapter. The gradebook's cells and totals and the summary's counts and
        scores all come from here, so they cannot disagree."""
        counted, outcomes = self.counted(student), {}
        for chapter, exercises in self.assignment.exercises.items():
            notebook = counted.get(chapter)
            graded = {e["id"]: e for e in notebook.report["exercises"]} if notebook else {}
            for exercise_id, _ in exercises:
                if notebook is None:
                    outcomes[exercise_id] = {"status": NOT_HANDED_IN, "points": 0, "feedback": ""}
                elif exercise_id not in graded:  # a cached result from before the exercise existed: --regrade
                    outcomes[exercise_id] = {"status": "not graded", "points": 0, "feedback": "graded before this "
                                             "exercise existed; run again with --regrade"}
                else:
                    e = graded[exercise_id]
                    outcomes[exercise_id] = {"status": e["status"], "points": e["points"], "feedback": e["feedback"]}
        return outcomes

    def total(self, student: str) -> int:
        return sum(outcome["points"] for outcome in self.outcomes(student).values())


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def check_folders(submissions: Path, out: Path) -> None:
    if not submissions.is_dir():
        raise UnusableInput(f"{submissions}: {'no such folder' if not submissions.exists() else 'not a folder'}")
    inside, outside = submissions.resolve(), out.resolve()
    if outside == inside or inside in outside.parents or outside in inside.parents:
        raise UnusableInput(f"--out {out} overlaps SUBMISSIONS {submissions}: nothing may be written among the submissions")


@dataclass
class _HandedIn:
    """A notebook file of a student, as read before any grading: its chapter, or why it cannot be graded."""
    relpath: str
    path: Path
    chapter: str | None = None
    sha256: str = ""
    unusable: str | None = None


class _Progress:
    """One numbered line per thing handed in: each notebook (graded, unchanged, or flagged) and each
    other file or folder that was flagged, so that no student's submission goes unmentioned."""

    def __init__(self, total: int, say):
        self.done, self.total, self.say = 0, total, say

    def line(self, text: str) -> None:
        self.done += 1
        self.say(f"[{self.done}/{self.total}] {text}", flush=True)

    def graded(self, notebook: "GradedNotebook", how: str) -> None:
        report = notebook.report
        flag = "; flagged: every exercise is missing (an untouched exercise notebook?)" if notebook.untouched else ""
        self.line(f"{notebook.relpath}: {report['score']}/{report['max_score']} {how}{flag}")


def grade_class(submissions: Path, out: Path, workers: int, only: list[str] | None, timeout_s: float | None,
                regrade: bool, say=print, chapters: list[str] | None = None) -> ClassResults:
    """Grade the class and write RESULTS; KeyboardInterrupt leaves the finished notebooks in the cache.
    `chapters` is the assignment (`--chapters`, checked by `assignment.parse_chapters`); None takes
    the chapters of the --only exercises, or else every chapter handed in."""
    from . import gradebook, summary
    from ..notebook import read_course_notebook

    check_folders(submissions, out)
    students = find_students(submissions)
    if not students:
        raise UnusableInput(f"{submissions}: the folder holds no submission")
    handed_in: dict[str, list[_HandedIn]] = {}
    for student in students:  # input that cannot be graded is found before any grading
        for path in student.notebooks:
            item = _HandedIn(relative(path, submissions), path)
            try:
                _, item.chapter = read_course_notebook(path)
                item.sha256 = content_hash(path)
            except (UnusableInput, OSError) as exc:
                item.unusable = _without_root(str(exc), submissions)
            handed_in.setdefault(student.name, []).append(item)
    chapters_found = {item.chapter for items in handed_in.values() for item in items if item.chapter}
    assignment = make_assignment(chapters, only, chapters_found)
    results = ClassResults(students, assignment, workers=workers)
    for name, items in handed_in.items():
        for item in items:
            if item.chapter:
                results.chapters_handed_in.setdefault(item.chapter, set()).add(name)
    progress = _Progress(sum(len(student.notes) + len(student.notebooks) for student in students), say)
    say(f"assignment: {assignment.describe()}", flush=True)

    cache, options = ResultsCache(out / "cache"), options_key(only, timeout_s)
    jobs, owner = [], {}
    for student in students:
        for note in list(student.notes):  # files that are not notebooks, links, folders without a notebook
            progress.line(f"flagged: {note}")
        for item in handed_in.get(student.name, []):
            reason = item.unusable or _outside_the_assignment(item, assignment, chapters, only)
            if reason:
                student.notes.append(reason)
                progress.line(f"flagged: {reason}")
                continue
            job = Job(item.relpath, item.path, item.sha256)
            owner[job.relpath] = student
            entry = None if regrade else cache.get(job, options)
            if entry is None:
                jobs.append(job)
            else:
                progress.graded(_keep(results, student, entry, reused=True), "unchanged since the last run")
    if jobs:
        _warm_up({job.path: None for job in jobs})

    def on_result(job: Job, entry: dict) -> None:
        student = owner[job.relpath]
        if "report" not in entry:
            reason = f"{job.relpath}: not graded: {_without_root(entry.get('unusable') or entry['error'], submissions)}"
            student.notes.append(reason)
            progress.line(f"flagged: {reason}")
            return
        notebook = _keep(results, student, entry, reused=False)
        progress.graded(notebook, f"in {notebook.report['elapsed_s']:.1f}s")

    if jobs:
        say(f"grading {len(jobs)} notebook(s) on {min(workers, len(jobs))} process(es); "
            f"{sum(len(v) for v in results.graded.values())} unchanged since the last run", flush=True)
    grade_in_parallel(jobs, workers, only, timeout_s, on_result, cache)
    for student in students:
        _flag(results, student)
    gradebook.write_all(results, out)
    summary.write_all(results, out)
    return results


def _outside_the_assignment(item: _HandedIn, assignment: Assignment, chapters: list[str] | None,
                            only: list[str] | None) -> str | None:
    """Why a notebook of a course chapter is not graded, or None when its chapter is assigned."""
    if item.chapter in assignment.exercises:
        return None
    if only and (chapters is None or item.chapter in chapters):
        return f"{item.relpath}: not graded, --only names no exercise of its chapter, {item.chapter}"
    return (f"{item.relpath}: a notebook of chapter {item.chapter}, which is not in the assignment "
            f"({', '.join(assignment.chapters) or 'no chapter'}): not graded")


def _warm_up(paths) -> None:
    """Import here, once, what grading the jobs' chapters needs (the chapters' checks, the
    libraries their notebooks import): the workers are forked from this process and share it,
    instead of each importing it again. Only the course's own modules and the libraries
    `grade_notebook` itself preloads are imported; a failure here is left to the grading to report."""
    from ..grading import preload_library_imports
    from ..notebook import extract_definitions, read_course_notebook
    from ..registry import chapter_exercises

    warmed = set()
    for path in paths:
        try:
            notebook, chapter = read_course_notebook(path)
            if chapter not in warmed:
                warmed.add(chapter)
                names = {name for exercise in chapter_exercises(chapter) for name in exercise.reads}
                preload_library_imports(extract_definitions(notebook, names))
        except Exception:  # noqa: BLE001
            continue


def _keep(results: ClassResults, student: Student, entry: dict, reused: bool) -> GradedNotebook:
    notebook = GradedNotebook(entry["relpath"] if "relpath" in entry else entry["report"]["path"], entry["report"],
                              entry.get("exercise_seconds", {}), entry.get("fingerprint", ""), reused)
    results.graded.setdefault(student.name, []).append(notebook)
    results.unconfined = results.unconfined or entry.get("unconfined")
    return notebook


def _flag(results: ClassResults, student: Student) -> None:
    notebooks = sorted(results.graded.get(student.name, []), key=lambda n: n.relpath)
    results.graded[student.name] = notebooks
    counted = results.counted(student.name)
    for notebook in notebooks:
        if notebook.untouched:
            student.notes.append(f"{notebook.relpath}: every exercise is missing (an untouched exercise notebook?)")
    for chapter, chosen in counted.items():
        same = [n for n in notebooks if n.report["chapter"] == chapter]
        if len(same) > 1:
            listed = ", ".join(f"{n.relpath} {n.report['score']}/{n.report['max_score']}" for n in same)
            student.notes.append(f"{len(same)} notebooks of chapter {chapter} ({listed}): all graded; "
                                 f"the gradebook counts {chosen.relpath}, the highest score")


def _without_root(message: str, root: Path) -> str:
    """Messages name files as they are in SUBMISSIONS, not by the instructor's absolute paths."""
    return printable(message.replace(f"{root.resolve()}{os.sep}", "").replace(f"{root}{os.sep}", ""))
