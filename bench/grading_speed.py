"""How fast the grader answers, next to simply running the notebooks.

    python bench/grading_speed.py [--repeats 3] [--spinners K] [--output book/appendix/grading.json] [NOTEBOOK...]

For each solution notebook (median over repeats, grading and executing measured in turn so that
both see the same load):
- `python -m grader NOTEBOOK` end to end, and executing the notebook top to bottom with nbclient,
  and their ratio (target: grading takes no longer than executing, idle or with `--spinners K`
  CPU-bound processes running beside it, the load of a busy laptop or CI machine);
- every exercise's in-notebook `check(...)`, timed in a process that holds the notebook's
  definitions as a kernel would (target: under 2 s each);
and for the whole course: grading every notebook in one CLI call (target: under 60 s), and the
CLI's start-up: the time `python -m grader` takes to report an unusable input (it stops before
grading), and to import what grading needs. Timings on a shared machine are noisy: compare the
ratios, and rerun before believing a change of a few percent.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parent.parent
# Grading targets on the course's 2-core machine, from the course's issues.
TARGETS_S = {"01_memory.ipynb": 10.0, "02_data_parallel.ipynb": 15.0, "03_tensor_parallel.ipynb": 15.0,
             "04_pipeline_parallel.ipynb": 15.0, "05_expert_parallel.ipynb": 15.0, "06_zero.ipynb": 20.0,
             "07_overlap.ipynb": 20.0, "08_context_parallel.ipynb": 20.0, "09_topology.ipynb": 20.0}
CHECK_TARGET_S, COURSE_TARGET_S, START_TARGET_S = 2.0, 60.0, 1.0
RATIO_TARGET = 1.0  # grading / executing the same notebook

# Times every check of one notebook in this child process, as a kernel with the notebook's
# definitions would: prints {exercise id: seconds} as JSON.
_CHECK_TIMER = """
import contextlib, io, json, sys, time
sys.path.insert(0, {repo!r})
from grader import check
from grader.notebook import extract_definitions, read_notebook
from grader.registry import chapter_exercises
notebook = read_notebook({path!r})
chapter = notebook.metadata["dtp"]["chapter"]
exercises = chapter_exercises(chapter)
definitions = extract_definitions(notebook, {{name for e in exercises for name in e.reads}})
import __main__
for statement in definitions.statements:
    exec(statement.compile(), vars(__main__))
times = {{}}
for exercise in exercises:
    samples = []
    for _ in range({repeats}):
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            check(exercise.id)
        samples.append(time.perf_counter() - started)
    times[exercise.id] = sorted(samples)[len(samples) // 2]
print(json.dumps(times))
"""


def _run(*args: str) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=REPO, check=False, capture_output=True)
    return time.perf_counter() - started


def time_grading(path: Path) -> float:
    return _run("-m", "grader", str(path))


def time_execution(path: Path) -> float:
    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    NotebookClient(notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return time.perf_counter() - started


def time_checks(path: Path, repeats: int) -> dict[str, float]:
    completed = subprocess.run([sys.executable, "-c", _CHECK_TIMER.format(repo=str(REPO), path=str(path), repeats=repeats)],
                               cwd=path.parent, capture_output=True, text=True, check=True)
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spinners", type=int, default=0, help="CPU-bound processes to run beside the measurements")
    parser.add_argument("--output", type=Path, help="also write the results as JSON (the book's appendix reads it)")
    args = parser.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.spinners)]
    try:
        return measure(args)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def measure(args) -> int:
    notebooks = [path.resolve() for path in args.notebooks] or sorted((REPO / "solutions").glob("*.ipynb"))
    median = lambda measure: statistics.median(measure() for _ in range(args.repeats))  # noqa: E731
    results = {"notebooks": [], "targets": {"notebook_s": TARGETS_S, "check_s": CHECK_TARGET_S,
                                            "course_s": COURSE_TARGET_S, "start_s": START_TARGET_S, "ratio": RATIO_TARGET}}
    results["spinners"] = args.spinners
    print(f"with {args.spinners} spinning process(es) beside it")
    print(f"{'notebook':<28} {'grade (s)':>10} {'execute (s)':>12} {'ratio':>7} {'target':>12} {'slowest check':>24}")
    for path in notebooks:
        pairs = [(time_grading(path), time_execution(path)) for _ in range(args.repeats)]  # in turn: the same load
        grading, execution = statistics.median(g for g, _ in pairs), statistics.median(e for _, e in pairs)
        ratio = statistics.median(g / e for g, e in pairs)
        checks = time_checks(path, args.repeats)
        slowest = max(checks, key=checks.get)
        verdict = f"<= {RATIO_TARGET:g} {'met' if ratio <= RATIO_TARGET else 'MISSED'}"
        print(f"{path.name:<28} {grading:>10.2f} {execution:>12.2f} {ratio:>7.2f} {verdict:>12} "
              f"{slowest + f' {checks[slowest]:.2f} s':>24}", flush=True)
        results["notebooks"].append({"notebook": path.name, "grading_s": grading, "execution_s": execution,
                                     "ratio": ratio, "checks_s": checks})
    course = median(lambda: _run("-m", "grader", str(REPO / "solutions")))
    unusable = median(lambda: _run("-m", "grader", str(REPO / "no-such-notebook.ipynb")))
    imports = median(lambda: _run("-c", "import grader.grading"))
    results.update({"course_grading_s": course, "unusable_input_s": unusable, "grading_imports_s": imports})
    print(f"whole course: {course:.2f} s (target < {COURSE_TARGET_S:g} s); an unusable input is reported in "
          f"{unusable:.2f} s; importing what grading needs takes {imports:.2f} s")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
