"""RESULTS/summary.md and summary.html, and each student's readable report.

Each page is built once as a list of blocks (headings, paragraphs, tables, lists) and rendered
twice, to Markdown and to HTML, so that the two never say different things. Every piece of text
is escaped for its format: feedback quotes the students' own exception messages."""
from __future__ import annotations

import html
import re
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from .gradebook import chapters_and_exercises
from .workers import write_atomically

FEEDBACK_LINES_SHOWN, SLOWEST_SHOWN = 3, 10
NOT_PASSED = ("failed", "error", "timeout", "missing")


@dataclass
class Link:
    text: str
    href: str


# Blocks: ("h1"|"h2"|"h3"|"p", text), ("ul", [items]), ("table", headers, rows); an item or cell
# is text or a Link.
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
    return "\n".join(parts + ["</body></html>", ""])


def _write_pair(blocks, title: str, stem: Path) -> None:
    write_atomically(stem.parent / f"{stem.name}.md", to_markdown(blocks))
    write_atomically(stem.parent / f"{stem.name}.html", to_html(blocks, title))


def diagnosis_key(feedback: str) -> str:
    """Feedback with its numbers blanked: inputs are drawn at random each run, so the same
    mistake reads `bubble_fraction(8, 16) returned 0.4375` for one student and `(4, 6)` for another."""
    return re.sub(r"\d+(\.\d+)?([eE][+-]?\d+)?", "#", feedback)


def exercise_blocks(results) -> list:
    layout = chapters_and_exercises(results)
    counted = [n for s in results.students for n in results.counted(s.name).values()]
    rows, common = [], []
    for chapter, exercises in layout.items():
        for exercise_id, points in exercises:
            graded = [e for n in counted for e in n.report["exercises"] if e["id"] == exercise_id]
            statuses = Counter(e["status"] for e in graded)
            share = f"{100 * statuses['passed'] / len(graded):.0f} %" if graded else ""
            rows.append([exercise_id, points, len(graded), statuses["passed"], share,
                         *(statuses[s] for s in NOT_PASSED)])
            failures = [e["feedback"] for e in graded if e["status"] in ("failed", "error", "timeout")]
            examples: dict[str, str] = {}
            counts = Counter()
            for feedback in failures:
                key = diagnosis_key(feedback)
                examples.setdefault(key, feedback)
                counts[key] += 1
            common += [[exercise_id, count, examples[key]] for key, count in counts.most_common(FEEDBACK_LINES_SHOWN)]
    blocks = [("h2", "Exercises"),
              ("p", "One notebook per student and chapter counts (of two, the higher score). "
                    "Handed in: students with a notebook of the exercise's chapter."),
              ("table", ["exercise", "points", "handed in", "passed", "pass share", *NOT_PASSED], rows),
              ("h2", "Most common failure feedback"),
              ("p", f"Per exercise, up to {FEEDBACK_LINES_SHOWN} diagnoses (failed, error or timeout), "
                    "counted alike when they differ only in numbers, with one student's line as the example.")]
    blocks.append(("table", ["exercise", "students", "feedback (an example)"], common) if common
                  else ("p", "No exercise failed."))
    return blocks


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
    blocks = [("h1", "Class results"),
              ("p", f"{len(results.students)} students, {len(notebooks)} notebooks graded "
                    f"({reused} unchanged since an earlier run, taken from its results). Grades: gradebook.csv."),
              *exercise_blocks(results), *slowest_blocks(results),
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
        counted = results.counted(student.name).values()
        stem = results.report_stems[student.name]
        rows.append([student.name, sum(n.report["score"] for n in counted), sum(n.report["max_score"] for n in counted),
                     Link("Markdown", f"students/{stem}.md"), Link("HTML", f"students/{stem}.html"), len(student.notes)])
    blocks += [("h2", "Students"), ("table", ["student", "score", "of", "report", "report", "notes"], rows)]
    if results.unconfined:
        blocks.append(("p", f"Note: {results.unconfined}"))
    return blocks


def student_blocks(results, student) -> list:
    notebooks = results.graded.get(student.name, [])
    blocks = [("h1", f"Grading report: {student.name}")]
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
