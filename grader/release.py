"""Build the exercise notebooks in notebooks/ from the solution notebooks in solutions/.

    python -m grader.release            # write notebooks/
    python -m grader.release --check    # exit 1 if notebooks/ is not what this would write
    python -m grader.release --execute  # first re-run solutions/ and store their outputs (for nbval)

Like nbgrader's assign step: a list of small transformations, each doing one thing.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = REPO / "solutions", REPO / "notebooks"

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
PLACEHOLDER = 'raise NotImplementedError("write your solution here")'
_SOLUTION_BLOCK = re.compile(rf"^([ \t]*){re.escape(BEGIN)}[ \t]*\n.*?^[ \t]*{re.escape(END)}[ \t]*$", re.S | re.M)


class ReplaceSolutions:
    """Code between the solution markers becomes `raise NotImplementedError(...)` at the marker's indentation."""

    def __call__(self, notebook):
        for cell in notebook.cells:
            if cell.cell_type != "code":
                continue
            if cell.source.count(BEGIN) != cell.source.count(END):
                raise ValueError(f"cell {cell.get('id')}: unbalanced solution markers")
            cell.source = _SOLUTION_BLOCK.sub(lambda m: m.group(1) + PLACEHOLDER, cell.source)
        return notebook


class ClearOutputs:
    """Exercise notebooks start clean: no outputs, no execution counts."""

    def __call__(self, notebook):
        for cell in notebook.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
        return notebook


class MarkAsExercise:
    """Record in the metadata that this is the learner's copy (the chapter stays the same)."""

    def __call__(self, notebook):
        notebook.metadata.setdefault("dtp", {})["kind"] = "exercise"
        return notebook


TRANSFORMATIONS = [ReplaceSolutions(), ClearOutputs(), MarkAsExercise()]


def exercise_text(solution_path: Path) -> str:
    """The exercise notebook for one solution notebook, as the exact text to write."""
    notebook = nbformat.read(solution_path, as_version=4)
    for transform in TRANSFORMATIONS:
        notebook = transform(notebook)
    return nbformat.writes(notebook) + "\n"


def out_of_date(solutions: Path = SOLUTIONS, exercises: Path = EXERCISES) -> list[str]:
    """Exercise notebooks that differ from (or are missing beside) what the release would write."""
    stale = []
    for source in sorted(solutions.glob("*.ipynb")):
        target = exercises / source.name
        if not target.exists() or target.read_text(encoding="utf-8") != exercise_text(source):
            stale.append(str(target.relative_to(exercises.parent)))
    expected = {p.name for p in solutions.glob("*.ipynb")}
    stale += [str(p.relative_to(exercises.parent)) + " (no solution)" for p in exercises.glob("*.ipynb") if p.name not in expected]
    return stale


def release(solutions: Path = SOLUTIONS, exercises: Path = EXERCISES) -> list[Path]:
    exercises.mkdir(exist_ok=True)
    written = []
    for source in sorted(solutions.glob("*.ipynb")):
        target = exercises / source.name
        target.write_text(exercise_text(source), encoding="utf-8")
        written.append(target)
    return written


def execute_in_place(notebook_path: Path, timeout_s: int = 600) -> None:
    """Run a solution notebook top to bottom and store its outputs, which nbval then checks."""
    from nbclient import NotebookClient

    notebook = nbformat.read(notebook_path, as_version=4)
    NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(notebook_path.parent)}}).execute()
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)  # timestamps would make every run a diff
    nbformat.write(notebook, notebook_path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader.release", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether notebooks/ is up to date")
    parser.add_argument("--execute", action="store_true", help="re-run solutions/ in place first, storing outputs")
    args = parser.parse_args(argv)
    if args.execute:
        for source in sorted(SOLUTIONS.glob("*.ipynb")):
            print(f"executing {source.relative_to(REPO)}", flush=True)
            execute_in_place(source)
    if args.check:
        stale = out_of_date()
        for path in stale:
            print(f"out of date: {path} (run: python -m grader.release)")
        return 1 if stale else 0
    for path in release():
        print(f"wrote {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
