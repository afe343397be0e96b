"""Bad input gets a documented status and a one-line message; the other exercises are still
graded; the notebook is byte-identical afterwards; and no process is left behind."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from conftest import REPO, ctrl_c_as_in_a_terminal, grade, grader_cli, live_processes_with_marker, solution_path

RING_TIME_OK = "dp.ring_time"


def assert_one_line_error(completed, fragment):
    assert completed.returncode == 2
    assert completed.stdout == ""
    lines = completed.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in completed.stderr, completed.stderr
    assert fragment in lines[0]


def test_missing_path(tmp_path):
    assert_one_line_error(grader_cli(tmp_path / "nope.ipynb"), "no such file")


def test_file_that_is_not_json(tmp_path):
    path = tmp_path / "broken.ipynb"
    path.write_text("this is { not json")
    assert_one_line_error(grader_cli(path), "not valid JSON")


def test_json_that_is_not_a_notebook(tmp_path):
    path = tmp_path / "list.ipynb"
    path.write_text(json.dumps({"hello": [1, 2, 3]}))
    assert_one_line_error(grader_cli(path), "not a notebook")


def test_notebook_of_no_known_chapter(tmp_path):
    notebook = json.loads(solution_path("dp").read_text())
    notebook["metadata"]["dtp"]["chapter"] = "quantum"
    path = tmp_path / "quantum.ipynb"
    path.write_text(json.dumps(notebook))
    assert_one_line_error(grader_cli(path), "chapter 'quantum' is unknown")
    del notebook["metadata"]["dtp"]
    path.write_text(json.dumps(notebook))
    assert_one_line_error(grader_cli(path), "names no chapter")


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number(value):
    assert_one_line_error(grader_cli(solution_path("dp"), "--timeout", value), "--timeout must be a positive number")


def test_course_metadata_of_the_wrong_shape(tmp_path):
    notebook = json.loads(solution_path("dp").read_text())
    notebook["metadata"]["dtp"] = "dp"
    path = tmp_path / "odd.ipynb"
    path.write_text(json.dumps(notebook))
    assert_one_line_error(grader_cli(path), "names no chapter")


def test_unknown_exercise_id_and_empty_folder(tmp_path):
    assert_one_line_error(grader_cli(solution_path("dp"), "--only", "dp.nonsense"), "unknown exercise id")
    assert_one_line_error(grader_cli(tmp_path), "no .ipynb")


BROKEN_STUDENT_CODE = {
    "syntax error": ("ring_all_reduce_numpy", "def ring_all_reduce_numpy(arrays, network):\n    return [arrays,\n",
                     "missing", "syntax error"),
    "exception": ("ring_all_reduce_numpy", "def ring_all_reduce_numpy(arrays, network):\n    return arrays[len(arrays)]\n",
                  "error", "IndexError"),
    "infinite loop": ("ring_all_reduce_numpy", "def ring_all_reduce_numpy(arrays, network):\n    while True:\n        pass\n",
                      "timeout", "stopped after"),
    "sys.exit": ("ring_all_reduce_numpy", "import sys\ndef ring_all_reduce_numpy(arrays, network):\n    sys.exit(3)\n",
                 "error", "sys.exit(3)"),
    "os._exit": ("ring_all_reduce_numpy", "import os\ndef ring_all_reduce_numpy(arrays, network):\n    os._exit(0)\n",
                 "error", "ended abruptly"),
    "os._exit in a rank": ("ring_all_reduce", "import os\ndef ring_all_reduce(tensor):\n    os._exit(0)\n",
                           "error", "ended without returning"),
    "rank raises": ("ring_all_reduce", "def ring_all_reduce(tensor):\n    raise ValueError('boom')\n",
                    "error", "raised ValueError: boom"),
    "rank never joins": ("ring_all_reduce",
                         "def ring_all_reduce(tensor):\n    if dist.get_rank() == 0:\n        dist.recv(tensor, 1)\n",
                         "timeout", "never joined"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_STUDENT_CODE))
def test_broken_code_costs_only_its_exercise(tmp_notebook, case):
    name, source, status, fragment = BROKEN_STUDENT_CODE[case]
    exercise_id = "dp.ring_allreduce_numpy" if name == "ring_all_reduce_numpy" else "dp.ring_allreduce_gloo"
    path = tmp_notebook("dp", {name: source})
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    results = grade(path, exercise_id, RING_TIME_OK, timeout_s=4 if case == "infinite loop" else 9)
    assert results[exercise_id].status == status, results[exercise_id]
    assert fragment in results[exercise_id].feedback
    assert "\n" not in results[exercise_id].feedback
    assert results[RING_TIME_OK].status == "passed"  # the rest of the notebook is still graded
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before


def test_top_level_demo_code_is_not_run_by_the_grader(tmp_notebook):
    """Cells that train, plot or exit at top level are the learner's experiments, not definitions."""
    path = tmp_notebook("dp", {}, extra_cells=["import os\nos._exit(1)", "while True:\n    pass"])
    assert grade(path, RING_TIME_OK)[RING_TIME_OK].status == "passed"


def test_no_process_or_file_survives_a_timeout_or_deadlock(tmp_notebook, tmp_path):
    path = tmp_notebook("dp", {
        "ring_all_reduce_numpy": "def ring_all_reduce_numpy(arrays, network):\n    while True:\n        pass\n",
        "ring_all_reduce": "def ring_all_reduce(tensor):\n    while True:\n        pass\n"})
    marker, private_tmp = uuid.uuid4().hex, tmp_path / "tmp"
    private_tmp.mkdir()
    completed = grader_cli(path, "--only", "dp.ring_allreduce_numpy", "dp.ring_allreduce_gloo", "--timeout", "4", marker=marker,
                    tmpdir=private_tmp)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.count("timeout") == 2
    assert live_processes_with_marker(marker) == []
    assert os.listdir(private_tmp) == []  # the killed gloo world's result folder is gone too


def test_ctrl_c_stops_everything(tmp_notebook, tmp_path):
    path = tmp_notebook("dp", {"ring_all_reduce": "def ring_all_reduce(tensor):\n    while True:\n        pass\n"})
    marker, private_tmp = uuid.uuid4().hex, tmp_path / "tmp"
    private_tmp.mkdir()
    env = {**os.environ, "DTP_TEST_MARKER": marker, "TMPDIR": str(private_tmp)}
    # A time limit far beyond the test's: the grading can only end by the SIGINT.
    grader = subprocess.Popen([sys.executable, "-m", "grader", str(path), "--only", "dp.ring_allreduce_gloo",
                               "--timeout", "3600"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              preexec_fn=ctrl_c_as_in_a_terminal)
    deadline = time.monotonic() + 240
    while len(live_processes_with_marker(marker)) < 5 and time.monotonic() < deadline:  # grader, warden, sandbox, 2 ranks
        time.sleep(0.2)
    assert len(live_processes_with_marker(marker)) >= 5
    grader.send_signal(signal.SIGINT)
    _, stderr = grader.communicate(timeout=120)  # a bound for a hang, not a speed: it takes a second or two
    assert grader.returncode == 130
    assert stderr.strip().splitlines() == ["grader: interrupted; nothing was left running"]
    assert live_processes_with_marker(marker) == []  # the grader waited for its warden, which reaped the rest
    assert os.listdir(private_tmp) == []


def test_ctrl_c_just_after_the_fork_of_a_warden_is_not_lost(monkeypatch):
    """A Ctrl-C that lands inside Process.start(), once the child exists but before run_isolated's
    `try` holds it, used to leave that warden (and its sandbox) running to the time limit, with the
    grader waiting for it at exit. The interrupt is now held until the `try` is armed."""
    import multiprocessing.context

    from grader.sandbox import descendants, kill_descendants, run_isolated

    started = multiprocessing.context.ForkProcess.start

    def start_then_interrupt(process):
        started(process)
        os.kill(os.getpid(), signal.SIGINT)  # delivered by the time start() returns, as a Ctrl-C would be

    monkeypatch.setattr(multiprocessing.context.ForkProcess, "start", start_then_interrupt)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_isolated(lambda: time.sleep(3600), timeout_s=3600)
    finally:
        signal.signal(signal.SIGINT, previous)
        left = descendants(os.getpid())
        kill_descendants()  # so that a failure here does not leave pytest waiting for them at exit
    assert left == []


def test_two_graders_at_once(tmp_path):
    markers = [uuid.uuid4().hex for _ in range(2)]
    reports = [tmp_path / f"report{i}.json" for i in range(2)]
    graders = [subprocess.Popen([sys.executable, "-m", "grader", str(solution_path("dp")), "--only",
                                 "dp.ring_allreduce_gloo", "dp.ddp_by_hand", "--json", str(report)],
                                cwd=REPO, env={**os.environ, "DTP_TEST_MARKER": marker},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for marker, report in zip(markers, reports)]
    for grader in graders:
        grader.communicate(timeout=300)
        assert grader.returncode == 0
    for report in reports:
        notebook = json.loads(report.read_text())["notebooks"][0]
        assert notebook["score"] == notebook["max_score"] == 4
    for marker in markers:
        assert live_processes_with_marker(marker) == []


def test_module_level_helpers_that_functions_read_are_kept(tmp_notebook):
    """A learner's lowercase helper variable is kept because their function reads it; a demo
    assignment that nothing reads is not run."""
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "ring_factor = lambda n: 2 * (n - 1) / n\n"
        "scale = 1.0\n"
        "never_read = __import__('os')._exit(1)\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    return size_bytes / time_s * ring_factor(n) * scale\n")})
    assert grade(path, "dp.bus_bandwidth")["dp.bus_bandwidth"].status == "passed"


def test_a_stray_notebook_in_a_folder_is_skipped_not_fatal(tmp_path):
    (tmp_path / "Untitled.ipynb").write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    (tmp_path / "dp.ipynb").write_bytes(solution_path("dp").read_bytes())
    completed = grader_cli(tmp_path, "--only", "dp.ring_time")
    assert completed.returncode == 0
    assert "total 1/1" in completed.stdout
    assert completed.stderr.strip().startswith("grader: skipped") and "Untitled.ipynb" in completed.stderr
    (tmp_path / "dp.ipynb").unlink()
    assert_one_line_error(grader_cli(tmp_path), "no course notebook")


def test_only_ids_of_another_chapter(tmp_path):
    assert_one_line_error(grader_cli(solution_path("dp"), "--only", "memory.param_count"), "none of the --only exercises")
    for chapter in ("dp", "memory"):
        (tmp_path / f"{chapter}.ipynb").write_bytes(solution_path(chapter).read_bytes())
    completed = grader_cli(tmp_path, "--only", "memory.interview")
    assert completed.returncode == 0 and "total 2/2" in completed.stdout
    assert "skipped" in completed.stderr and "dp.ipynb" in completed.stderr


def test_killing_the_grader_outright_still_ends_its_sandboxes_and_ranks(tmp_notebook):
    """SIGKILL leaves the grader no chance to clean up: the kernel ends the children for it."""
    path = tmp_notebook("dp", {"ring_all_reduce": "def ring_all_reduce(tensor):\n    while True:\n        pass\n"})
    marker = uuid.uuid4().hex
    # A time limit far beyond the test's: the grading can only end by the SIGINT.
    grader = subprocess.Popen([sys.executable, "-m", "grader", str(path), "--only", "dp.ring_allreduce_gloo",
                               "--timeout", "3600"], cwd=REPO, env={**os.environ, "DTP_TEST_MARKER": marker},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(live_processes_with_marker(marker)) < 4 and time.monotonic() < deadline:  # grader, sandbox, 2 ranks
        time.sleep(0.2)
    assert len(live_processes_with_marker(marker)) >= 4
    grader.kill()
    grader.wait()
    deadline = time.monotonic() + 10
    while live_processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_processes_with_marker(marker) == []
    # The warden outlives its grader just long enough to remove the scratch folder too.
    deadline = time.monotonic() + 10
    while scratch_folders_of(grader.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert scratch_folders_of(grader.pid) == []


def scratch_folders_of(pid: int) -> list[str]:
    return [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(f"dtp-sandbox-{pid}-")]


def test_the_next_grader_removes_the_scratch_folder_of_one_killed_with_its_warden():
    """If grader and warden are both killed outright, nothing of theirs runs any clean-up: the
    next grader sweeps the folders whose grader is gone."""
    leftover = os.path.join(tempfile.gettempdir(), "dtp-sandbox-4999999-x")  # above Linux's largest pid
    os.makedirs(leftover)
    assert grade(solution_path("dp"), "dp.ring_time")["dp.ring_time"].status == "passed"
    assert not os.path.exists(leftover)


def test_an_allocation_beyond_the_memory_cap_is_reported_not_fatal(tmp_notebook):
    """40 GiB, more than this machine has: the exercise gets one clear line, the next is graded."""
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "import numpy as np\n"
        "def ring_allreduce_time(n, size_bytes, alpha_s, bandwidth_bytes_per_s):\n"
        "    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * size_bytes / bandwidth_bytes_per_s\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    hoard = np.ones(5 * 2**30)  # 40 GiB of float64\n"
        "    return size_bytes / time_s * 2 * (n - 1) / n\n")})
    results = grade(path, "dp.bus_bandwidth", RING_TIME_OK)
    assert results["dp.bus_bandwidth"].status == "error"
    assert "ran out of memory" in results["dp.bus_bandwidth"].feedback and "GiB per process" in results["dp.bus_bandwidth"].feedback
    assert results[RING_TIME_OK].status == "passed"


def test_without_landlock_grading_runs_as_before_and_the_report_says_so_once(tmp_path, monkeypatch, capsys):
    """macOS, an old kernel: the sandbox runs unconfined (the in-process guard still refuses the
    course's references), and the table and the JSON say so, once."""
    import signal as signals

    from grader import cli, landlock

    monkeypatch.setattr(landlock, "abi_version", lambda: 0)
    report = tmp_path / "report.json"
    handler = signals.getsignal(signals.SIGTERM)
    try:
        code = cli.main([str(solution_path("dp")), "--only", RING_TIME_OK, "--json", str(report)])
    finally:
        signals.signal(signals.SIGTERM, handler)
    out = capsys.readouterr().out
    assert code == 0 and "total 1/1" in out
    assert out.count("no Landlock") == 1
    written = json.loads(report.read_text())
    assert set(written) == {"notebooks", "unconfined"} and "no Landlock" in written["unconfined"]
    assert written["notebooks"][0]["score"] == 1
