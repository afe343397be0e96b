"""A learner's first "Run All" on an untouched exercise notebook reaches the end: every
unfinished exercise says so in one line, no cell raises; and a notebook opened outside the
course's environment says in one line how to set up."""
import subprocess
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.output_widget import OutputWidget

from conftest import EXERCISES
from grader.release import SETUP_CELL


@pytest.mark.parametrize("notebook_path", sorted(EXERCISES.glob("*.ipynb")), ids=lambda p: p.name)
def test_run_all_on_an_untouched_exercise_notebook_reaches_the_end(notebook_path, monkeypatch):
    notebook = nbformat.read(notebook_path, as_version=4)
    # A widget that captures displays (`with output: display(...)`) makes nbclient send comm
    # messages to the kernel while it waits for the cell's reply, and then the reply is sometimes
    # read only when the cell's limit runs out (jupyter/nbclient#312): the calculators draw through
    # dtp.common.widgets.show_only instead, and this run fails if any cell makes nbclient send.
    sent = []
    monkeypatch.setattr(OutputWidget, "send", lambda widget, *args, **kwargs: sent.append(widget.comm_id))
    # A cell takes seconds and a kernel starts in one (under load one took over 60 s): each limit
    # stays under pytest's 300 s, so that a cell or a start that never ends fails naming itself.
    client = NotebookClient(notebook, timeout=110, startup_timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(notebook_path.parent)}})
    client.execute()  # raises on any error
    assert not sent, "a widget captured displays: nbclient answered on the shell socket"
    drawn = [state for state in client.widget_state.values() if state.get("_model_name") == "OutputModel"]
    calculators = [cell for cell in notebook.cells if cell.source.rstrip().endswith(("calculator()", "explorer()"))]
    assert len(drawn) == len(calculators)
    assert all(len(state["outputs"]) == 1 and "image/png" in state["outputs"][0]["data"] for state in drawn), \
        "a calculator's Output widget does not show its one figure"
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
