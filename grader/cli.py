"""`python -m grader PATH... [--json FILE] [--only ID...] [--timeout SECONDS]`, and for a whole class
`python -m grader class SUBMISSIONS --out RESULTS [--chapters LIST] [--jobs N] [--only ID...] [--timeout SECONDS]
[--regrade]`.

`class` as the first argument is the class command when `--out` follows or when no file or folder
named `class` exists; otherwise it is a PATH as before (any invocation that worked before still
means the same). A folder named `class` is always gradable as `./class`."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from . import landlock
from .interrupts import raise_interrupt_once
from .notebook import UnusableInput, read_course_notebook
from .registry import find_exercise
from .report import format_table, write_json
from .sandbox import GRADER_CACHE_PREFIX, make_undumpable

EXIT_GRADED, EXIT_UNUSABLE_INPUT, EXIT_INTERRUPTED = 0, 2, 130


def _notebook_paths(paths: list[str]) -> list[tuple[Path, bool]]:
    """(notebook, named explicitly) for each PATH; a folder contributes its notebooks."""
    found = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            notebooks = sorted(p for p in path.glob("*.ipynb") if not p.name.startswith("."))
            if not notebooks:
                raise UnusableInput(f"{path}: folder holds no .ipynb notebook")
            found.extend((notebook, False) for notebook in notebooks)
        else:
            found.append((path, True))
    return found


def _reason(exc: Exception, path: Path) -> str:
    return str(exc) if isinstance(exc, UnusableInput) else f"{path}: {exc.strerror or exc}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m grader", description="Grade course notebooks.")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="a notebook or a folder of notebooks")
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--only", nargs="+", metavar="ID", help="grade only these exercise ids")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="time limit per exercise")
    return parser


def _handle_interrupts() -> None:
    """SIGTERM, and Ctrl-C, unwind once as KeyboardInterrupt, so that the sandboxes' clean-up runs
    and no process is left behind. A grader started with Ctrl-C ignored (under nohup, or as a
    shell script's background job) keeps ignoring it, as every program does."""
    signal.signal(signal.SIGTERM, raise_interrupt_once)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, raise_interrupt_once)


@contextlib.contextmanager
def _private_torch_caches():
    """Parts of torch (its compiler stack, which some chapters' libraries load) create cache
    folders in the temporary folder as they are imported. Give them one of the grader's own,
    removed when grading ends, so that nothing is left in the user's temporary folder."""
    folder = tempfile.mkdtemp(prefix=f"{GRADER_CACHE_PREFIX}{os.getpid()}-")
    saved = {name: os.environ.get(name) for name in _TORCH_CACHE_VARIABLES}
    os.environ.update({name: os.path.join(folder, name.lower()) for name in _TORCH_CACHE_VARIABLES})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        shutil.rmtree(folder, ignore_errors=True)


_TORCH_CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def _class_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m grader class", description=(
        "Grade a class: SUBMISSIONS holds one folder per student or one notebook per student named after them."))
    parser.add_argument("submissions", metavar="SUBMISSIONS", help="the class's submissions (never written)")
    parser.add_argument("--out", required=True, metavar="RESULTS",
                        help="folder for gradebook.csv, summary.md/.html, students/ and the results cache")
    parser.add_argument("--chapters", metavar="LIST", help=(
        "the assignment, e.g. memory,dp or 01_memory,02_data_parallel: totals are out of its exercises, a chapter "
        "not handed in is missing, a notebook of another chapter is flagged (default: every chapter handed in)"))
    parser.add_argument("--jobs", type=int, metavar="N", help="notebooks graded at once (default: the CPU count)")
    parser.add_argument("--only", nargs="+", metavar="ID", help="grade only these exercise ids")
    parser.add_argument("--timeout", type=float, metavar="SECONDS", help="time limit per exercise")
    parser.add_argument("--regrade", action="store_true", help="regrade every notebook, not only the changed ones")
    return parser


def _is_class_command(argv: list[str]) -> bool:
    if argv[:1] != ["class"]:
        return False
    return any(a == "--out" or a.startswith("--out=") for a in argv[1:]) or not os.path.lexists("class")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _is_class_command(argv):
        args = _class_parser().parse_args(argv[1:])
        with _private_torch_caches():
            return _grade_class(args)
    args = _parser().parse_args(argv)
    with _private_torch_caches():
        return _grade(args)


def _grade_class(args) -> int:
    from .classroom import default_workers, grade_class
    from .classroom.assignment import check_only_within, parse_chapters

    _handle_interrupts()
    make_undumpable()
    try:
        if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
            raise UnusableInput(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
        if args.jobs is not None and args.jobs < 1:
            raise UnusableInput(f"--jobs must be at least 1, got {args.jobs}")
        if args.only:
            unknown = sorted(exercise_id for exercise_id in set(args.only) if find_exercise(exercise_id) is None)
            if unknown:
                raise UnusableInput(f"unknown exercise id(s): {', '.join(unknown)}")
        chapters = None if args.chapters is None else parse_chapters(args.chapters)
        check_only_within(chapters, args.only)
        out = Path(args.out)
        results = grade_class(Path(args.submissions), out, args.jobs or default_workers(), args.only, args.timeout,
                              args.regrade, chapters=chapters)
        graded = sum(len(notebooks) for notebooks in results.graded.values())
        flagged = sum(bool(student.notes) for student in results.students)
        print(f"{len(results.students)} students, {graded} notebooks graded, {flagged} students flagged: "
              f"{out / 'gradebook.csv'}, {out / 'summary.md'}")
    except UnusableInput as exc:
        print(f"grader: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE_INPUT
    except OSError as exc:
        print(f"grader: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_UNUSABLE_INPUT
    except KeyboardInterrupt:
        print(f"grader: interrupted; the notebooks graded so far are kept in {Path(args.out) / 'cache'}, and "
              "running the same command again grades the rest; nothing was left running", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_GRADED


def _grade(args) -> int:
    _handle_interrupts()
    # Learner code runs as this user: it must not reach this process's stdout or memory through /proc.
    make_undumpable()
    try:
        if args.timeout is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
            raise UnusableInput(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
        usable, skipped = [], []
        for path, named in _notebook_paths(args.paths):
            try:
                read_course_notebook(path)  # read now: input that cannot be graded is reported before torch loads
                usable.append((path, named))
            except (UnusableInput, OSError) as exc:
                if named:
                    raise
                # A stray Untitled.ipynb or an unreadable file in a folder must not stop the others.
                skipped.append(_reason(exc, path))
        from .grading import grade_notebook  # imports torch and the chapters' checks

        if args.only:  # loads only the chapters the ids name
            unknown = sorted(exercise_id for exercise_id in set(args.only) if find_exercise(exercise_id) is None)
            if unknown:
                raise UnusableInput(f"unknown exercise id(s): {', '.join(unknown)}")
        reports = []
        for path, named in usable:
            try:
                report = grade_notebook(str(path), args.only, args.timeout)
            except (UnusableInput, OSError) as exc:  # --only ids of another chapter, a file changed meanwhile
                if named:
                    raise
                skipped.append(_reason(exc, path))
                continue
            print(format_table(report), flush=True)
            reports.append(report)
        if not reports:
            raise UnusableInput(f"no course notebook among the given paths ({skipped[0]})")
        for reason in skipped:
            print(f"grader: skipped {reason}", file=sys.stderr)
        if len(reports) > 1:
            print(f"total {sum(r.score for r in reports)}/{sum(r.max_score for r in reports)}")
        unconfined = landlock.unavailable_reason()
        if unconfined:
            print(f"note: {unconfined}")
        if args.json:
            write_json(reports, args.json, unconfined)
    except UnusableInput as exc:
        print(f"grader: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE_INPUT
    except OSError as exc:
        print(f"grader: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_UNUSABLE_INPUT
    except KeyboardInterrupt:
        print("grader: interrupted; nothing was left running", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_GRADED
