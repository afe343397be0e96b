"""Build the exercise notebooks in notebooks/ from the solution notebooks in solutions/.

    python -m grader.release            # write notebooks/
    python -m grader.release --check    # exit 1 if notebooks/ is not what this would write
    python -m grader.release --execute  # first re-run solutions/ and store their outputs (for nbval)
    python -m grader.release --execute --only 04_pipeline   # re-run only the solutions named

Like nbgrader's assign step: a list of small transformations, each doing one thing.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
SOLUTIONS, EXERCISES = REPO / "solutions", REPO / "notebooks"

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
PLACEHOLDER = 'raise NotImplementedError("write your solution here")'
ANSWER_PLACEHOLDER = "{name} = ...  # your answer"
_SOLUTION_BLOCK = re.compile(rf"^([ \t]*){re.escape(BEGIN)}[ \t]*\n(.*?)^[ \t]*{re.escape(END)}[ \t]*$", re.S | re.M)

# The first code cell of every notebook: opened outside the course's environment, a notebook says
# in one line how to set up, instead of failing on its first import.
SETUP_CELL = """try:
    import dtp  # the course library: this notebook runs in the course's environment
except ModuleNotFoundError:
    raise SystemExit("This notebook needs the course's environment: in the course folder run `make book`, "
                     "then open the notebook with the .venv kernel (see the README).") from None"""


def _answer_names(block: str) -> list[str]:
    """The names a top-level solution block assigns, if it only assigns names."""
    try:
        tree = ast.parse(block)
    except SyntaxError:
        return []
    names = []
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets)):
            return []
        names += [t.id for t in node.targets if t.id not in names]
    return names


def _placeholder(match: re.Match) -> str:
    indentation, block = match.group(1), match.group(2)
    names = _answer_names(block) if not indentation else []
    if names:  # answers at top level: "Run All" must not stop here, and the cell names what to define
        return "\n".join(ANSWER_PLACEHOLDER.format(name=name) for name in names)
    return indentation + PLACEHOLDER


class ReplaceSolutions:
    """Code between the solution markers becomes `raise NotImplementedError(...)` at the marker's
    indentation; a top-level block of answers becomes one `name = ...` line per answer."""

    def __call__(self, notebook):
        for cell in notebook.cells:
            if cell.cell_type != "code":
                continue
            if cell.source.count(BEGIN) != cell.source.count(END):
                raise ValueError(f"cell {cell.get('id')}: unbalanced solution markers")
            cell.source = _SOLUTION_BLOCK.sub(_placeholder, cell.source)
        return notebook


class RequireSetupCell:
    """Every notebook starts (first code cell) with SETUP_CELL."""

    def __call__(self, notebook):
        first = next((cell for cell in notebook.cells if cell.cell_type == "code"), None)
        if first is None or not first.source.startswith(SETUP_CELL):
            raise ValueError("the first code cell must start with grader.release.SETUP_CELL")
        return notebook


class ClearOutputs:
    """Exercise notebooks start clean: no outputs, no execution counts."""

    def __call__(self, notebook):
        for cell in notebook.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
            cell.metadata.pop("execution", None)
        return notebook


class StripWidgetState:
    """Saved widget models (the calculators' sliders) belong to one kernel session, not the notebook."""

    def __call__(self, notebook):
        notebook.metadata.pop("widgets", None)
        return notebook


class MarkAsExercise:
    """Record in the metadata that this is the learner's copy (the chapter stays the same)."""

    def __call__(self, notebook):
        notebook.metadata.setdefault("dtp", {})["kind"] = "exercise"
        return notebook


TRANSFORMATIONS = [RequireSetupCell(), ReplaceSolutions(), ClearOutputs(), StripWidgetState(), MarkAsExercise()]


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
    NotebookClient(notebook, timeout=timeout_s, startup_timeout=240, kernel_name="python3",
                   resources={"metadata": {"path": str(notebook_path.parent)}}).execute()
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)  # timestamps would make every run a diff
    nbformat.write(notebook, notebook_path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grader.release", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether notebooks/ is up to date")
    parser.add_argument("--execute", action="store_true", help="re-run solutions/ in place first, storing outputs")
    parser.add_argument("--only", nargs="+", metavar="NAME", default=(),
                        help="with --execute, re-run only the solution notebooks whose file name contains NAME")
    args = parser.parse_args(argv)
    if args.execute:
        for source in sorted(SOLUTIONS.glob("*.ipynb")):
            if args.only and not any(name in source.name for name in args.only):
                continue
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
