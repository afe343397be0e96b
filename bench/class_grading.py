"""How fast a class is graded: `python -m grader class` against grading its notebooks one by one.

    python bench/class_grading.py [--students 24] [--jobs N] [--output FILE.json]

Generates a class of memory-chapter notebooks (the chapter's solution, a partly solved copy that
forgets the position embeddings, and the untouched exercise notebook, in turn; one folder per
student) in a temporary folder, then times, end to end and in notebooks per minute:
- `python -m grader class SUBMISSIONS --out RESULTS --chapters memory --jobs N` on a fresh RESULTS
  (grading, then the gradebook and the summary with its chart);
- the same command again, with nothing changed (every result comes from the cache: what remains
  is reading the class, the gradebook and the summary);
- one `python -m grader NOTEBOOK` per notebook, one after the other (what a shell loop does);
- one `python -m grader NOTEBOOK...` call with every notebook (one process, one at a time).
Timings on a shared machine are noisy; the ratios say more than the seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

REPO = Path(__file__).resolve().parent.parent
SOLUTION, HANDOUT = REPO / "solutions" / "01_memory.ipynb", REPO / "notebooks" / "01_memory.ipynb"
RIGHT_EMBEDDINGS = "embeddings = (config.vocab_size + config.n_positions) * h"


def generate_class(folder: Path, students: int) -> list[Path]:
    solution = nbformat.read(SOLUTION, as_version=4)
    partly = nbformat.read(SOLUTION, as_version=4)
    for cell in partly.cells:
        if cell.cell_type == "code" and RIGHT_EMBEDDINGS in cell.source:
            cell.source = cell.source.replace(RIGHT_EMBEDDINGS, "embeddings = config.vocab_size * h")
    paths = []
    for number in range(students):
        path = folder / f"student{number:02d}" / SOLUTION.name
        path.parent.mkdir(parents=True)
        if number % 3 == 2:
            shutil.copy(HANDOUT, path)
        else:
            nbformat.write(solution if number % 3 == 0 else partly, path)
        paths.append(path)
    return paths


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=24)
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--output", help="also write the figures as JSON here")
    args = parser.parse_args()
    grader = [sys.executable, "-m", "grader"]
    with tempfile.TemporaryDirectory(prefix="dtp-class-bench-") as scratch:
        submissions, results = Path(scratch) / "submissions", Path(scratch) / "results"
        notebooks = generate_class(submissions, args.students)
        seconds = {"class": timed([*grader, "class", str(submissions), "--out", str(results), "--chapters", "memory",
                                   "--jobs", str(args.jobs)])}
        seconds["class, rerun unchanged"] = timed([*grader, "class", str(submissions), "--out", str(results),
                                                   "--chapters", "memory"])
        seconds["one by one"] = sum(timed([*grader, str(path)]) for path in notebooks)
        seconds["one call, every notebook"] = timed([*grader, *map(str, notebooks)])
    figures = {"notebooks": len(notebooks), "jobs": args.jobs, "cpus": os.cpu_count(),
               "load_average_1min": round(os.getloadavg()[0], 2),
               "seconds": {k: round(v, 1) for k, v in seconds.items()},
               "notebooks_per_minute": {k: round(60 * len(notebooks) / v, 1) for k, v in seconds.items()}}
    figures["class_speedup_over_one_by_one"] = round(seconds["one by one"] / seconds["class"], 2)
    for name, value in seconds.items():
        print(f"{name:<26} {value:7.1f} s  {figures['notebooks_per_minute'][name]:6.1f} notebooks/min")
    print(f"class vs one by one: {figures['class_speedup_over_one_by_one']}x faster "
          f"({len(notebooks)} notebooks, --jobs {args.jobs}, {os.cpu_count()} CPUs, "
          f"load average {figures['load_average_1min']})")
    if args.output:
        Path(args.output).write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
