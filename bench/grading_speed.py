"""How long grading a chapter takes, next to simply running its solution notebook.

    python bench/grading_speed.py [--repeats 3] [NOTEBOOK...]

Prints, per notebook, the median over repeats of (a) `python -m grader NOTEBOOK` end to end,
(b) executing the notebook top to bottom with nbclient, and their ratio. Timings on a shared
machine are noisy: compare the ratio, and rerun before believing a change of a few percent.
"""
from __future__ import annotations

import argparse
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
             "07_topology.ipynb": 20.0}


def time_grading(path: Path) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "grader", str(path)], cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


def time_execution(path: Path) -> float:
    notebook = nbformat.read(path, as_version=4)
    started = time.perf_counter()
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    notebooks = args.notebooks or sorted((REPO / "solutions").glob("*.ipynb"))
    print(f"{'notebook':<28} {'grade (s)':>10} {'execute (s)':>12} {'ratio':>7} {'target':>8}")
    for path in notebooks:
        grading = statistics.median(time_grading(path) for _ in range(args.repeats))
        execution = statistics.median(time_execution(path) for _ in range(args.repeats))
        target = TARGETS_S.get(path.name)
        verdict = "" if target is None else f"< {target:g} s {'met' if grading < target else 'MISSED'}"
        print(f"{path.name:<28} {grading:>10.2f} {execution:>12.2f} {grading / execution:>7.2f} {verdict:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
