"""`python -m grader class`: a small class with the usual mistakes of a hand-in, for an assignment of
two chapters (memory and dp, the fastest): solved, partly solved with known slips (so that the
summary's mistake counts are known exactly), broken JSON, a copy with other comments, untouched
exercise notebooks, a file that is not a notebook, two notebooks of one chapter, an unknown
chapter, a notebook of a chapter outside the assignment, and chapters not handed in. Checks the
gradebook, that its totals agree with the summary's, the progress lines, the summary's counts,
mistakes and chart, the reports, that SUBMISSIONS is not written, resuming, and an interrupted run."""
from __future__ import annotations

import base64
import csv
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from conftest import CHAPTER_NOTEBOOKS, EXERCISES, REPO, ctrl_c_as_in_a_terminal, grader_cli, live_processes_with_marker, solution_path

MEMORY = ["memory.param_count", "memory.model_states", "memory.activations", "memory.training_time", "memory.interview"]
DP = ["dp.ring_time", "dp.bus_bandwidth", "dp.interview", "dp.ring_allreduce_numpy", "dp.ring_allreduce_gloo",
      "dp.ddp_by_hand", "dp.bucketed_ddp", "dp.gradient_accumulation"]
POINTS = {"memory.param_count": 3, "memory.model_states": 2, "memory.activations": 2, "memory.training_time": 2,
          "memory.interview": 2, "dp.ring_time": 1, "dp.bus_bandwidth": 1, "dp.interview": 1,
          "dp.ring_allreduce_numpy": 2, "dp.ring_allreduce_gloo": 2, "dp.ddp_by_hand": 2, "dp.bucketed_ddp": 3,
          "dp.gradient_accumulation": 2}
RIGHT_EMBEDDINGS = "embeddings = (config.vocab_size + config.n_positions) * h"
NO_POSITIONS = "embeddings = config.vocab_size * h"  # forgets the position embeddings


def replacing(right: str, wrong: str):
    def edit(source: str) -> str:
        assert right in source, right
        return source.replace(right, wrong, 1)
    return edit


# Known slips, each one the checks name (grader/checks/memory.py, grader/checks/dp/costs.py).
partly_solved = replacing(RIGHT_EMBEDDINGS, NO_POSITIONS)
TWO_N_FLOPS = {"training_days": replacing("return 6 * n_params", "return 2 * n_params")}  # forward only
ALGORITHM_BANDWIDTH = {"bus_bandwidth": replacing("return size_bytes / time_s * 2 * (n - 1) / n",
                                                  "return size_bytes / time_s")}
NO_LATENCY = {"ring_allreduce_time": replacing(
    "return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * size_bytes / bandwidth_bytes_per_s",
    "return 2 * (n - 1) / n * size_bytes / bandwidth_bytes_per_s")}
# The same two slips written another way (the code differs, the mistake does not), and a typo.
GINAS_DP = {"bus_bandwidth": replacing("return size_bytes / time_s * 2 * (n - 1) / n",
                                       "algorithm_bandwidth = size_bytes / time_s\n    return algorithm_bandwidth"),
            "ring_allreduce_time": replacing(
                "return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * size_bytes / bandwidth_bytes_per_s",
                "return (size_bytes / bandwidth_bytes_per_s) * 2 * (n - 1) / n"),
            "interview_bytes_sent_per_gpu": replacing("2 * (n_gpus - 1)", "2 * (n_gpu - 1)")}  # a NameError


def chapter_notebook(chapter: str, edits: dict | None = None) -> nbformat.NotebookNode:
    """The chapter's solution notebook, with the cell defining each named function edited."""
    notebook = nbformat.read(solution_path(chapter), as_version=4)
    for name, edit in (edits or {}).items():
        cell = next(c for c in notebook.cells if c.cell_type == "code" and f"def {name}(" in c.source)
        cell.source = edit(cell.source)
    return notebook


def memory_notebook(edit=None, **edits) -> nbformat.NotebookNode:
    return chapter_notebook("memory", {**({"gpt_parameter_count": edit} if edit else {}), **edits})


def recommented(source: str) -> str:
    """The same code, other comments and whitespace: graded definitions identical after normalising."""
    return "# my own way\n" + source.replace("    width =", "    # the MLP's width\n    width  =") + "\n\n"


def write(notebook, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)


def build_class(root: Path) -> Path:
    """Nine students, eleven notebooks, eight of them graded (the others cannot be, or are of
    a chapter outside the assignment)."""
    submissions = root / "submissions"
    write(memory_notebook(), submissions / "alice" / "week1" / CHAPTER_NOTEBOOKS["memory"])
    write(chapter_notebook("dp"), submissions / "alice" / CHAPTER_NOTEBOOKS["dp"])
    write(memory_notebook(partly_solved, **TWO_N_FLOPS), submissions / "bob" / CHAPTER_NOTEBOOKS["memory"])
    write(chapter_notebook("dp", {**ALGORITHM_BANDWIDTH, **NO_LATENCY}), submissions / "bob" / CHAPTER_NOTEBOOKS["dp"])
    (submissions / "carol.ipynb").write_text('{"cells": [ this is not json')
    write(memory_notebook(lambda source: recommented(partly_solved(source)), **TWO_N_FLOPS), submissions / "dave.ipynb")
    shutil.copy(EXERCISES / CHAPTER_NOTEBOOKS["memory"], submissions / "erin.ipynb")
    (submissions / "frank.pdf").write_bytes(b"%PDF-1.4 not a notebook")
    (submissions / "gina").mkdir()
    shutil.copy(EXERCISES / CHAPTER_NOTEBOOKS["dp"], submissions / "gina" / "first.ipynb")
    write(chapter_notebook("dp", GINAS_DP), submissions / "gina" / "second.ipynb")
    unknown = memory_notebook()
    unknown.metadata["dtp"]["chapter"] = "quantum"
    write(unknown, submissions / "hank" / "quantum.ipynb")
    shutil.copy(solution_path("tp"), submissions / "hank" / CHAPTER_NOTEBOOKS["tp"])
    (submissions / "=SUM(A1)<i>.txt").write_text("a file name that a spreadsheet or a browser would run")
    return submissions


STUDENTS = ["'=SUM(A1)<i>", "alice", "bob", "carol", "dave", "erin", "frank", "gina", "hank"]
TOTALS = {"'=SUM(A1)<i>": 0, "alice": 25, "bob": 6 + 12, "carol": 0, "dave": 6, "erin": 0, "frank": 0, "gina": 11,
          "hank": 0}


def folder_digest(folder: Path) -> str:
    """Names, contents and modification times of everything below `folder`."""
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(f"{path.relative_to(folder)} {path.stat().st_mtime_ns}".encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def gradebook(results: Path) -> dict[str, dict[str, str]]:
    with open(results / "gradebook.csv", encoding="utf-8-sig", newline="") as f:
        return {row["student"]: row for row in csv.DictReader(f)}


def markdown_table(summary: str, heading: str) -> list[list[str]]:
    """The rows of the first table under `## heading` in summary.md, cells unescaped."""
    section = summary.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")][1:]  # the header, then |---|
    return [[re.sub(r"\\(.)", r"\1", cell.strip()) for cell in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    submissions = build_class(root)
    before = folder_digest(submissions)
    marker = uuid.uuid4().hex
    completed = grader_cli("class", submissions, "--out", root / "results", "--jobs", "2",
                           "--chapters", "memory,dp", marker=marker)
    assert completed.returncode == 0, completed.stderr
    results = root / "results"
    return {"root": root, "submissions": submissions, "results": results, "before": before, "marker": marker,
            "completed": completed, "summary": (results / "summary.md").read_text(encoding="utf-8")}


def test_gradebook_has_every_exercise_of_the_assignment_and_says_missing(graded_class):
    book = gradebook(graded_class["results"])
    assert list(book) == STUDENTS
    assert list(book["alice"]) == ["student", *MEMORY, "memory total", *DP, "dp total", "total", "max total", "notes"]
    assert {e: book["alice"][e] for e in MEMORY + DP} == {e: str(p) for e, p in POINTS.items()}
    assert {name: int(row["total"]) for name, row in book.items()} == TOTALS
    assert {row["max total"] for row in book.values()} == {"25"}  # the assignment's points, for everyone
    assert book["alice"]["notes"] == ""
    assert book["bob"]["memory.param_count"] == book["bob"]["memory.training_time"] == "failed"
    assert (book["bob"]["memory total"], book["bob"]["dp total"]) == ("6", "12")
    # A chapter not handed in: `missing` in every cell of it, 0 points.
    assert [book["dave"][e] for e in DP] == ["missing"] * 8 and book["dave"]["dp total"] == "0"
    assert [book["gina"][e] for e in MEMORY] == ["missing"] * 5
    assert [book["erin"][e] for e in MEMORY] == ["missing"] * 5 and "untouched" in book["erin"]["notes"]
    assert book["gina"]["dp.interview"] == "error" and book["gina"]["dp.bus_bandwidth"] == "failed"
    # Both of Gina's notebooks graded and flagged; the gradebook counts the higher score.
    assert "2 notebooks of chapter dp" in book["gina"]["notes"] and "gina/first.ipynb 0/14" in book["gina"]["notes"]
    assert "not valid JSON" in book["carol"]["notes"] and [book["carol"][e] for e in MEMORY + DP] == ["missing"] * 13
    assert "frank.pdf: not a notebook" in book["frank"]["notes"]
    assert "chapter 'quantum' is unknown" in book["hank"]["notes"]
    assert "hank/03_tensor_parallel.ipynb: a notebook of chapter tp, which is not in the assignment (memory, dp)" \
        in book["hank"]["notes"]
    assert "tp." not in "".join(book["alice"])  # no column for the chapter outside the assignment
    assert str(graded_class["root"]) not in (graded_class["results"] / "gradebook.csv").read_text()


def test_every_students_total_agrees_between_gradebook_summary_and_report(graded_class):
    book, results = gradebook(graded_class["results"]), graded_class["results"]
    students = markdown_table(graded_class["summary"], "Students")
    assert [row[0] for row in students] == [name.lstrip("'") for name in STUDENTS]
    for row in students:
        name = "'" + row[0] if row[0].startswith("=") else row[0]
        assert (row[1], row[2]) == (book[name]["total"], book[name]["max total"]), row
        stem = re.search(r"students/(.+)\.md", row[4])[1]
        document = json.loads((results / "students" / f"{stem}.json").read_text())
        assert (document["assignment"]["score"], document["assignment"]["max_score"]) == (TOTALS[name], 25)
    assert dict((row[0], row[3]) for row in students)["dave"] == "dp"
    assert dict((row[0], row[3]) for row in students)["carol"] == "memory, dp"
    assert "Assignment: chapters memory, dp (set by --chapters), 13 exercises, 25 points" in graded_class["summary"]


def test_every_submission_gets_a_progress_line_flagged_ones_included(graded_class):
    lines = graded_class["completed"].stdout.splitlines()
    assert lines[0] == "assignment: chapters memory, dp (set by --chapters), 13 exercises, 25 points"
    matches = [m for m in (re.fullmatch(r"\[(\d+)/(\d+)\] (.*)", line) for line in lines) if m]
    assert sorted(int(m[1]) for m in matches) == list(range(1, 14)) and {m[2] for m in matches} == {"13"}
    numbered = [m[3] for m in matches]  # 11 notebooks, and 2 other files
    by_file = {text.removeprefix("flagged: ").split(":", 1)[0]: text for text in numbered}
    assert by_file["carol.ipynb"].startswith("flagged: carol.ipynb: not a notebook (not valid JSON")
    assert by_file["hank/03_tensor_parallel.ipynb"] == (
        "flagged: hank/03_tensor_parallel.ipynb: a notebook of chapter tp, which is not in the assignment "
        "(memory, dp): not graded")
    assert by_file["hank/quantum.ipynb"].startswith("flagged: hank/quantum.ipynb: not a course notebook")
    assert by_file["frank.pdf"].startswith("flagged: frank.pdf: not a notebook")
    assert by_file["=SUM(A1)<i>.txt"].startswith("flagged: =SUM(A1)<i>.txt: not a notebook")
    assert re.fullmatch(r"alice/02_data_parallel\.ipynb: 14/14 in \d+\.\ds", by_file["alice/02_data_parallel.ipynb"])
    assert by_file["bob/01_memory.ipynb"].startswith("bob/01_memory.ipynb: 6/11 in ")
    assert by_file["erin.ipynb"].endswith("flagged: every exercise is missing (an untouched exercise notebook?)")
    assert "grading 8 notebook(s) on 2 process(es)" in graded_class["completed"].stdout


def test_summary_counts_each_exercises_passes(graded_class):
    rows = {row[0]: row[1:] for row in markdown_table(graded_class["summary"], "Exercises")}
    # points, handed in, passed, pass share, failed, error, timeout, missing, not handed in (of 9 students)
    assert rows["memory.param_count"] == ["3", "4", "1", "25 %", "2", "0", "0", "1", "5"]
    assert rows["memory.model_states"] == ["2", "4", "3", "75 %", "0", "0", "0", "1", "5"]
    assert rows["memory.training_time"] == ["2", "4", "1", "25 %", "2", "0", "0", "1", "5"]
    assert rows["dp.ring_time"] == rows["dp.bus_bandwidth"] == ["1", "3", "1", "33 %", "2", "0", "0", "0", "6"]
    assert rows["dp.interview"] == ["1", "3", "2", "67 %", "0", "1", "0", "0", "6"]
    assert rows["dp.bucketed_ddp"] == ["3", "3", "3", "100 %", "0", "0", "0", "0", "6"]
    assert list(rows) == MEMORY + DP


def test_summary_lists_each_exercises_most_common_mistakes_with_counts(graded_class):
    mistakes = markdown_table(graded_class["summary"], "Most common mistakes")
    by_exercise: dict[str, list[tuple[int, str]]] = {}
    for exercise_id, students, mistake in mistakes:
        by_exercise.setdefault(exercise_id, []).append((int(students), mistake))
    assert set(by_exercise) == {"memory.param_count", "memory.model_states", "memory.activations",
                                "memory.training_time", "memory.interview", "dp.ring_time", "dp.bus_bandwidth",
                                "dp.interview"}
    # Bob's and Dave's counts differ (their configs were drawn apart) but they made one mistake.
    (count, mistake), missing = by_exercise["memory.param_count"]
    assert count == 2 and "did you forget the learned position embeddings" in mistake
    assert missing == (1, "missing: not implemented")
    assert by_exercise["memory.training_time"] == [
        (2, "training_days: training costs 6N FLOPs per token (2N forward, 4N backward), not 2N"),
        (1, "missing: not implemented")]
    assert by_exercise["dp.bus_bandwidth"] == [
        (2, "bus_bandwidth: that is the algorithm bandwidth S/t; bus bandwidth scales it by 2(n-1)/n")]
    # The slip quotes the drawn latency: Bob's and Gina's wordings differ, and count as one.
    [(count, mistake)] = by_exercise["dp.ring_time"]
    assert count == 2
    assert re.fullmatch(r"ring_allreduce_time: the latency term 2\(n-1\)·alpha = \S+ s is missing", mistake), mistake
    [(count, mistake)] = by_exercise["dp.interview"]
    assert count == 1 and mistake.startswith("error (for example: ") and "n_gpu" in mistake
    assert by_exercise["memory.model_states"] == [(1, "missing: not implemented")]


def test_summary_flags_the_corrupt_file_and_the_chapter_outside_the_assignment(graded_class):
    flags = markdown_table(graded_class["summary"], "Flags")
    notes = {(student, note.split(":", 1)[0]) for student, note in flags}
    assert {("carol", "carol.ipynb"), ("hank", "hank/03_tensor_parallel.ipynb"), ("hank", "hank/quantum.ipynb"),
            ("frank", "frank.pdf"), ("erin", "erin.ipynb"), ("=SUM(A1)<i>", "=SUM(A1)<i>.txt")} <= notes
    chapters = {row[0]: row[1:] for row in markdown_table(graded_class["summary"], "Assignment")}
    assert chapters == {"memory": ["yes", "5", "11", "4"], "dp": ["yes", "8", "14", "3"],
                        "tp": ["no: its notebooks are flagged, not graded", "0", "0", "1"]}


def test_summary_html_embeds_the_chart_with_its_numbers_and_escapes_names(graded_class):
    page = (graded_class["results"] / "summary.html").read_text()
    images = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]*)">', page)
    assert len(images) == 1 and base64.b64decode(images[0][0]).startswith(b"\x89PNG\r\n\x1a\n")
    alt = images[0][1]
    assert "memory.param_count: 1 passed, 2 failed, 1 missing, 5 not handed in;" in alt
    assert "dp.interview: 2 passed, 1 error, 6 not handed in" in alt
    assert "src=\"http" not in page and "<script" not in page
    assert '<a href="students/bob.html">HTML</a>' in page and "<td>memory.param_count</td>" in page
    assert "=SUM(A1)&lt;i&gt;" in page and "<i>" not in page
    assert "(drawn in summary.html)" in graded_class["summary"]


def test_summary_lists_identical_submissions(graded_class):
    summary = graded_class["summary"]
    identical = summary.split("## Identical submissions", 1)[1].split("##", 1)[0]
    assert "- bob (bob/01\\_memory.ipynb), dave (dave.ipynb)" in identical
    assert "gina" not in identical and "erin" not in identical  # different code; an untouched handout
    assert "## Slowest exercises" in summary and "[HTML](students/alice.html)" in summary


def test_student_reports_have_the_graders_json_shape(graded_class):
    results = graded_class["results"]
    document = json.loads((results / "students" / "gina.json").read_text())
    assert document["student"] == "gina" and len(document["notebooks"]) == 2
    for notebook in document["notebooks"]:
        assert set(notebook) == {"path", "chapter", "score", "max_score", "elapsed_s", "exercises"}
        assert [set(e) for e in notebook["exercises"]] == [{"id", "points", "max_points", "status", "feedback"}] * 8
    assert [n["path"] for n in document["notebooks"]] == ["gina/first.ipynb", "gina/second.ipynb"]
    assert document["assignment"] == {"chapters": ["memory", "dp"], "how": "set by --chapters", "score": 11,
                                      "max_score": 25}
    bob = (results / "students" / "bob.md").read_text()
    assert "bob/01\\_memory.ipynb (chapter memory): 6/11" in bob and "position" in bob
    assert "Total: 18 of 25 points" in bob
    assert "Not handed in: dp (0 points)" in (results / "students" / "dave.md").read_text()
    assert json.loads((results / "students" / "frank.json").read_text())["notebooks"] == []
    assert "frank.pdf: not a notebook" in (results / "students" / "frank.html").read_text()


def test_submissions_are_not_written_and_nothing_is_left_running(graded_class):
    assert folder_digest(graded_class["submissions"]) == graded_class["before"]
    assert live_processes_with_marker(graded_class["marker"]) == []


def test_rerun_grades_only_changed_notebooks_and_regrade_grades_all(graded_class, tmp_path):
    submissions, results = tmp_path / "submissions", tmp_path / "results"
    shutil.copytree(graded_class["submissions"], submissions)
    shutil.copytree(graded_class["results"], results)
    unchanged = grader_cli("class", submissions, "--out", results, "--chapters", "01_memory.ipynb,dp")
    assert unchanged.returncode == 0 and "grading" not in unchanged.stdout, unchanged.stdout
    assert "[4/13] bob/01_memory.ipynb: 6/11 unchanged since the last run" in unchanged.stdout, unchanged.stdout
    assert gradebook(results) == gradebook(graded_class["results"])
    # Without --chapters, the assignment is every chapter handed in, and the summary says so.
    (submissions / "hank" / CHAPTER_NOTEBOOKS["tp"]).unlink()
    by_default = grader_cli("class", submissions, "--out", results)
    assert by_default.returncode == 0 and "grading" not in by_default.stdout, by_default.stdout
    assert "chapters memory, dp (every chapter a notebook was handed in for; --chapters sets them)" in \
        (results / "summary.md").read_text()
    assert {name: row["total"] for name, row in gradebook(results).items()} == {n: str(t) for n, t in TOTALS.items()}
    write(memory_notebook(), submissions / "bob" / CHAPTER_NOTEBOOKS["memory"])  # Bob fixes his answers
    rerun = grader_cli("class", submissions, "--out", results, "--chapters", "memory,dp")
    assert "grading 1 notebook(s)" in rerun.stdout and "bob/01_memory.ipynb: 11/11 in" in rerun.stdout, rerun.stdout
    assert gradebook(results)["bob"]["total"] == "23"
    again = grader_cli("class", submissions, "--out", results, "--regrade", "--only", "memory.interview")
    assert "grading 4 notebook(s)" in again.stdout, again.stdout
    assert list(gradebook(results)["alice"]) == ["student", "memory.interview", "memory total", "total",
                                                 "max total", "notes"]
    assert "alice/02_data_parallel.ipynb: not graded, --only names no exercise of its chapter, dp" in again.stdout


def test_chapters_are_named_by_chapter_or_by_the_course_notebooks_name():
    from grader.classroom.assignment import parse_chapters

    assert parse_chapters("dp, 01_memory.ipynb") == ["memory", "dp"]  # in the course's order
    assert parse_chapters("notebooks/02_data_parallel.ipynb,dp,") == ["dp"]


def test_mistakes_are_counted_alike_when_only_the_drawn_inputs_differ():
    from grader.classroom.mistakes import MISTAKES_SHOWN, common_mistakes

    def failed(feedback):
        return {"status": "failed", "feedback": feedback}

    outcomes = [
        failed("f(3, 'GB') is 1.5e+09, expected 2e+09: that is in GiB, not GB: 1 GB = 10^9 bytes"),
        failed("f(70, 'GB') is 42, expected 43.1: that is in GiB, not GB: 1 GB = 10^9 bytes"),
        failed("g(2) is 4, expected 2: that is in GiB, not GB: 1 GB = 10^9 bytes"),  # another function's slip
        failed("for Config(a=1, b=2) you counted 1,234 parameters, the model has 1,300 (-66): forgot the bias"),
        failed("for Config(a=7, b=9) you counted 98 parameters, the model has 100 (-2): forgot the bias"),
        failed("for Config(a=7, b=9) you counted 98 parameters, the model has 100 (+2): one bias too many"),
        failed("f(1, 'TB') is 1, expected 2"),
        {"status": "error", "feedback": "ZeroDivisionError: division by zero"},
        {"status": "error", "feedback": "NameError: name 'n_gpu' is not defined"},
        {"status": "missing", "feedback": "not implemented yet"},
        {"status": "passed", "feedback": "right"}, {"status": "not handed in", "feedback": ""}]
    counted = [(m.students, m.label) for m in common_mistakes(outcomes)]
    assert MISTAKES_SHOWN == 3 and counted == [
        (2, "f: that is in GiB, not GB: 1 GB = 10^9 bytes"),
        (2, "for Config(…) you counted 1,234 parameters, the model has 1,300 (-66): forgot the bias"),
        (1, "f(…) is 1, expected 2"),
        (2, "2 other kinds of failure (see the students' reports)"),
        (2, "error (for example: ZeroDivisionError: division by zero)"),
        (1, "missing: not implemented")]


GATE = ".open"  # a hidden file: the class command skips it; the sandbox may read the notebook's folder


def waits_for_the_gate(source: str) -> str:
    """A right answer that first waits until the test opens the gate: its grading cannot finish, on
    a fast machine or a slow one, before the test has interrupted the class."""
    return source.replace("def gpt_parameter_count(config):\n",
                          "def gpt_parameter_count(config):\n    import os, time\n"
                          f"    while not os.path.exists({GATE!r}):\n        time.sleep(0.01)\n", 1)


def test_an_interrupted_class_keeps_its_finished_notebooks_and_the_rerun_completes_them(tmp_path):
    submissions = tmp_path / "submissions"
    write(memory_notebook(), submissions / "student0.ipynb")
    for number in range(1, 4):
        write(memory_notebook(waits_for_the_gate), submissions / f"student{number}.ipynb")
    assert "while not os.path.exists" in (submissions / "student1.ipynb").read_text()
    results, marker = tmp_path / "results", uuid.uuid4().hex
    env = {**os.environ, "DTP_TEST_MARKER": marker, "PYTHONPATH": str(REPO)}
    # Its own session, so that the SIGINT below reaches it and its workers as a Ctrl-C would. One
    # job at a time, in name order: student0 is graded and cached, then student1 waits at the gate
    # (a time limit far beyond the test's, so that waiting can only end by the SIGINT).
    run = subprocess.Popen([sys.executable, "-m", "grader", "class", str(submissions), "--out", str(results),
                            "--jobs", "1", "--timeout", "3600"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True,
                           preexec_fn=ctrl_c_as_in_a_terminal)
    deadline = time.monotonic() + 240
    while not list((results / "cache").glob("*.json")) and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert run.poll() is None, run.communicate()
    os.killpg(run.pid, signal.SIGINT)
    stdout, stderr = run.communicate(timeout=120)
    assert run.returncode == 130, (stdout, stderr)
    assert "interrupted" in stderr and "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert live_processes_with_marker(marker) == []
    kept = [json.loads(path.read_text()) for path in (results / "cache").glob("*.json")]
    assert len(kept) == 1 and kept[0]["report"]["score"] == 11, kept
    assert not list((results / "cache").glob(".*.tmp"))
    (submissions / GATE).touch()
    rerun = grader_cli("class", submissions, "--out", results, "--timeout", "3600")  # the same options: the cache is reused
    assert rerun.returncode == 0 and "grading 3 notebook(s)" in rerun.stdout, rerun.stdout
    assert [row["total"] for row in gradebook(results).values()] == ["11"] * 4


def test_a_folder_named_class_is_still_a_path(tmp_path):
    write(memory_notebook(), tmp_path / "class" / "01_memory.ipynb")
    completed = grader_cli("class", "--only", "memory.interview", cwd=tmp_path)  # no --out: the folder
    assert completed.returncode == 0, completed.stderr
    assert "class/01_memory.ipynb" in completed.stdout and "2/2" in completed.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["class"]  # grading a path writes no class results


@pytest.mark.parametrize("arguments, fragment", [
    (["class", "{missing}", "--out", "{tmp}/results"], "no such folder"),
    (["class", "{tmp}", "--out", "{tmp}/results"], "overlaps SUBMISSIONS"),
    (["class", "{tmp}", "--out", "{tmp}/results", "--jobs", "0"], "--jobs must be at least 1"),
    (["class", "{tmp}", "--out", "{tmp}/results", "--only", "memory.nonsense"], "unknown exercise id"),
    (["class", "{tmp}", "--out", "{tmp}/results", "--chapters", "memory,quantum"], "unknown chapter 'quantum'"),
    (["class", "{tmp}", "--out", "{tmp}/results", "--chapters", " , "], "--chapters names no chapter"),
    (["class", "{tmp}", "--out", "{tmp}/results", "--chapters", "memory", "--only", "dp.ring_time"],
     "--only dp.ring_time: not in the assignment's chapters (memory)"),
])
def test_unusable_class_input_gets_one_line(tmp_path, arguments, fragment):
    (tmp_path / "alice.ipynb").write_text("{}")
    before = folder_digest(tmp_path)
    args = [a.format(tmp=tmp_path, missing=tmp_path / "nope") for a in arguments]
    completed = grader_cli(*args, cwd=tmp_path)
    assert completed.returncode == 2 and completed.stdout == ""
    assert len(completed.stderr.strip().splitlines()) == 1 and fragment in completed.stderr, completed.stderr
    assert folder_digest(tmp_path) == before


def test_class_without_out_says_what_is_missing(tmp_path):
    completed = grader_cli("class", tmp_path, cwd=tmp_path)
    assert completed.returncode == 2 and "--out" in completed.stderr and "Traceback" not in completed.stderr


def test_a_file_name_that_is_not_utf8_gets_a_row(tmp_path):
    from grader.classroom import grade_class

    submissions = tmp_path / "submissions"
    submissions.mkdir()
    (submissions / os.fsdecode(b"j\xf6rg.txt")).write_text("not a notebook")
    results = grade_class(submissions, tmp_path / "results", 1, None, None, False, say=lambda *a, **k: None)
    assert [s.name for s in results.students] == ["j\ufffdrg"]
    assert "j\ufffdrg,0,0," in (tmp_path / "results" / "gradebook.csv").read_text(encoding="utf-8-sig").replace('"', "")


def test_a_worker_that_dies_costs_its_notebook_only(monkeypatch, tmp_path):
    """A grading process that ends abruptly (the grader's own crash, the OOM killer) gives its
    notebook an error and is replaced for the next one. Workers are forked, so they run the
    patched `grade_one`."""
    from grader.classroom import workers

    def grade_one(path, only, timeout_s):
        if "crash" in path:
            os._exit(3)
        return {"report": {"path": path}}

    monkeypatch.setattr(workers, "grade_one", grade_one)
    jobs = [workers.Job(name, tmp_path / name, "") for name in ("a", "crash", "b", "c")]
    results = {}
    workers.grade_in_parallel(jobs, 1, None, None, lambda job, entry: results.setdefault(job.relpath, entry),
                              workers.ResultsCache(tmp_path / "cache"))
    assert results["crash"] == {"error": "the process grading it ended abruptly (exit code 3)"}
    assert [results[name]["report"]["path"] for name in "abc"] == list("abc")


# The learner's code runs in a sandbox forked from a worker, so it holds the worker's descriptors:
# it writes junk, a framed JSON job and an absurd message length to every one of them.
WRITES_TO_EVERY_DESCRIPTOR = """
_answer = interview_model_states_tb
def interview_model_states_tb(*args, **kwargs):
    import json, os, struct
    job = json.dumps({"relpath": "victim.ipynb", "path": "/nonexistent.ipynb", "sha256": "0"}).encode()
    for fd in range(3, 256):
        for payload in (b"!" * 16, struct.pack("!i", len(job)) + job, struct.pack("!i", 2**30)):
            try:
                os.write(fd, payload)
            except OSError:
                pass
    return _answer(*args, **kwargs)
"""


def test_a_sandbox_writing_to_inherited_descriptors_changes_no_other_result(tmp_path):
    submissions = tmp_path / "submissions"
    attacker = memory_notebook()
    attacker.cells.append(nbformat.v4.new_code_cell(WRITES_TO_EVERY_DESCRIPTOR))
    write(attacker, submissions / "mallory.ipynb")
    for name in ("victim", "walter"):
        write(memory_notebook(), submissions / f"{name}.ipynb")
    completed = grader_cli("class", submissions, "--out", tmp_path / "results", "--jobs", "2", "--only", "memory.interview")
    assert completed.returncode == 0, completed.stderr
    book = gradebook(tmp_path / "results")
    assert book["victim"]["memory.interview"] == book["walter"]["memory.interview"] == "2", book
    assert book["mallory"]["memory.interview"] in ("2", "error", "failed"), book  # whatever it did to itself
