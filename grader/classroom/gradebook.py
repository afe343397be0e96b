"""RESULTS/gradebook.csv (one row per student) and each student's JSON report.

A cell of an exercise holds its points when it passed, and otherwise its status (`failed`,
`error`, `timeout`, `missing`), which is worth 0: the points are all or nothing, and a
spreadsheet's SUM skips words. A chapter the student handed no notebook of is left empty."""
from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

from ..registry import COURSE_CHAPTERS
from .workers import write_atomically


def chapters_and_exercises(results) -> dict[str, list[tuple[str, int]]]:
    """chapter -> [(exercise id, max points)] over every graded notebook, in the course's order."""
    found: dict[str, dict[str, int]] = {}
    for notebooks in results.graded.values():
        for notebook in notebooks:
            exercises = found.setdefault(notebook.report["chapter"], {})
            for exercise in notebook.report["exercises"]:
                exercises.setdefault(exercise["id"], exercise["max_points"])
    return {chapter: list(found[chapter].items()) for chapter in COURSE_CHAPTERS if chapter in found}


def _cell(text) -> str:
    """A spreadsheet runs a cell that starts with = + - @ as a formula: names and notes come from
    the students' file names and the feedback on their code, so such a cell starts with a quote."""
    text = str(text)
    return f"'{text}" if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def gradebook_rows(results) -> list[list]:
    layout = chapters_and_exercises(results)
    header = ["student"]
    for chapter, exercises in layout.items():
        header += [exercise_id for exercise_id, _ in exercises] + [f"{chapter} total"]
    header += ["total", "max total", "notes"]
    max_total = sum(points for exercises in layout.values() for _, points in exercises)
    rows = [header]
    for student in results.students:
        counted = results.counted(student.name)
        row, total = [_cell(student.name)], 0
        for chapter, exercises in layout.items():
            notebook = counted.get(chapter)
            if notebook is None:
                row += [""] * (len(exercises) + 1)
                continue
            by_id = {e["id"]: e for e in notebook.report["exercises"]}
            for exercise_id, _ in exercises:
                graded = by_id.get(exercise_id)
                row.append("" if graded is None else graded["points"] if graded["status"] == "passed" else graded["status"])
            row.append(notebook.report["score"])
            total += notebook.report["score"]
        row += [total, max_total, _cell("; ".join(student.notes))]
        rows.append(row)
    return rows


def file_stem(name: str, taken: set[str]) -> str:
    """A file name for a student's reports: their name in safe characters, unique in the class."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "student"
    candidate, number = stem, 2
    while candidate.lower() in taken:
        candidate, number = f"{stem}_{number}", number + 1
    taken.add(candidate.lower())
    return candidate


def student_document(results, student) -> dict:
    """The grader's `--json` document for the student's notebooks, plus who and the notes."""
    document = {"student": student.name, "notebooks": [n.report for n in results.graded.get(student.name, [])],
                "notes": student.notes}
    if results.unconfined:
        document["unconfined"] = results.unconfined
    return document


def write_all(results, out: Path) -> None:
    folder = out / "students"
    folder.mkdir(parents=True, exist_ok=True)
    taken: set[str] = set()
    results.report_stems = {student.name: file_stem(student.name, taken) for student in results.students}
    for student in results.students:
        path = folder / f"{results.report_stems[student.name]}.json"
        write_atomically(path, json.dumps(student_document(results, student), indent=2) + "\n")
    text = io.StringIO()
    csv.writer(text, lineterminator="\r\n").writerows(gradebook_rows(results))
    # With a byte-order mark, a spreadsheet reads the file as UTF-8 (names with accents) when opened as is.
    write_atomically(out / "gradebook.csv", "\ufeff" + text.getvalue())
