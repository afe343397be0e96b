"""Results of grading, as the CLI table and as the JSON report of the contract in DESIGN.md."""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field

STATUSES = ("passed", "failed", "error", "timeout", "missing")
_MARKS = {"passed": "✓", "failed": "✗", "error": "!", "timeout": "⏱", "missing": "·"}


MAX_FEEDBACK_CHARS = 600


def one_line(text: str) -> str:
    """Feedback as one line of printable text: the learner's exception messages reach it, and
    they must not be able to add lines to the grader's table."""
    text = re.sub(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]+", " ", str(text)).strip()
    if len(text) <= MAX_FEEDBACK_CHARS:
        return text
    # Cut the middle: a diagnosis comes first and a hint usually last, long values in between.
    head, tail = MAX_FEEDBACK_CHARS * 2 // 3, MAX_FEEDBACK_CHARS // 3 - 3
    return f"{text[:head]} … {text[-tail:]}"


@dataclass
class ExerciseResult:
    id: str
    points: int
    max_points: int
    status: str
    feedback: str

    def line(self) -> str:
        """The one line shown by `check(...)` in a notebook."""
        return f"{_MARKS[self.status]} {self.id} [{self.status}, {self.points}/{self.max_points}]: {self.feedback}"


@dataclass
class NotebookReport:
    path: str
    chapter: str
    score: int = 0
    max_score: int = 0
    elapsed_s: float = 0.0
    exercises: list[ExerciseResult] = field(default_factory=list)

    def add(self, result: ExerciseResult) -> None:
        self.exercises.append(result)
        self.score += result.points
        self.max_score += result.max_points


def format_table(report: NotebookReport) -> str:
    """The CLI's table: one line per exercise, its feedback whole (never cut: the hint that
    names the mistake is often at the end)."""
    id_width = max([len("exercise")] + [len(r.id) for r in report.exercises])
    rows = [f"{report.path}  (chapter {report.chapter})",
            f"  {'exercise':<{id_width}}  points  {'status':<8} feedback"]
    for r in report.exercises:
        rows.append(f"  {r.id:<{id_width}}  {f'{r.points}/{r.max_points}':>6}  {r.status:<8} {r.feedback}")
    rows.append(f"  total {report.score}/{report.max_score} in {report.elapsed_s:.1f}s")
    return "\n".join(rows)


def write_json(reports: list[NotebookReport], path: str, unconfined: str | None = None) -> None:
    """Written whole, after every sandbox is gone: replaced in one step, never half-written.
    `unconfined` (why learner code ran without Landlock) becomes a top-level "unconfined" key,
    present only then, beside the contract's "notebooks"."""
    temporary = f"{path}.{os.getpid()}.tmp"
    document = {"notebooks": [asdict(r) for r in reports]}
    if unconfined:
        document["unconfined"] = unconfined
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)
        f.write("\n")
    os.replace(temporary, path)
