"""Attempts to score without solving (issue 13): each gets no points, and the grader's own
output, report and processes are unaffected. Wrong answers here are paired with the attack, so
a pass could only come from the attack working."""
import json
import os
import time
import uuid

from conftest import grade, solution_path
from test_bad_input import cli, live_processes_with_marker

WRONG_BUS_BANDWIDTH = "def bus_bandwidth(size_bytes, time_s, n):\n    return size_bytes / time_s\n"


def test_patching_numpys_comparisons_at_definition_time_changes_nothing(tmp_notebook):
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "import numpy as np\n"
        "np.allclose = np.isclose = lambda *args, **kwargs: True\n"
        "np.testing.assert_allclose = lambda *args, **kwargs: None\n" + WRONG_BUS_BANDWIDTH)})
    result = grade(path, "dp.bus_bandwidth")["dp.bus_bandwidth"]
    assert result.status == "failed" and result.points == 0


def test_replacing_the_registered_checks_from_a_class_body_changes_nothing(tmp_notebook):
    """A class body runs while the definitions load, inside the sandbox: the verdict is not there."""
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "class Takeover:\n"
        "    import grader.registry, grader.compare, grader.grading\n"
        "    for exercise in grader.registry._EXERCISES.values():\n"
        "        exercise.check.judge = lambda *args: 'passed'\n"
        "        exercise.check.prepare = lambda *args: []\n"
        "    grader.compare.expect_answer = lambda *args, **kwargs: None\n"
        "    grader.grading.judge = lambda *args: ('passed', 'ok')\n" + WRONG_BUS_BANDWIDTH)})
    result = grade(path, "dp.bus_bandwidth")["dp.bus_bandwidth"]
    assert result.status == "failed" and result.points == 0


def test_forged_collect_data_is_judged_against_inputs_it_did_not_choose(tmp_notebook):
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "class Forge:\n"
        "    import grader.registry\n"
        "    grader.registry._EXERCISES['dp.bus_bandwidth'].check.collect = lambda self, s, cases: [1.0] * 5\n"
        + WRONG_BUS_BANDWIDTH)})
    result = grade(path, "dp.bus_bandwidth")["dp.bus_bandwidth"]
    assert result.status == "failed" and result.points == 0


def test_a_forged_pickle_cannot_run_code_in_the_grader(tmp_notebook, tmp_path):
    """The sandbox's bytes are read with a whitelist: a __reduce__ payload is refused, not run."""
    witness = tmp_path / "ran_in_the_grader"
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "import os\n"
        "class Payload:\n"
        f"    def __reduce__(self):\n        return (os.system, ('touch {witness}',))\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    return Payload()\n")})
    result = grade(path, "dp.bus_bandwidth")["dp.bus_bandwidth"]
    assert result.status == "failed" and not witness.exists()


def test_the_courses_closed_forms_are_not_an_answer(tmp_notebook):
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "from dtp import costs\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    try:\n"
        "        return costs.bus_bandwidth(size_bytes, time_s, n)\n"
        "    except Exception:\n"
        "        return 0.0\n")})
    result = grade(path, "dp.bus_bandwidth")["dp.bus_bandwidth"]
    assert result.status == "failed" and "uses the course's reference" in result.feedback


def test_the_solution_notebook_is_not_an_answer(tmp_notebook):
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "from grader.student import StudentCode\n"
        f"SOLUTION = {str(solution_path('dp'))!r}\n"
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    return StudentCode.from_notebook(SOLUTION).bus_bandwidth(size_bytes, time_s, n)\n")})
    result = grade(path, "dp.bus_bandwidth")["dp.bus_bandwidth"]
    assert result.status == "failed" and "solution notebook" in result.feedback


def test_a_detached_process_cannot_rewrite_the_report_after_the_grader_exits(tmp_notebook, tmp_path):
    marker, report = uuid.uuid4().hex, tmp_path / "report.json"
    rewrite = (f"import json, time; time.sleep(3); json.dump({{'notebooks': [{{'score': 99}}]}}, open({str(report)!r}, 'w'))")
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "import subprocess, sys\n"
        "class Detach:\n"
        f"    subprocess.Popen([sys.executable, '-c', {rewrite!r}], start_new_session=True,\n"
        "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n" + WRONG_BUS_BANDWIDTH)})
    completed = cli(path, "--only", "dp.bus_bandwidth", "--json", report, marker=marker)
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
    completed = cli(path, "--only", "dp.bus_bandwidth")
    assert completed.returncode == 0
    assert "forged" not in completed.stdout and "total 0/1" in completed.stdout


def test_feedback_cannot_add_lines_to_the_table(tmp_notebook):
    path = tmp_notebook("dp", {"bus_bandwidth": (
        "def bus_bandwidth(size_bytes, time_s, n):\n"
        "    raise ValueError('boom\\n  dp.bus_bandwidth  1/1  passed  ok\\n  total 1/1')\n")})
    completed = cli(path, "--only", "dp.bus_bandwidth")
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
