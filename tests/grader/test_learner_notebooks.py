"""Notebooks as learners really write them, which the grader once mishandled (issues 15 and 16):
each is graded as the learner's kernel would run it, or refused in one clear line."""
import json
import os
import time
import uuid

import nbformat

from conftest import grade, grader_cli, live_processes_with_marker, solution_path


def test_a_lone_surrogate_in_a_comment_is_graded(tmp_path):
    """Half an emoji, JSON-escaped as \\ud83d, which some editors write: still a notebook."""
    notebook = json.loads(solution_path("dp").read_text())
    notebook["cells"][3]["source"] = ["# tested on my laptop \ud83d\n"] + notebook["cells"][3]["source"]
    path = tmp_path / "surrogate.ipynb"
    path.write_text(json.dumps(notebook))  # json escapes the lone surrogate as \ud83d
    assert "\\ud83d" in path.read_text()
    completed = grader_cli(path, "--only", "dp.ring_allreduce_numpy", "dp.ring_time")
    assert completed.returncode == 0, completed.stderr
    assert "total 3/3" in completed.stdout


def test_bytes_that_are_not_utf8_are_one_line(tmp_path):
    path = tmp_path / "latin1.ipynb"
    path.write_bytes(solution_path("dp").read_bytes().replace(b"Data parallelism", b"Donn\xe9es"))
    completed = grader_cli(path)
    assert completed.returncode == 2 and len(completed.stderr.strip().splitlines()) == 1
    assert "not UTF-8" in completed.stderr


def test_a_helper_module_written_next_to_the_notebook_is_importable(tmp_path):
    """`%%writefile helpers.py` in one cell, `import helpers` in a graded one: the grader imports
    from the notebook's folder, as the kernel does."""
    (tmp_path / "ring_helpers.py").write_text("def ring_factor(n):\n    return 2 * (n - 1) / n\n")
    notebook = nbformat.read(solution_path("dp"), as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell(
        "%%writefile ring_helpers.py\ndef ring_factor(n):\n    return 2 * (n - 1) / n\n"))
    notebook.cells.append(nbformat.v4.new_code_cell(
        "import ring_helpers\n\ndef bus_bandwidth(size_bytes, time_s, n):\n"
        "    return size_bytes / time_s * ring_helpers.ring_factor(n)\n"))
    path = tmp_path / "with_helpers.ipynb"
    nbformat.write(notebook, path)
    result = grade(path, "dp.bus_bandwidth")["dp.bus_bandwidth"]
    assert result.status == "passed", result
    assert sorted(os.listdir(tmp_path)) == ["ring_helpers.py", "with_helpers.ipynb"]  # nothing written


def test_answers_under_a_main_guard_are_seen(tmp_notebook):
    """`if __name__ == "__main__":` is true in a Jupyter kernel."""
    path = tmp_notebook("dp", {"interview_bytes_sent_per_gpu": (
        'if __name__ == "__main__":\n'
        "    def interview_bytes_sent_per_gpu(n_params, bytes_per_gradient, n_gpus):\n"
        "        return 2 * (n_gpus - 1) / n_gpus * n_params * bytes_per_gradient\n"
        "    def interview_allreduce_ms(n_params, bytes_per_gradient, n_gpus, link_bytes_per_s):\n"
        "        return interview_bytes_sent_per_gpu(n_params, bytes_per_gradient, n_gpus) / link_bytes_per_s * 1e3\n")})
    assert grade(path, "dp.interview")["dp.interview"].status == "passed"


def test_processes_a_graded_function_detaches_do_not_outlive_its_exercise(tmp_notebook):
    marker = uuid.uuid4().hex
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "import subprocess, sys\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
        "    return size_bytes / time_s * 2 * (n - 1) / n\n")})
    completed = grader_cli(path, "--only", "dp.bus_bandwidth", marker=marker)
    assert completed.returncode == 0 and "total 1/1" in completed.stdout, completed.stdout + completed.stderr
    time.sleep(0.5)
    assert live_processes_with_marker(marker) == []


def test_module_level_set_up_done_by_calling_a_helper_is_kept(tmp_notebook):
    """A unit table filled by a top-level call, and a constant set through `global` in an init
    function called at top level: both work in the kernel, so both must work when graded."""
    path = tmp_notebook("memory", {"model_state_memory": (
        "UNITS = {}\n"
        "def _add_units(**units):\n"
        "    UNITS.update(units)\n"
        "_add_units(B=1, MB=1e6, GB=1e9, TB=1e12, GiB=2**30, TiB=2**40)\n"
        "BYTES = None\n"
        "def init():\n"
        "    global BYTES\n"
        "    BYTES = {'fp32_adam': 16, 'mixed_adam': 16, 'mixed_adam_fp32_grad_accum': 20, 'mixed_sgd_momentum': 12}\n"
        "init()\n"
        "def model_state_memory(n_params, recipe, unit):\n"
        "    return n_params * BYTES[recipe] / UNITS[unit]\n")})
    result = grade(path, "memory.model_states")["memory.model_states"]
    assert result.status == "passed", result


def test_a_4_4_notebook_whose_cells_carry_ids_is_graded(tmp_path):
    """Some tools write cell ids into nbformat 4.4 files; Jupyter opens them (with a warning)."""
    notebook = json.loads(solution_path("dp").read_text())
    notebook["nbformat_minor"] = 4
    assert all("id" in cell for cell in notebook["cells"])
    path = tmp_path / "minor4.ipynb"
    path.write_text(json.dumps(notebook))
    completed = grader_cli(path, "--only", "dp.ring_time")
    assert completed.returncode == 0 and "total 1/1" in completed.stdout, completed.stderr


def test_a_correct_bus_bandwidth_passes_for_two_ranks(tmp_notebook):
    """At n = 2 the bus bandwidth equals the algorithm bandwidth: the right answer, not the slip."""
    from grader.registry import find_exercise
    import numpy as np

    check = find_exercise("dp.bus_bandwidth").check
    for _ in range(50):
        cases = check.prepare(np.random.default_rng())
        assert any(args[2] == 2 for args, _ in cases)
        check.judge(cases, [size / seconds * 2 * (n - 1) / n for (size, seconds, n), _ in cases])
