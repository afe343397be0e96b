"""Grading several notebooks at once: a few worker processes, each grading one notebook at a
time with the grader's own `grade_notebook` (so each exercise still runs in its own sandbox, and
each gloo world binds a free port of its own), and a results cache keyed by the notebook's content.

Interruption: Ctrl-C reaches the class process and its workers (the sandboxes run in sessions of
their own, and their wardens ignore it); a worker stops at once, its sandboxes' clean-up runs as
its `grade_notebook` unwinds, and the class process ends every worker it started before it exits.
A notebook's result reaches the cache only once the notebook is graded whole, in one atomic rename,
so an interrupted run keeps exactly the notebooks that had finished."""
from __future__ import annotations

import ast
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dtp.processes import die_with_parent

from ..notebook import UnusableInput


@dataclass
class Job:
    relpath: str  # inside SUBMISSIONS: the cache's key and the report's path
    path: Path
    sha256: str


def options_key(only: list[str] | None, timeout_s: float | None) -> dict:
    """What, besides the notebook's content, decides its grades: a cached result counts only for the same."""
    return {"only": sorted(only) if only else None, "timeout": timeout_s}


def graded_fingerprint(definitions) -> str:
    """The graded definitions with whitespace and comments normalised away (`ast.unparse`)."""
    text = "\n".join(ast.unparse(statement.node) for statement in definitions.statements)
    return hashlib.sha256(text.encode()).hexdigest()


def grade_one(path: str, only: list[str] | None, timeout_s: float | None) -> dict:
    """Grade one notebook; each exercise through `grade_notebook` on its own, which costs a
    re-read of the notebook (tens of milliseconds) and gives each exercise's grading time."""
    from .. import landlock
    from ..grading import grade_notebook
    from ..notebook import extract_definitions, read_course_notebook
    from ..registry import chapter_exercises
    from ..report import NotebookReport

    try:
        notebook, chapter = read_course_notebook(path)
        exercises = chapter_exercises(chapter)
        definitions = extract_definitions(notebook, {name for ex in exercises for name in ex.reads})
        report = NotebookReport(path=path, chapter=chapter)
        seconds = {}
        started = time.monotonic()
        for exercise in exercises:
            if only and exercise.id not in only:
                continue
            began = time.monotonic()
            report.add(grade_notebook(path, [exercise.id], timeout_s).exercises[0])
            seconds[exercise.id] = round(time.monotonic() - began, 3)
        report.elapsed_s = round(time.monotonic() - started, 3)
    except (UnusableInput, OSError) as exc:  # changed or removed since it was read
        return {"unusable": str(exc)}
    return {"report": asdict(report), "exercise_seconds": seconds, "fingerprint": graded_fingerprint(definitions),
            "unconfined": landlock.unavailable_reason()}


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def _worker_main(connection, parent_pid: int) -> None:
    die_with_parent(parent_pid, signal.SIGTERM)  # a class process killed outright still stops its workers
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)  # unwinds through the sandboxes' clean-up
    signal.signal(signal.SIGINT, _raise_keyboard_interrupt)
    sys.dont_write_bytecode = True  # no __pycache__ beside a student's helper module
    try:
        while (job := connection.recv()) is not None:
            try:
                result = grade_one(*job)
            except Exception as exc:  # noqa: BLE001 - a grader bug costs one notebook, not the class
                result = {"error": f"the grader failed on this notebook ({type(exc).__name__}: {exc})"}
            connection.send(result)
    except (KeyboardInterrupt, EOFError, OSError):
        pass
    finally:
        os._exit(0)


class _Worker:
    def __init__(self, context):
        self.connection, child_end = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child_end, os.getpid()), daemon=False)
        self.process.start()
        child_end.close()
        self.job: Job | None = None

    def give(self, job: Job, only, timeout_s) -> None:
        self.job = job
        self.connection.send((str(job.path), only, timeout_s))

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()  # SIGTERM: grade_notebook unwinds, its warden kills its sandbox
            self.process.join(30)
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        self.connection.close()


def grade_in_parallel(jobs: list[Job], workers: int, only, timeout_s, on_result) -> None:
    """Grade `jobs` on `workers` processes, calling `on_result(job, result)` here as each finishes."""
    context = multiprocessing.get_context("fork")  # workers share what this process already imported
    pending = list(reversed(jobs))
    pool: list[_Worker] = []
    try:
        for _ in range(min(workers, len(jobs))):
            worker = _Worker(context)
            pool.append(worker)
            worker.give(pending.pop(), only, timeout_s)
        while any(worker.job for worker in pool):
            busy = [worker for worker in pool if worker.job]
            ready = multiprocessing.connection.wait([w.connection for w in busy] + [w.process.sentinel for w in busy])
            for worker in busy:
                if worker.connection not in ready and worker.process.sentinel not in ready:
                    continue
                finished, worker.job = worker.job, None
                try:
                    result = worker.connection.recv()
                except (EOFError, OSError):  # it died: a replacement takes the next notebook
                    worker.process.join()
                    result = {"error": f"the process grading it ended abruptly (exit code {worker.process.exitcode})"}
                    pool.remove(worker)
                    worker.stop()
                    worker = _Worker(context)
                    pool.append(worker)
                on_result(finished, result)
                if pending:
                    worker.give(pending.pop(), only, timeout_s)
    finally:
        for worker in pool:
            if worker.job is None and worker.process.is_alive():
                try:
                    worker.connection.send(None)
                except OSError:
                    pass
        for worker in pool:
            worker.stop()


def write_atomically(path: Path, text: str) -> None:
    """Written to a temporary name, then renamed: a reader (or an interrupted run) sees the old
    file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


class ResultsCache:
    """RESULTS/cache/: one JSON file per notebook of the class, named by its path in SUBMISSIONS."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for leftover in folder.glob(".*.tmp"):  # an interrupted write
            leftover.unlink(missing_ok=True)

    def _file(self, relpath: str) -> Path:
        return self.folder / f"{hashlib.sha256(relpath.encode()).hexdigest()[:24]}.json"

    def get(self, job: Job, options: dict) -> dict | None:
        try:
            entry = json.loads(self._file(job.relpath).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        fits = entry.get("relpath") == job.relpath and entry.get("sha256") == job.sha256 and entry.get("options") == options
        return entry if fits and "report" in entry else None

    def put(self, job: Job, options: dict, result: dict) -> dict:
        entry = {"relpath": job.relpath, "sha256": job.sha256, "options": options, **result}
        write_atomically(self._file(job.relpath), json.dumps(entry, indent=1) + "\n")
        return entry
