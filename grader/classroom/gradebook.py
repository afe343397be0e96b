"""RESULTS/gradebook.csv (one row per student) and each student's JSON report.

The columns are the assignment's exercises (grader/classroom/assignment.py), a total per chapter,
the student's total and the assignment's maximum, the same for every row. A cell of an exercise
holds its points when it passed, and otherwise its status (`failed`, `error`, `timeout`,
`missing`), which is worth 0: the points are all or nothing, and a spreadsheet's SUM skips words.
An exercise of a chapter the student handed in no gradable notebook of is `missing` too (the
summary counts those apart, as "not handed in")."""
from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path

from .assignment import NOT_HANDED_IN
from .workers import write_atomically


def _cell(text) -> str:
    """A spreadsheet runs a cell that starts with = + - @ as a formula: names and notes come from
    the students' file names and the feedback on their code, so such a cell starts with a quote."""
    text = str(text)
    return f"'{text}" if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def gradebook_cell(outcome: dict):
    if outcome["status"] == "passed":
        return outcome["points"]
    return "missing" if outcome["status"] == NOT_HANDED_IN else outcome["status"]


def gradebook_rows(results) -> list[list]:
    assignment = results.assignment
    header = ["student"]
    for chapter, exercises in assignment.exercises.items():
        header += [exercise_id for exercise_id, _ in exercises] + [f"{chapter} total"]
    header += ["total", "max total", "notes"]
    rows = [header]
    for student in results.students:
        outcomes = results.outcomes(student.name)
        row = [_cell(student.name)]
        for exercises in assignment.exercises.values():
            row += [gradebook_cell(outcomes[exercise_id]) for exercise_id, _ in exercises]
            row.append(sum(outcomes[exercise_id]["points"] for exercise_id, _ in exercises))
        row += [results.total(student.name), assignment.max_total, _cell("; ".join(student.notes))]
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
    """The grader's `--json` document for the student's notebooks, plus who, the notes, and their
    total out of the assignment (as in the gradebook)."""
    assignment = results.assignment
    document = {"student": student.name, "notebooks": [n.report for n in results.graded.get(student.name, [])],
                "notes": student.notes,
                "assignment": {"chapters": assignment.chapters, "how": assignment.source,
                               "score": results.total(student.name), "max_score": assignment.max_total}}
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
