"""`python -m grader class SUBMISSIONS --out RESULTS`: grade a whole class.

SUBMISSIONS holds one folder per student (any notebooks inside, each recognised by its chapter) or
one file per student named after them. Every notebook is graded by the grader's own
`grade_notebook`, several at once (grader/classroom/workers.py); results are cached by content
in RESULTS/cache/, so a rerun grades only what changed (or everything with `regrade`). Then:

    RESULTS/gradebook.csv                one row per student (grader/classroom/gradebook.py)
    RESULTS/summary.md, summary.html     per exercise, flags, identical submissions (summary.py)
    RESULTS/students/<name>.json|md|html each student's report, the JSON as `--json` writes it

Nothing is ever written in SUBMISSIONS, and input that cannot be graded becomes a note on its
student's row rather than an error."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..notebook import UnusableInput
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
    graded: dict[str, list[GradedNotebook]] = field(default_factory=dict)  # student -> notebooks
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


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def check_folders(submissions: Path, out: Path) -> None:
    if not submissions.is_dir():
        raise UnusableInput(f"{submissions}: {'no such folder' if not submissions.exists() else 'not a folder'}")
    inside, outside = submissions.resolve(), out.resolve()
    if outside == inside or inside in outside.parents or outside in inside.parents:
        raise UnusableInput(f"--out {out} overlaps SUBMISSIONS {submissions}: nothing may be written among the submissions")


def grade_class(submissions: Path, out: Path, workers: int, only: list[str] | None, timeout_s: float | None,
                regrade: bool, say=print) -> ClassResults:
    """Grade the class and write RESULTS; KeyboardInterrupt leaves the finished notebooks in the cache."""
    from . import gradebook, summary

    check_folders(submissions, out)
    students = find_students(submissions)
    if not students:
        raise UnusableInput(f"{submissions}: the folder holds no submission")
    from ..notebook import read_course_notebook

    cache, options = ResultsCache(out / "cache"), options_key(only, timeout_s)
    results = ClassResults(students, workers=workers)
    jobs, owner = [], {}
    for student in students:
        for path in student.notebooks:
            relpath = relative(path, submissions)
            try:
                _, chapter = read_course_notebook(path)  # input that cannot be graded is noted before any grading
                sha256 = content_hash(path)
            except (UnusableInput, OSError) as exc:
                student.notes.append(_without_root(str(exc), submissions))
                continue
            if only and not any(exercise_id.split(".", 1)[0] == chapter for exercise_id in only):
                student.notes.append(f"{relpath}: not graded, --only names no exercise of its chapter, {chapter}")
                continue
            job = Job(relpath, path, sha256)
            owner[relpath] = student
            entry = None if regrade else cache.get(job, options)
            if entry is None:
                jobs.append(job)
            else:
                _keep(results, student, entry, reused=True)
    if jobs:
        _warm_up({job.path: None for job in jobs})

    done = [0]

    def on_result(job: Job, entry: dict) -> None:
        done[0] += 1
        student = owner[job.relpath]
        if "report" not in entry:
            student.notes.append(f"{job.relpath}: {_without_root(entry.get('unusable') or entry['error'], submissions)}")
            say(f"[{done[0]}/{len(jobs)}] {job.relpath}: not graded", flush=True)
            return
        _keep(results, student, entry, reused=False)
        report = entry["report"]
        say(f"[{done[0]}/{len(jobs)}] {job.relpath}: {report['score']}/{report['max_score']} "
            f"in {report['elapsed_s']:.1f}s", flush=True)

    if jobs:
        say(f"grading {len(jobs)} notebook(s) on {min(workers, len(jobs))} process(es); "
            f"{sum(len(v) for v in results.graded.values())} unchanged since the last run", flush=True)
    grade_in_parallel(jobs, workers, only, timeout_s, on_result, cache)
    for student in students:
        _flag(results, student)
    gradebook.write_all(results, out)
    summary.write_all(results, out)
    return results


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


def _keep(results: ClassResults, student: Student, entry: dict, reused: bool) -> None:
    results.graded.setdefault(student.name, []).append(
        GradedNotebook(entry["relpath"] if "relpath" in entry else entry["report"]["path"], entry["report"],
                       entry.get("exercise_seconds", {}), entry.get("fingerprint", ""), reused))
    results.unconfined = results.unconfined or entry.get("unconfined")


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
