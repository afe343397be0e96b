"""A learner's first "Run All" on an untouched exercise notebook reaches the end: every
unfinished exercise says so in one line, no cell raises; and a notebook opened outside the
course's environment says in one line how to set up."""
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from conftest import EXERCISES
from grader.release import SETUP_CELL


@pytest.mark.parametrize("notebook_path", sorted(EXERCISES.glob("*.ipynb")), ids=lambda p: p.name)
def test_run_all_on_an_untouched_exercise_notebook_reaches_the_end(notebook_path):
    notebook = nbformat.read(notebook_path, as_version=4)
    # A cell takes seconds and a kernel starts in one. Under load a kernel once took over 60 s to
    # start, and nbclient sometimes gets a widget cell's reply (06_zero's calculator) only when its
    # per-cell wait runs out (jupyter/nbclient#312): each limit below stays under pytest's 300 s,
    # so such a stall costs that limit, and a cell that never ends fails naming itself.
    NotebookClient(notebook, timeout=110, startup_timeout=180, kernel_name="python3",
                   resources={"metadata": {"path": str(notebook_path.parent)}}).execute()  # raises on any error
    text = "\n".join(output.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                     for output in cell.outputs)
    assert "Traceback" not in text
    unfinished = [line for line in text.splitlines() if line.startswith("· ")]
    assert unfinished and all("not implemented yet" in line or "is still `...`" in line for line in unfinished)


def test_outside_the_course_environment_the_first_cell_says_how_to_set_up(tmp_path):
    """The setup cell under a Python that has no course packages (the system's, isolated)."""
    script = tmp_path / "first_cell.py"
    script.write_text(SETUP_CELL)
    completed = subprocess.run([sys.executable, "-I", "-S", str(script)], capture_output=True, text=True, cwd=tmp_path)
    assert completed.returncode == 1
    assert completed.stderr.strip().splitlines() == [
        "This notebook needs the course's environment: in the course folder run `make book`, then open the "
        "notebook with the .venv kernel (see the README)."]
