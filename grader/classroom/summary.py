"""RESULTS/summary.md and summary.html, and each student's readable report.

Each page is built once as a list of blocks (headings, paragraphs, tables, lists) and rendered
twice, to Markdown and to HTML, so that the two never say different things. Every piece of text
is escaped for its format: feedback quotes the students' own exception messages, and names come
from the students' file names. Every count and score comes from `ClassResults.outcomes`, as the
gradebook's cells and totals do."""
from __future__ import annotations

import html
import re
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..registry import CHAPTER_MODULES
from .assignment import NOT_HANDED_IN
from .chart import outcome_chart
from .mistakes import MISTAKES_SHOWN, common_mistakes
from .workers import write_atomically

SLOWEST_SHOWN = 10
NOT_PASSED = ("failed", "error", "timeout", "missing", NOT_HANDED_IN)


@dataclass
class Link:
    text: str
    href: str


# Blocks: ("h1"|"h2"|"h3"|"p", text), ("ul", [items]), ("table", headers, rows), ("chart", PNG as
# base64, alt text, caption); an item or cell is text or a Link. Markdown gets a chart's caption
# only: the table before it holds its numbers.
def _markdown_text(value) -> str:
    if isinstance(value, Link):
        return f"[{_markdown_text(value.text)}]({value.href})"
    return re.sub(r"([\\`*_\[\]<>|#])", r"\\\1", str(value))


def to_markdown(blocks) -> str:
    lines = []
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + _markdown_text(block[1]), ""]
        elif kind == "p":
            lines += [_markdown_text(block[1]), ""]
        elif kind == "ul":
            lines += [f"- {_markdown_text(item)}" for item in block[1]] + [""]
        elif kind == "table":
            lines.append("| " + " | ".join(map(_markdown_text, block[1])) + " |")
            lines.append("|" + "---|" * len(block[1]))
            lines += ["| " + " | ".join(map(_markdown_text, row)) + " |" for row in block[2]]
            lines.append("")
        elif kind == "chart":
            lines += [_markdown_text(f"{block[3]} (drawn in summary.html)"), ""]
    return "\n".join(lines)


def _html_text(value) -> str:
    if isinstance(value, Link):
        return f'<a href="{html.escape(value.href)}">{html.escape(str(value.text))}</a>'
    return html.escape(str(value))


def to_html(blocks, title: str) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">', f"<title>{html.escape(title)}</title>",
             "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}"
             "td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}</style>",
             "</head><body>"]
    for block in blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3", "p"):
            parts.append(f"<{kind}>{_html_text(block[1])}</{kind}>")
        elif kind == "ul":
            parts.append("<ul>" + "".join(f"<li>{_html_text(item)}</li>" for item in block[1]) + "</ul>")
        elif kind == "table":
            parts.append("<table><tr>" + "".join(f"<th>{_html_text(h)}</th>" for h in block[1]) + "</tr>")
            parts += ["<tr>" + "".join(f"<td>{_html_text(c)}</td>" for c in row) + "</tr>" for row in block[2]]
            parts.append("</table>")
        elif kind == "chart":
            parts.append(f'<figure><img src="data:image/png;base64,{block[1]}" alt="{html.escape(block[2])}">'
                         f"<figcaption>{html.escape(block[3])}</figcaption></figure>")
    return "\n".join(parts + ["</body></html>", ""])


def _write_pair(blocks, title: str, stem: Path) -> None:
    write_atomically(stem.parent / f"{stem.name}.md", to_markdown(blocks))
    write_atomically(stem.parent / f"{stem.name}.html", to_html(blocks, title))


def assignment_blocks(results) -> list:
    assignment = results.assignment
    rows = []
    for chapter in (c for c in CHAPTER_MODULES if c in assignment.exercises or c in results.chapters_handed_in):
        exercises = assignment.exercises.get(chapter, [])
        rows.append([chapter, "yes" if exercises else "no: its notebooks are flagged, not graded",
                     len(exercises), sum(points for _, points in exercises),
                     len(results.chapters_handed_in.get(chapter, ()))])
    return [("h2", "Assignment"),
            ("p", f"Assignment: {assignment.describe()}. Every total, here and in gradebook.csv, is out of these "
                  f"{assignment.max_total} points; the exercises of a chapter a student handed in no gradable "
                  "notebook of count 0 (written 'missing' in the gradebook, counted as 'not handed in' below)."),
            ("table", ["chapter", "in the assignment", "exercises", "points", "students who handed it in"], rows)]


def exercise_blocks(results, outcomes: dict[str, dict[str, dict]]) -> list:
    """Per exercise: how many students passed, the outcomes as a chart, and the common mistakes."""
    rows, counts, mistakes = [], [], []
    for exercise_id, points in ((e, p) for exercises in results.assignment.exercises.values() for e, p in exercises):
        of_exercise = [outcomes[student.name][exercise_id] for student in results.students]
        statuses = Counter(outcome["status"] for outcome in of_exercise)
        handed_in = len(of_exercise) - statuses[NOT_HANDED_IN]
        share = f"{100 * statuses['passed'] / handed_in:.0f} %" if handed_in else ""
        rows.append([exercise_id, points, handed_in, statuses["passed"], share, *(statuses[s] for s in NOT_PASSED)])
        counts.append((exercise_id, {status: statuses[status] for status in ("passed", *NOT_PASSED)}))
        mistakes += [[exercise_id, mistake.students, mistake.label] for mistake in common_mistakes(of_exercise)]
    blocks = [("h2", "Exercises"),
              ("p", "Per exercise of the assignment, over every student of the class. Handed in: students with a "
                    "gradable notebook of its chapter (of two, the higher score counts); pass share: of those.")]
    if not rows:
        return blocks + [("p", "The assignment has no exercise.")]
    png, alt = outcome_chart(counts)
    return blocks + [
        ("table", ["exercise", "points", "handed in", "passed", "pass share", *NOT_PASSED], rows),
        ("chart", png, alt, "Students per exercise by outcome: the table above as stacked bars."),
        ("h2", "Most common mistakes"),
        ("p", f"Per exercise, the mistakes of the notebooks that count, most common first: up to {MISTAKES_SHOWN} "
              "diagnoses of failed checks (counted alike when they differ only in the randomly drawn inputs; the "
              "text is the first student's, without the arguments of calls), then error, timeout and missing, "
              "each counted as one category."),
        ("table", ["exercise", "students", "mistake"], mistakes) if mistakes else ("p", "No mistake: every exercise "
                                                                                   "handed in passed.")]


def slowest_blocks(results) -> list:
    seconds: dict[str, list[float]] = {}
    for notebooks in results.graded.values():
        for notebook in notebooks:
            for exercise_id, elapsed in notebook.exercise_seconds.items():
                seconds.setdefault(exercise_id, []).append(elapsed)
    ranked = sorted(seconds.items(), key=lambda item: -statistics.median(item[1]))[:SLOWEST_SHOWN]
    rows = [[exercise_id, f"{statistics.median(times):.2f}", f"{max(times):.2f}", len(times)] for exercise_id, times in ranked]
    return [("h2", "Slowest exercises"),
            ("p", f"Grading time per exercise, measured while {results.workers} notebook(s) were graded at once: "
                  "for planning a class's grading, never part of a verdict."),
            ("table", ["exercise", "median s", "max s", "notebooks"], rows) if rows else ("p", "Nothing was graded.")]


def identical_groups(results) -> list[list[tuple[str, str]]]:
    """Groups of (student, notebook) whose graded definitions are the same once whitespace and
    comments are normalised; notebooks that attempted nothing are left out (they match the handout)."""
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for student, notebooks in results.graded.items():
        for notebook in notebooks:
            if notebook.fingerprint and not notebook.untouched:
                groups.setdefault((notebook.report["chapter"], notebook.fingerprint), []).append((student, notebook.relpath))
    return sorted((sorted(group) for group in groups.values() if len(group) > 1), key=lambda g: g[0])


def summary_blocks(results) -> list:
    notebooks = [n for ns in results.graded.values() for n in ns]
    reused = sum(n.reused for n in notebooks)
    outcomes = {student.name: results.outcomes(student.name) for student in results.students}
    blocks = [("h1", "Class results"),
              ("p", f"{len(results.students)} students, {len(notebooks)} notebooks graded "
                    f"({reused} unchanged since an earlier run, taken from its results). Grades: gradebook.csv."),
              *assignment_blocks(results), *exercise_blocks(results, outcomes), *slowest_blocks(results),
              ("h2", "Identical submissions"),
              ("p", "Notebooks whose graded definitions are the same after normalising whitespace and comments, "
                    "listed for a look; the grader judges nothing about them.")]
    groups = identical_groups(results)
    blocks.append(("ul", [", ".join(f"{student} ({relpath})" for student, relpath in group) for group in groups])
                  if groups else ("p", "None."))
    flagged = [[s.name, note] for s in results.students for note in s.notes]
    blocks += [("h2", "Flags"),
               ("table", ["student", "note"], flagged) if flagged else ("p", "Nothing to flag.")]
    rows = []
    for student in results.students:
        stem = results.report_stems[student.name]
        rows.append([student.name, results.total(student.name), results.assignment.max_total,
                     ", ".join(not_handed_in(results, outcomes[student.name])),
                     Link("Markdown", f"students/{stem}.md"), Link("HTML", f"students/{stem}.html"), len(student.notes)])
    blocks += [("h2", "Students"),
               ("p", "Scores as in gradebook.csv, out of the assignment's points."),
               ("table", ["student", "score", "of", "chapters not handed in", "report", "report", "notes"], rows)]
    if results.unconfined:
        blocks.append(("p", f"Note: {results.unconfined}"))
    return blocks


def not_handed_in(results, outcomes: dict[str, dict]) -> list[str]:
    return [chapter for chapter, exercises in results.assignment.exercises.items()
            if outcomes[exercises[0][0]]["status"] == NOT_HANDED_IN]


def student_blocks(results, student) -> list:
    notebooks = results.graded.get(student.name, [])
    assignment = results.assignment
    missing = not_handed_in(results, results.outcomes(student.name))
    blocks = [("h1", f"Grading report: {student.name}"),
              ("p", f"Total: {results.total(student.name)} of {assignment.max_total} points. "
                    f"Assignment: {assignment.describe()}."
                    + (f" Not handed in: {', '.join(missing)} (0 points)." if missing else ""))]
    if student.notes:
        blocks += [("h2", "Notes"), ("ul", student.notes)]
    for notebook in notebooks:
        report = notebook.report
        blocks += [("h2", f"{notebook.relpath} (chapter {report['chapter']}): {report['score']}/{report['max_score']}"),
                   ("table", ["exercise", "points", "status", "feedback"],
                    [[e["id"], f"{e['points']}/{e['max_points']}", e["status"], e["feedback"]] for e in report["exercises"]])]
    if not notebooks:
        blocks.append(("p", "No notebook of this student could be graded."))
    return blocks


def write_all(results, out: Path) -> None:
    for student in results.students:
        _write_pair(student_blocks(results, student), f"Grading report: {student.name}",
                    out / "students" / results.report_stems[student.name])
    _write_pair(summary_blocks(results), "Class results", out / "summary")
