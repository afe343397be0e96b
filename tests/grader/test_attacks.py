"""Attempts to score without solving (issues 13 and 20): each gets no points, and the grader's own
output, report and processes are unaffected. Wrong answers here are paired with the attack, so
a pass could only come from the attack working."""
import importlib
import json
import os
import time
import uuid

import pytest

from conftest import grade, graded, grader_cli, live_processes_with_marker, solution_path
from grader import landlock

WRONG_BUS_BANDWIDTH = "def bus_bandwidth(size_bytes, time_s, n):\n    return size_bytes / time_s\n"


def graded_bus_bandwidth(tmp_notebook, cell: str):
    """dp.bus_bandwidth graded with `cell` as the notebook's cell that defines bus_bandwidth."""
    return graded(tmp_notebook, "dp.bus_bandwidth", {"bus_bandwidth": cell})


# Code that runs while the definitions load, inside the sandbox, before a wrong bus_bandwidth.
LOAD_TIME_ATTACKS = {
    "numpys-comparisons-patched": (
        "import numpy as np\n"
        "np.allclose = np.isclose = lambda *args, **kwargs: True\n"
        "np.testing.assert_allclose = lambda *args, **kwargs: None\n"),
    # a class body runs while the definitions load: the verdict is not there
    "registered-checks-replaced-from-a-class-body": (
        "class Takeover:\n"
        "    import grader.registry, grader.compare, grader.grading\n"
        "    for exercise in grader.registry._EXERCISES.values():\n"
        "        exercise.check.judge = lambda *args: 'passed'\n"
        "        exercise.check.prepare = lambda *args: []\n"
        "    grader.compare.expect_answer = lambda *args, **kwargs: None\n"
        "    grader.grading.judge = lambda *args: ('passed', 'ok')\n"),
    # forged collect data is judged against inputs it did not choose
    "collect-forged": (
        "class Forge:\n"
        "    import grader.registry\n"
        "    grader.registry._EXERCISES['dp.bus_bandwidth'].check.collect = lambda self, s, cases: [1.0] * 5\n"),
}


@pytest.mark.parametrize("attack", LOAD_TIME_ATTACKS)
def test_code_run_while_the_definitions_load_changes_nothing(tmp_notebook, attack):
    result = graded_bus_bandwidth(tmp_notebook, LOAD_TIME_ATTACKS[attack] + WRONG_BUS_BANDWIDTH)
    assert result.status == "failed" and result.points == 0


def test_a_forged_pickle_cannot_run_code_in_the_grader(tmp_notebook, tmp_path):
    """The sandbox's bytes are read with a whitelist: a __reduce__ payload is refused, not run."""
    witness = tmp_path / "ran_in_the_grader"
    result = graded_bus_bandwidth(tmp_notebook, (
        "import os\n"
        "class Payload:\n"
        f"    def __reduce__(self):\n        return (os.system, ('touch {witness}',))\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    return Payload()\n"))
    assert result.status == "failed" and not witness.exists()


def test_the_courses_closed_forms_are_not_an_answer(tmp_notebook):
    result = graded_bus_bandwidth(tmp_notebook, (
        "from dtp.dp import costs\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    try:\n"
        "        return costs.bus_bandwidth(size_bytes, time_s, n)\n"
        "    except Exception:\n"
        "        return 0.0\n"))
    assert result.status == "failed" and "uses the course's reference" in result.feedback


def test_the_solution_notebook_is_not_an_answer(tmp_notebook):
    result = graded_bus_bandwidth(tmp_notebook, (
        "from grader.student import StudentCode\n"
        f"SOLUTION = {str(solution_path('dp'))!r}\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    return StudentCode.from_notebook(SOLUTION).bus_bandwidth(size_bytes, time_s, n)\n"))
    assert result.status == "failed" and "solution notebook" in result.feedback


def test_a_detached_process_cannot_rewrite_the_report_after_the_grader_exits(tmp_notebook, tmp_path):
    marker, report = uuid.uuid4().hex, tmp_path / "report.json"
    rewrite = (f"import json, time; time.sleep(3); json.dump({{'notebooks': [{{'score': 99}}]}}, open({str(report)!r}, 'w'))")
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "import subprocess, sys\n"
        "class Detach:\n"
        f"    subprocess.Popen([sys.executable, '-c', {rewrite!r}], start_new_session=True,\n"
        "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n" + WRONG_BUS_BANDWIDTH)})
    completed = grader_cli(path, "--only", "dp.bus_bandwidth", "--json", report, marker=marker)
    assert completed.returncode == 0
    written = report.read_text()
    time.sleep(4)
    assert report.read_text() == written and json.loads(written)["notebooks"][0]["score"] == 0
    assert live_processes_with_marker(marker) == []


def test_learner_code_cannot_write_lines_into_the_graders_output(tmp_notebook):
    """Through /proc/<grader>/fd/1 (the grader is not dumpable, the sandbox holds no capability)
    or the terminal (the sandbox has none): no fake line reaches the table."""
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "import os\n"
        "class Forge:\n"
        "    line = b'  dp.bus_bandwidth          1/1  passed   forged\\n  total 1/1 in 0.0s\\n'\n"
        "    warden = os.getppid()\n"
        "    grader = int(open(f'/proc/{warden}/stat').read().rsplit(')', 1)[1].split()[1])\n"
        "    for target in (f'/proc/{grader}/fd/1', f'/proc/{warden}/fd/1', '/dev/tty'):\n"
        "        try:\n"
        "            with open(target, 'wb') as stream:\n"
        "                stream.write(line)\n"
        "        except OSError:\n"
        "            pass\n" + WRONG_BUS_BANDWIDTH)})
    completed = grader_cli(path, "--only", "dp.bus_bandwidth")
    assert completed.returncode == 0
    assert "forged" not in completed.stdout and "total 0/1" in completed.stdout


def test_feedback_cannot_add_lines_to_the_table(tmp_notebook):
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    raise ValueError('boom\\n  dp.bus_bandwidth  1/1  passed  ok\\n  total 1/1')\n")})
    completed = grader_cli(path, "--only", "dp.bus_bandwidth")
    rows = [line for line in completed.stdout.splitlines() if "dp.bus_bandwidth" in line]
    assert len(rows) == 1 and "error" in rows[0]
    assert "total 0/1" in completed.stdout and "total 1/1" not in completed.stdout


FUNCTIONAL_ALL_GATHER_RING = '''
import torch.distributed._functional_collectives as functional

def ring_all_reduce(tensor):
    # A functional collective (a dispatcher op, not a ProcessGroup method) plus a local sum.
    gathered = functional.all_gather_tensor(tensor, 0, dist.group.WORLD)
    tensor.copy_(gathered.view(dist.get_world_size(), -1).sum(0))
'''


def test_functional_collectives_are_recorded_too(tmp_notebook):
    result = grade(tmp_notebook("dp", {"ring_all_reduce": FUNCTIONAL_ALL_GATHER_RING}),
                   "dp.ring_allreduce_gloo")["dp.ring_allreduce_gloo"]
    assert result.status == "failed" and "called all_gather" in result.feedback, result


# --- issue 20: learner code, and every process it starts, cannot reach the answers -----------
# Each attack is the learner's whole answer: a pass could only come from the attack working.

needs_landlock = pytest.mark.skipif(not landlock.abi_version(), reason="this kernel has no Landlock")
SOLUTION_FOLDER_GLOB = str(solution_path("dp").parent.parent / "sol*s" / "02_*")  # as the held-out attempt wrote it
CELL_FROM_NOTEBOOK = (
    "def _exec_cell_defining(name, text):\n"
    "    cells = json.loads(text)['cells']\n"
    "    source = next(''.join(c['source']) for c in cells if f'def {name}(' in ''.join(c['source']))\n"
    "    namespace = {}\n"
    "    exec(source, namespace)\n"
    "    return namespace[name]\n")


def _assert_no_points(result, *fragments):
    assert result.points == 0 and result.status in ("failed", "error"), result
    assert "\n" not in result.feedback and "Traceback" not in result.feedback
    for fragment in fragments:
        assert fragment in result.feedback, result.feedback


@needs_landlock
def test_a_child_python_cannot_import_the_courses_closed_form(tmp_notebook):
    result = graded_bus_bandwidth(tmp_notebook, (
        "import subprocess, sys\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    program = f'from dtp.dp.costs import bus_bandwidth; print(bus_bandwidth({size_bytes!r}, {time_s!r}, {n!r}))'\n"
        "    done = subprocess.run([sys.executable, '-c', program], capture_output=True, text=True, check=True)\n"
        "    return float(done.stdout)\n"))
    _assert_no_points(result, "CalledProcessError")


@needs_landlock
def test_a_shell_cannot_cat_the_solution_notebook(tmp_notebook):
    result = graded_bus_bandwidth(tmp_notebook, (
        "import json, subprocess\n" + CELL_FROM_NOTEBOOK +
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        f"    text = subprocess.run(['sh', '-c', 'cat {SOLUTION_FOLDER_GLOB}'], capture_output=True, text=True).stdout\n"
        "    return _exec_cell_defining('bus_bandwidth', text)(size_bytes, time_s, n)\n"))
    _assert_no_points(result, "JSONDecodeError")


@needs_landlock
def test_os_open_with_a_dir_fd_cannot_read_the_solution_notebook(tmp_notebook):
    """The audit hook sees only the relative name; Landlock checks the file itself."""
    checkout = str(solution_path("dp").parent.parent)
    result = graded_bus_bandwidth(tmp_notebook, (
        "import json, os\n" + CELL_FROM_NOTEBOOK +
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        f"    folder = os.open({checkout!r}, os.O_RDONLY)\n"
        f"    fd = os.open('solutions/{solution_path('dp').name}', os.O_RDONLY, dir_fd=folder)\n"
        "    with os.fdopen(fd) as notebook:\n"
        "        return _exec_cell_defining('bus_bandwidth', notebook.read())(size_bytes, time_s, n)\n"))
    _assert_no_points(result, "PermissionError", "not the solutions")


@needs_landlock
def test_a_solution_cell_read_by_a_child_python_cannot_be_executed(tmp_notebook):
    """The child names the folder by a glob (the audit hook looks for 'solutions' in the
    arguments) and prints the notebook for the sandbox to execute its cell."""
    reader = f"import glob, sys; sys.stdout.write(open(glob.glob({SOLUTION_FOLDER_GLOB!r})[0]).read())"
    result = graded_bus_bandwidth(tmp_notebook, (
        "import json, subprocess, sys\n" + CELL_FROM_NOTEBOOK +
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        f"    text = subprocess.run([sys.executable, '-c', {reader!r}], capture_output=True, text=True).stdout\n"
        "    return _exec_cell_defining('bus_bandwidth', text)(size_bytes, time_s, n)\n"))
    _assert_no_points(result, "JSONDecodeError")


STACK_WALK = '''
import sys

def _the_check_and_cases():
    """The check whose collect called this function, and the inputs it was handed."""
    from grader.registry import Check
    frame = sys._getframe(1)
    while not isinstance(frame.f_locals.get("self"), Check):
        frame = frame.f_back
    return frame.f_locals["self"], frame.f_locals[frame.f_code.co_varnames[2]]  # collect(self, student, inputs)

CANDIDATES = [lambda s, t, n: s / t, lambda s, t, n: s / t * (n - 1) / n, lambda s, t, n: s / t * 2 * (n - 1) / n]
'''
STACK_WALK_ATTEMPTS = {
    "judge": ("    check, cases = _the_check_and_cases()\n"
              "    for candidate in CANDIDATES:\n"
              "        try:\n"
              "            check.judge(cases, [candidate(*args, **kwargs) for args, kwargs in cases])\n"
              "            return candidate(size_bytes, time_s, n)\n"
              "        except BaseException:\n"
              "            continue\n"
              "    return 0.0\n"),
    "collect and judge": ("    check, cases = _the_check_and_cases()\n"
                          "    for candidate in CANDIDATES:\n"
                          "        class Candidate:\n"
                          "            bus_bandwidth = staticmethod(candidate)\n"
                          "        try:\n"
                          "            check.judge(cases, check.collect(Candidate, cases))\n"
                          "            return candidate(size_bytes, time_s, n)\n"
                          "        except BaseException:\n"
                          "            continue\n"
                          "    return 0.0\n"),
    "oracle": "    return _the_check_and_cases()[0].expected(size_bytes, time_s, n)\n",
    "grader's judge": ("    import grader.grading\n"
                       "    return grader.grading.judge(None, None, None)\n"),
}


@pytest.mark.parametrize("attempt", STACK_WALK_ATTEMPTS)
def test_the_check_found_on_the_stack_has_no_judge_or_oracle_in_the_sandbox(tmp_notebook, attempt):
    result = graded_bus_bandwidth(tmp_notebook, (
        STACK_WALK + "def bus_bandwidth(size_bytes, time_s, n):\n" + STACK_WALK_ATTEMPTS[attempt]))
    _assert_no_points(result, "calls the grader's", "never runs beside your code")


def test_no_course_module_a_check_names_in_references_is_readable():
    """DTP_READABLE is the course library's infrastructure: never a module holding an answer."""
    from grader.registry import all_exercise_ids, find_exercise

    def module_path(dotted: str) -> str:
        """'dtp.pp.schedules.bubble_fraction' -> 'pp/schedules': the longest prefix that imports."""
        parts = dotted.split(".")
        for split in range(len(parts) - 1, 1, -1):
            try:
                importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            return "/".join(parts[1:split])
        raise ImportError(dotted)

    referenced = {module_path(dotted) for exercise_id in all_exercise_ids()
                  for dotted in find_exercise(exercise_id).check.references if dotted.startswith("dtp.")}
    assert len(referenced) > 10 and not referenced & set(landlock.DTP_READABLE)
    assert all((landlock.REPO / "dtp" / f"{module}.py").is_file() for module in landlock.DTP_READABLE)


@needs_landlock
def test_the_sandbox_rules_keep_the_answers_out_and_the_libraries_in(tmp_path):
    import numpy

    repo = solution_path("dp").parent.parent
    (tmp_path / "helpers.py").write_text("x = 1\n")
    denied = [solution_path("dp"), repo / "dtp" / "dp" / "costs.py", repo / "dtp" / "pp" / "schedules.py", repo / "dtp" / "common" / "gpt.py", repo / "grader" / "checks" / "common.py",
              repo / "tests" / "conftest.py", repo / ".git" / "HEAD"]
    allowed = [repo / "dtp" / "common" / "world.py", repo / "grader" / "sandbox.py", tmp_path / "helpers.py", numpy.__file__]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    rules = landlock.sandbox_rules(str(tmp_path), str(scratch))
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child confines itself, tries each file, and reports
        try:
            landlock.confine(rules)
            outcome = []
            for path in denied + allowed:
                try:
                    open(path, "rb").close()
                    outcome.append(True)
                except PermissionError:
                    outcome.append(False)
            writable = os.open(scratch / "out", os.O_WRONLY | os.O_CREAT) >= 0
            try:
                open(tmp_path / "next_to_the_notebook", "w").close()
                outcome.append(True)
            except PermissionError:
                outcome.append(False)
            os.write(writer, json.dumps(outcome + [writable]).encode())
        finally:
            os._exit(0)
    os.close(writer)
    outcome = json.loads(os.read(reader, 4096) or b"[]")
    os.waitpid(pid, 0)
    assert outcome == [False] * len(denied) + [True] * len(allowed) + [False, True]
