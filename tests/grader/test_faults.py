"""The fault matrix of the README: what learner code can do wrong, and what it gets. Each fault
costs only its exercise, with one clear line; the other exercises are still graded; no process,
port or temporary file is left; the learner's files are unchanged."""
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import uuid


from conftest import REPO, grade, grader_cli, live_processes_with_marker, solution_path

OTHER = "dp.ring_time"  # graded after the faulty exercise, to show the rest still is
COSTS_CELL = ("def ring_allreduce_time(n, size_bytes, alpha_s, bandwidth_bytes_per_s):\n"
              "    return 2 * (n - 1) * alpha_s + 2 * (n - 1) / n * size_bytes / bandwidth_bytes_per_s\n")
RIGHT = "    return size_bytes / time_s * 2 * (n - 1) / n\n"


def bus_bandwidth_doing(body: str, imports: str = "") -> dict:
    return {"bus_bandwidth": imports + COSTS_CELL + "def bus_bandwidth(size_bytes, time_s, n):\n" + body + RIGHT}


def graded_with_marker(path, *exercises):
    marker = uuid.uuid4().hex
    completed = grader_cli(path, "--only", *exercises, "--json", path.with_suffix(".json"), marker=marker)
    report = json.loads(path.with_suffix(".json").read_text())["notebooks"][0]
    return completed, {e["id"]: e for e in report["exercises"]}, marker


def test_forked_children_and_running_threads_end_with_the_exercise(tmp_notebook):
    path = tmp_notebook("dp", bus_bandwidth_doing(
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    threading.Thread(target=time.sleep, args=(60,)).start()\n",
        imports="import os, threading, time\n"))
    completed, results, marker = graded_with_marker(path, "dp.bus_bandwidth", OTHER)
    assert results["dp.bus_bandwidth"]["status"] == "passed" and results[OTHER]["status"] == "passed"
    time.sleep(0.5)
    assert live_processes_with_marker(marker) == []


def test_megabytes_of_printing_go_nowhere(tmp_notebook):
    path = tmp_notebook("dp", bus_bandwidth_doing("    print('x' * 50_000_000)\n    sys.stderr.write('y' * 10_000_000)\n",
                                                  imports="import sys\n"))
    completed, results, _ = graded_with_marker(path, "dp.bus_bandwidth", OTHER)
    assert results["dp.bus_bandwidth"]["status"] == "passed"
    assert len(completed.stdout) < 5000 and "xxxxx" not in completed.stdout and "yyyyy" not in completed.stderr


def test_filling_the_disk_stops_at_the_file_size_limit(tmp_notebook, monkeypatch):
    import grader.sandbox
    monkeypatch.setattr(grader.sandbox, "LARGEST_FILE_BYTES", 8 * 2**20)  # the sandbox forks from this process
    path = tmp_notebook("dp", bus_bandwidth_doing(
        "    with tempfile.NamedTemporaryFile() as f:\n"
        "        for _ in range(64):\n"
        "            f.write(b'z' * 2**20)\n", imports="import tempfile\n"))
    results = grade(path, "dp.bus_bandwidth", OTHER)
    assert results["dp.bus_bandwidth"].status == "error" and "File too large" in results["dp.bus_bandwidth"].feedback
    assert results[OTHER].status == "passed"


def test_a_port_held_by_learner_code_is_freed_for_the_next_world(tmp_notebook):
    path = tmp_notebook("dp", {"ring_all_reduce": (
        "import socket\n"
        "HELD = []\n"
        "def ring_all_reduce(tensor):\n"
        "    listener = socket.socket()\n"
        "    listener.bind(('127.0.0.1', 0))\n"
        "    listener.listen()\n"
        "    HELD.append(listener)\n"
        "    raise RuntimeError(f'holding port {listener.getsockname()[1]}')\n")})
    completed, results, marker = graded_with_marker(path, "dp.ring_allreduce_gloo", "dp.ddp_by_hand")
    assert results["dp.ring_allreduce_gloo"]["status"] == "error"
    assert results["dp.ddp_by_hand"]["status"] == "passed"  # its gloo worlds found free ports
    port = int(results["dp.ring_allreduce_gloo"]["feedback"].split("holding port ")[1].split()[0].rstrip(")."))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # nobody holds it any more
    assert live_processes_with_marker(marker) == []


def test_a_folder_with_a_broken_notebook_and_two_copies_of_a_chapter(tmp_path):
    (tmp_path / "broken.ipynb").write_text("{ not json")
    for copy in ("a", "b"):
        (tmp_path / f"dp_{copy}.ipynb").write_bytes(solution_path("dp").read_bytes())
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    completed = grader_cli(tmp_path, "--only", OTHER)
    assert completed.returncode == 0
    assert completed.stdout.count("total 1/1") == 2 and "total 2/2" in completed.stdout
    assert "skipped" in completed.stderr and "broken.ipynb" in completed.stderr
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()} == before


def test_many_graders_at_once(tmp_path):
    markers = [uuid.uuid4().hex for _ in range(4)]
    graders = [subprocess.Popen([sys.executable, "-m", "grader", str(solution_path("dp")), "--only",
                                 "dp.ring_allreduce_gloo", OTHER, "--json", str(tmp_path / f"{i}.json")],
                                cwd=REPO, env={**os.environ, "DTP_TEST_MARKER": marker},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
               for i, marker in enumerate(markers)]
    for grader in graders:
        grader.wait(timeout=300)
        assert grader.returncode == 0, grader.stderr.read()
    for i in range(4):
        notebook = json.loads((tmp_path / f"{i}.json").read_text())["notebooks"][0]
        assert notebook["score"] == notebook["max_score"] == 3, notebook["exercises"]
    time.sleep(0.5)
    assert all(live_processes_with_marker(marker) == [] for marker in markers)
