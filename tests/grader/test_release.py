"""notebooks/ is exactly what the release command makes from solutions/."""
import re

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


# Rounding noise: a float printed to its last bits (1.1920928955078125e-07, 0.30000000000000004), or any
# number at float32's resolution or below (1e-06 and smaller). Such a stored output matches only the machine and
# thread timing that produced it, and nbval fails it elsewhere.
ROUNDING_NOISE = re.compile(r"\d(\.\d+)?e-(0[6-9]|[1-9]\d)\b|\d\.\d{5,}e-05\b|\d\.\d{10,}")


@pytest.mark.parametrize("solution", sorted(SOLUTIONS.glob("*.ipynb")), ids=lambda p: p.name)
def test_stored_outputs_print_no_rounding_noise(solution):
    for index, cell in enumerate(nbformat.read(solution, as_version=4).cells):
        for output in cell.get("outputs", []):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            noise = ROUNDING_NOISE.search(text)
            assert noise is None, (f"cell {index} stores {noise.group(0)!r}: print a bound or a rounded value "
                                   "that cannot flip between machines")


def test_the_rounding_noise_pattern_catches_what_it_is_for():
    assert ROUNDING_NOISE.search("per rank: [1.4901161193847656e-07, 0.0]")
    assert ROUNDING_NOISE.search("loss 0.30000000000000004")
    assert ROUNDING_NOISE.search("largest difference 2e-07")
    assert not ROUNDING_NOISE.search("gradient [ 3.4e-04  5.0e-05 ] and 0.01615, below 1e-5, 2.5e+10")
