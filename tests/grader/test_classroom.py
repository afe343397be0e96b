"""`python -m grader class`: a small class of memory-chapter notebooks (the fastest chapter) with
the usual mistakes of a hand-in: solved, partly solved, broken JSON, a copy with other comments,
an untouched exercise notebook, a file that is not a notebook, two notebooks of one chapter, an
unknown chapter. Checks the gradebook, the summary's counts, the reports, that SUBMISSIONS is not
written, resuming, and an interrupted run."""
from __future__ import annotations

import csv
import hashlib
import json
import os
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
POINTS = {"memory.param_count": 3, "memory.model_states": 2, "memory.activations": 2, "memory.training_time": 2,
          "memory.interview": 2}
RIGHT_EMBEDDINGS = "embeddings = (config.vocab_size + config.n_positions) * h"
NO_POSITIONS = "embeddings = config.vocab_size * h"  # forgets the position embeddings


def memory_notebook(edit=None) -> nbformat.NotebookNode:
    notebook = nbformat.read(solution_path("memory"), as_version=4)
    if edit:
        for cell in notebook.cells:
            if cell.cell_type == "code" and "def gpt_parameter_count" in cell.source:
                cell.source = edit(cell.source)
    return notebook


def partly_solved(source: str) -> str:
    assert RIGHT_EMBEDDINGS in source
    return source.replace(RIGHT_EMBEDDINGS, NO_POSITIONS)


def recommented(source: str) -> str:
    """The same code, other comments and whitespace: graded definitions identical after normalising."""
    return "# my own way\n" + source.replace("    width =", "    # the MLP's width\n    width  =") + "\n\n"


def write(notebook, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, path)


def build_class(root: Path) -> Path:
    submissions = root / "submissions"
    write(memory_notebook(), submissions / "alice" / "week1" / CHAPTER_NOTEBOOKS["memory"])
    write(memory_notebook(partly_solved), submissions / "bob.ipynb")
    (submissions / "carol.ipynb").write_text('{"cells": [ this is not json')
    write(memory_notebook(recommented), submissions / "dave.ipynb")
    shutil.copy(EXERCISES / CHAPTER_NOTEBOOKS["memory"], submissions / "erin.ipynb")
    (submissions / "frank.pdf").write_bytes(b"%PDF-1.4 not a notebook")
    write(memory_notebook(partly_solved), submissions / "gina" / "first.ipynb")
    write(memory_notebook(), submissions / "gina" / "second.ipynb")
    unknown = memory_notebook()
    unknown.metadata["dtp"]["chapter"] = "quantum"
    write(unknown, submissions / "hank" / "quantum.ipynb")
    (submissions / "=SUM(A1)<i>.txt").write_text("a file name that a spreadsheet or a browser would run")
    return submissions


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


@pytest.fixture(scope="module")
def graded_class(tmp_path_factory):
    root = tmp_path_factory.mktemp("class")
    submissions = build_class(root)
    before = folder_digest(submissions)
    marker = uuid.uuid4().hex
    completed = grader_cli("class", submissions, "--out", root / "results", "--jobs", "2", marker=marker)
    assert completed.returncode == 0, completed.stderr
    return {"root": root, "submissions": submissions, "results": root / "results", "before": before,
            "marker": marker, "completed": completed}


def test_gradebook_has_a_row_per_student_and_a_cell_per_exercise(graded_class):
    book = gradebook(graded_class["results"])
    assert list(book) == ["'=SUM(A1)<i>", "alice", "bob", "carol", "dave", "erin", "frank", "gina", "hank"]
    assert list(book["alice"]) == ["student", *MEMORY, "memory total", "total", "max total", "notes"]
    assert {e: book["alice"][e] for e in MEMORY} == {e: str(p) for e, p in POINTS.items()}
    assert book["alice"]["total"] == book["alice"]["max total"] == "11" and book["alice"]["notes"] == ""
    assert book["bob"]["memory.param_count"] == "failed" and book["bob"]["memory total"] == "8"
    assert book["dave"]["total"] == "11"
    assert [book["erin"][e] for e in MEMORY] == ["missing"] * 5 and "untouched" in book["erin"]["notes"]
    assert "not valid JSON" in book["carol"]["notes"] and book["carol"]["memory total"] == ""
    assert "frank.pdf: not a notebook" in book["frank"]["notes"]
    assert "chapter 'quantum' is unknown" in book["hank"]["notes"] and book["hank"]["total"] == "0"
    # Both of Gina's notebooks graded and flagged; the gradebook counts the higher score.
    assert book["gina"]["total"] == "11" and "2 notebooks of chapter memory" in book["gina"]["notes"]
    assert "gina/first.ipynb 8/11" in book["gina"]["notes"]
    assert str(graded_class["root"]) not in (graded_class["results"] / "gradebook.csv").read_text()


def test_summary_counts_passes_failures_and_identical_submissions(graded_class):
    summary = (graded_class["results"] / "summary.md").read_text()
    # handed in: alice, bob, dave, erin, gina (her second notebook counts); passed: alice, dave, gina
    assert "| memory.param\\_count | 3 | 5 | 3 | 60 % | 1 | 0 | 0 | 1 |" in summary
    assert "| memory.model\\_states | 2 | 5 | 4 | 80 % | 0 | 0 | 0 | 1 |" in summary
    failure_lines = [line for line in summary.splitlines() if line.startswith("| memory.param\\_count | 1 |")]
    assert len(failure_lines) == 1 and "position" in failure_lines[0], summary
    identical = summary.split("## Identical submissions", 1)[1].split("##", 1)[0]
    assert "- alice (alice/week1/01\\_memory.ipynb), dave (dave.ipynb), gina (gina/second.ipynb)" in identical
    assert "- bob (bob.ipynb), gina (gina/first.ipynb)" in identical
    assert "erin" not in identical  # an untouched handout matches every other one: not listed
    assert "## Slowest exercises" in summary and "[HTML](students/alice.html)" in summary
    page = (graded_class["results"] / "summary.html").read_text()
    assert '<a href="students/bob.html">HTML</a>' in page and "<td>memory.param_count</td>" in page
    assert "=SUM(A1)&lt;i&gt;" in page and "<i>" not in page


def test_student_reports_have_the_graders_json_shape(graded_class):
    results = graded_class["results"]
    document = json.loads((results / "students" / "gina.json").read_text())
    assert document["student"] == "gina" and len(document["notebooks"]) == 2
    for notebook in document["notebooks"]:
        assert set(notebook) == {"path", "chapter", "score", "max_score", "elapsed_s", "exercises"}
        assert [set(e) for e in notebook["exercises"]] == [{"id", "points", "max_points", "status", "feedback"}] * 5
    assert [n["path"] for n in document["notebooks"]] == ["gina/first.ipynb", "gina/second.ipynb"]
    bob = (results / "students" / "bob.md").read_text()
    assert "bob.ipynb (chapter memory): 8/11" in bob and "position" in bob
    assert json.loads((results / "students" / "frank.json").read_text())["notebooks"] == []
    assert "frank.pdf: not a notebook" in (results / "students" / "frank.html").read_text()


def test_submissions_are_not_written_and_nothing_is_left_running(graded_class):
    assert folder_digest(graded_class["submissions"]) == graded_class["before"]
    assert live_processes_with_marker(graded_class["marker"]) == []


def test_rerun_grades_only_changed_notebooks_and_regrade_grades_all(graded_class, tmp_path):
    submissions, results = tmp_path / "submissions", tmp_path / "results"
    shutil.copytree(graded_class["submissions"], submissions)
    shutil.copytree(graded_class["results"], results)
    unchanged = grader_cli("class", submissions, "--out", results)
    assert unchanged.returncode == 0 and "grading" not in unchanged.stdout, unchanged.stdout
    assert gradebook(results) == gradebook(graded_class["results"])
    write(memory_notebook(), submissions / "bob.ipynb")  # Bob fixes his answer and hands it in again
    rerun = grader_cli("class", submissions, "--out", results)
    assert "grading 1 notebook(s)" in rerun.stdout and "bob.ipynb: 11/11" in rerun.stdout, rerun.stdout
    assert gradebook(results)["bob"]["total"] == "11"
    again = grader_cli("class", submissions, "--out", results, "--regrade", "--only", "memory.interview")
    assert "grading 6 notebook(s)" in again.stdout, again.stdout
    assert list(gradebook(results)["alice"]) == ["student", "memory.interview", "memory total", "total",
                                                 "max total", "notes"]


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
