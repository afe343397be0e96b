"""Shared helpers: course notebooks with one definition swapped for a (wrong) variant, graded
in-process through the public grading API (`graded`, `assert_fails`), and process-tree inspection."""
from __future__ import annotations

import ast
import contextlib
import functools
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = REPO / "solutions", REPO / "notebooks"
# chapter -> its notebook's file name, from the chapter each solution notebook names in its metadata
CHAPTER_NOTEBOOKS = {nbformat.read(path, as_version=4).metadata["dtp"]["chapter"]: path.name
                     for path in sorted(SOLUTIONS.glob("*.ipynb"))}


@contextlib.contextmanager
def spinning_processes(count: int | None = None):
    """CPU-bound processes, one per two cores unless `count` says otherwise: with the tests' other
    worker processes (make test runs one per core) the machine has about twice as much to run as it
    has cores, the load of a laptop running other work or of a shared CI machine. All of them are
    killed (their own process group) when the block ends, also when a test in it fails."""
    # Each spinner also dies with the test process (dtp.common.processes.die_with_parent): a test run
    # killed outright once left one spinning for an hour.
    spin = f"from dtp.common.processes import die_with_parent\ndie_with_parent({os.getpid()})\nwhile True: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin], start_new_session=True)
                for _ in range(count or max(1, (os.cpu_count() or 2) // 2))]
    try:
        yield len(spinners)
    finally:
        for spinner in spinners:
            os.killpg(spinner.pid, signal.SIGKILL)
            spinner.wait()


def ctrl_c_as_in_a_terminal() -> None:
    """`preexec_fn` for a child that a test interrupts with SIGINT: Ctrl-C reaches it as it reaches
    a program run from a terminal. Without it the child inherits the test run's disposition, and a
    test run started as a background job (`make test &`, a CI runner) ignores SIGINT: so would the
    child, as Python (and every program) keeps an ignored Ctrl-C ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def busy_machine():
    """Spinning processes for the rest of the module (see `spinning_processes`)."""
    with spinning_processes() as count:
        yield count


def solution_path(chapter: str) -> Path:
    return SOLUTIONS / CHAPTER_NOTEBOOKS[chapter]


def _cell_defining(notebook, name: str) -> int:
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            defined = getattr(node, "name", None) or [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            if name == defined or (isinstance(defined, list) and name in defined):
                return index
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def solution_notebook(chapter: str):
    """The chapter's solution notebook, read once (do not change it: notebook_variant makes copies)."""
    return nbformat.read(solution_path(chapter), as_version=4)


def solution_cell(chapter: str, name: str) -> str:
    """The source of the chapter's solution cell that defines `name` (a function, a class or a
    variable, at the cell's top level)."""
    notebook = solution_notebook(chapter)
    return notebook.cells[_cell_defining(notebook, name)].source


def changed(source: str, *replacements: tuple[str, str]) -> str:
    """`source` with each (old, new) replaced; an `old` that is not there fails the test (the
    solution changed under it)."""
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return source


def notebook_variant(tmp_path: Path, chapter: str, replacements: dict[str, str], extra_cells=()) -> Path:
    """The chapter's solution notebook with the cell defining each named function replaced."""
    notebook = nbformat.read(solution_path(chapter), as_version=4)
    for name, source in replacements.items():
        notebook.cells[_cell_defining(notebook, name)].source = source
    for source in extra_cells:
        notebook.cells.append(nbformat.v4.new_code_cell(source))
    path = tmp_path / f"{chapter}_variant.ipynb"
    nbformat.write(notebook, path)
    return path


def grade(path: Path, *exercise_ids: str, timeout_s: float | None = None) -> dict:
    """{exercise id: ExerciseResult} for the given exercises of a notebook."""
    from grader.grading import grade_notebook
    report = grade_notebook(str(path), list(exercise_ids) or None, timeout_s)
    return {result.id: result for result in report.exercises}


def graded(tmp_notebook, exercise_id: str, replacements: dict[str, str]):
    """The result of one exercise on its chapter's solution notebook with the cells defining the
    names in `replacements` replaced by the given sources (`tmp_notebook`: the fixture)."""
    return grade(tmp_notebook(exercise_id.split(".")[0], replacements), exercise_id)[exercise_id]


def assert_fails(result, *feedback) -> None:
    """The exercise failed with no points, and its feedback holds one of the `feedback` texts (a
    tuple counts as its texts: several where the random draw decides which of two right
    diagnoses comes first)."""
    texts = [text for item in feedback for text in ((item,) if isinstance(item, str) else item)]
    assert result.status == "failed" and result.points == 0, result
    assert any(text in result.feedback for text in texts), result.feedback


def assert_verdict(result, feedback: str | None) -> None:
    """Passed when `feedback` is None (a right answer), else failed with that feedback."""
    if feedback is None:
        assert result.status == "passed", result
    else:
        assert_fails(result, feedback)


def grader_cli(*args, cwd=REPO, marker=None, tmpdir=None, timeout=300, **kwargs) -> subprocess.CompletedProcess:
    """`python -m grader ARGS` in a child process, as a learner or instructor runs it. Its processes
    carry `marker` in their environment (see `live_processes_with_marker`); `tmpdir` gives it a
    temporary folder of its own, so that other programs' files do not count as its leftovers."""
    env = {**os.environ, "DTP_TEST_MARKER": marker or uuid.uuid4().hex, "PYTHONPATH": str(REPO)}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, "-m", "grader", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout, **kwargs)


def live_processes_with_marker(marker: str) -> list[int]:
    """Pids of live (non-zombie) processes whose environment carries `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if marker.encode() not in f.read():
                    continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            found.append(int(entry))
    return found


@pytest.fixture
def tmp_notebook(tmp_path):
    return lambda chapter, replacements, extra_cells=(): notebook_variant(tmp_path, chapter, replacements, extra_cells)


def numbers_slips_refused(exercise_id: str, draws: int = 100) -> dict[tuple[str, str], int]:
    """For a check of functions of numbers (`InterviewQuestions`, `FormulaCheck`, or any check with
    their `expected`/`slips` by function name): (function, slip) -> on how many of `draws`
    gradings (seeds 0, 1, ...) the answer that commits that slip wherever it is defined, every
    other answer right, is refused with that slip named. Judged in-process by the check's judge. A
    slip's feedback may quote the case's numbers ("top_k = 4"): slips are told apart by their words."""
    import numpy as np

    from grader.checks.common import FormulaCheck
    from grader.compare import CheckFailed
    from grader.registry import find_exercise

    check = find_exercise(exercise_id).check
    formula = isinstance(check, FormulaCheck)
    counts: dict[tuple[str, str], int] = {}
    for seed in range(draws):
        inputs = check.prepare(np.random.default_rng(seed))
        calls = {check.function: list(inputs)} if formula else {name: [(args, {}) for args in cases]
                                                               for name, cases in inputs.items()}

        def expected(name, args, kwargs):
            return check.expected(*args, **kwargs) if formula else check.expected(name, *args)

        def slips(name, args, kwargs):  # words of the feedback -> the value
            found = check.slips(*args, **kwargs) if formula else check.slips(name, *args)
            return {words(feedback): value for feedback, value in found.items()}

        right = {name: [expected(name, *call) for call in cases] for name, cases in calls.items()}
        named = {(name, feedback) for name, cases in calls.items() for call in cases for feedback in slips(name, *call)}
        for name, feedback in sorted(named):
            counts.setdefault((name, feedback), 0)
            answers = {**right, name: [slips(name, *call).get(feedback, value) for call, value in zip(calls[name], right[name])]}
            try:
                check.judge(inputs, answers[check.function] if formula else answers)
            except CheckFailed as failure:
                counts[name, feedback] += feedback in words(str(failure))
    return counts


def words(text: str) -> str:
    """A feedback text with its numbers left out."""
    import re

    return re.sub(r"[-+]?\d[\d.,e+-]*", "#", text)


def refusal_table(exercise_id: str, counts: dict, draws: int) -> str:
    """One line per slip: the exercise, the slip (shortened) and on how many draws it was refused."""
    return "\n".join(f"{exercise_id} | {' / '.join(str(part) for part in (key if isinstance(key, tuple) else (key,)))[:110]}"
                     f" | {count}/{draws}" for key, count in counts.items())


def refused_with(judge, feedback: str) -> bool:
    """Whether `judge()` refuses, with feedback that holds `feedback` (numbers aside)."""
    from grader.compare import CheckFailed

    try:
        judge()
    except CheckFailed as failure:
        return words(feedback) in words(str(failure))
    return False


def assert_every_slip_refused(exercise_id: str, counts: dict, draws: int = 100) -> None:
    """Every slip in `counts` (slip -> draws on which it was refused) refused on all `draws`; the
    table is printed (pytest -s shows it)."""
    print("\n" + refusal_table(exercise_id, counts, draws))
    assert counts and all(count == draws for count in counts.values()), refusal_table(exercise_id, counts, draws)
