"""notebooks/ is exactly what the release command makes from solutions/."""
import nbformat
import pytest

from grader.release import PLACEHOLDER, SETUP_CELL, ReplaceSolutions, RequireSetupCell, exercise_text, out_of_date
from conftest import SOLUTIONS


def test_exercise_notebooks_are_in_sync_with_solutions():
    assert out_of_date() == [], "run: python -m grader.release"


@pytest.mark.parametrize("solution", sorted(SOLUTIONS.glob("*.ipynb")), ids=lambda p: p.name)
def test_exercise_notebooks_hide_solutions_and_outputs(solution):
    exercise = nbformat.reads(exercise_text(solution), as_version=4)
    original = nbformat.read(solution, as_version=4)
    assert exercise.metadata["dtp"] == {**original.metadata["dtp"], "kind": "exercise"}
    assert len(exercise.cells) == len(original.cells)
    for cell in exercise.cells:
        assert "BEGIN SOLUTION" not in cell.source and "END SOLUTION" not in cell.source
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
    markers = sum(c.source.count("### BEGIN SOLUTION") for c in original.cells)
    placeholders = sum(c.source.count(PLACEHOLDER) + c.source.count("= ...  # your answer") for c in exercise.cells)
    assert markers > 0 and placeholders >= markers
    assert "widgets" not in exercise.metadata


def test_a_stale_exercise_notebook_is_reported(tmp_path):
    solutions, exercises = tmp_path / "solutions", tmp_path / "notebooks"
    solutions.mkdir()
    exercises.mkdir()
    source = next(SOLUTIONS.glob("*.ipynb"))
    (solutions / source.name).write_text(source.read_text())
    (exercises / source.name).write_text(exercise_text(source).replace("Exercise 1", "Exercise one"))
    (exercises / "orphan.ipynb").write_text("{}")
    assert sorted(out_of_date(solutions, exercises)) == [f"notebooks/{source.name}", "notebooks/orphan.ipynb (no solution)"]


def test_placeholder_keeps_the_marker_indentation_and_names_top_level_answers():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "def f(x):\n    y = 1\n    ### BEGIN SOLUTION\n    return x + y\n    ### END SOLUTION\n\n"
        "### BEGIN SOLUTION\nANSWER = 3\nOTHER = ANSWER * 2\n### END SOLUTION\n\n"
        "### BEGIN SOLUTION\nprint(1)\n### END SOLUTION")])
    source = ReplaceSolutions()(notebook).cells[0].source
    assert source == (f"def f(x):\n    y = 1\n    {PLACEHOLDER}\n\n"
                      "ANSWER = ...  # your answer\nOTHER = ...  # your answer\n\n" + PLACEHOLDER)


def test_a_notebook_without_the_setup_cell_is_refused():
    with pytest.raises(ValueError, match="SETUP_CELL"):
        RequireSetupCell()(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import dtp")]))
    RequireSetupCell()(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP_CELL + "\nimport numpy")]))


def test_unbalanced_markers_are_an_error():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("### BEGIN SOLUTION\nx = 1\n")])
    with pytest.raises(ValueError, match="unbalanced"):
        ReplaceSolutions()(notebook)
