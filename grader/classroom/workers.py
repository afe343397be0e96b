"""Grading several notebooks at once: a few worker processes, each grading one notebook at a
time with the grader's own `grade_notebook` (so each exercise still runs in its own sandbox, and
each gloo world binds a free port of its own), and a results cache keyed by the notebook's content.

Interruption: Ctrl-C reaches the class process and its workers, which leave it to the class
process, as the sandboxes' wardens do (the sandboxes run in sessions of their own); the class
process sends every worker it started one SIGTERM, on which the worker stops at once, its
sandboxes' clean-up running as its `grade_notebook` unwinds, and waits for each before it exits.
(A worker that took Ctrl-C too would get two signals at once; `raise_interrupt_once` ignores the
second, and one already pending then makes Python print "Signal 15 ignored due to race condition".)
A notebook's result reaches the cache only once the notebook is graded whole, written by its
worker in one atomic rename, so an interrupted run keeps exactly the notebooks that had finished."""
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

from dtp.common.processes import die_with_parent

from ..interrupts import interrupts_deferred, let_interrupts_through, raise_interrupt_once
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


# How a worker and the class process talk. Every sandbox a worker forks inherits the worker's
# descriptors, and the learner's code in it can write to any of them, Landlock or not. So nothing
# that comes from a worker is believed: its one byte on `done` only says "look now", and the
# result is the cache entry the worker wrote, which a confined sandbox cannot write (RESULTS is not
# among the folders Landlock lets it reach), carrying this run's token and the job's path. Jobs go
# the other way as JSON, never pickles, and each worker first closes every descriptor of the class
# process's ends, its own and its siblings', so no sandbox can send a worker a job.
def _worker_main(jobs_fd: int, done_fd: int, foreign_fds: list[int], parent_pid: int, cache_folder: str,
                 run: str, only, timeout_s) -> None:
    die_with_parent(parent_pid, signal.SIGTERM)  # a class process killed outright still stops its workers
    signal.signal(signal.SIGTERM, raise_interrupt_once)  # unwinds through the sandboxes' clean-up
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the class process's: it sends the SIGTERM
    let_interrupts_through()  # started with them held (start_worker)
    sys.dont_write_bytecode = True  # no __pycache__ beside a student's helper module
    for fd in foreign_fds:
        os.close(fd)
    jobs, cache, options = multiprocessing.connection.Connection(jobs_fd, writable=False), \
        ResultsCache(Path(cache_folder), clean=False), options_key(only, timeout_s)
    try:
        while (job := json.loads(jobs.recv_bytes())) is not None:
            job = Job(job["relpath"], Path(job["path"]), job["sha256"])
            try:
                result = grade_one(str(job.path), only, timeout_s)
            except Exception as exc:  # noqa: BLE001 - a grader bug costs one notebook, not the class
                result = {"error": f"the grader failed on this notebook ({type(exc).__name__}: {exc})"}
            if "report" in result:
                result["report"]["path"] = job.relpath  # as in SUBMISSIONS, not the instructor's absolute path
                if content_hash_or_none(job.path) != job.sha256:
                    result["changed"] = True  # edited while graded: good for this run, never reused
            cache.put(job, options, result, run)
            os.write(done_fd, b"!")
    except (KeyboardInterrupt, EOFError, OSError):
        pass
    finally:
        os._exit(0)


def content_hash_or_none(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


class _Worker:
    def __init__(self, context, siblings: list["_Worker"], cache: "ResultsCache", run: str, only, timeout_s):
        jobs_read, jobs_write = os.pipe()
        done_read, done_write = os.pipe()
        foreign = [jobs_write, done_read] + [fd for sibling in siblings for fd in sibling.class_fds]
        self.process = context.Process(target=_worker_main, daemon=False, args=(
            jobs_read, done_write, foreign, os.getpid(), str(cache.folder), run, only, timeout_s))
        self.process.start()
        os.close(jobs_read)
        os.close(done_write)
        self.jobs = multiprocessing.connection.Connection(jobs_write, readable=False)
        self.done_fd = done_read
        self.class_fds = [jobs_write, done_read]
        self.job: Job | None = None

    def give(self, job: Job | None) -> None:
        self.job = job
        document = None if job is None else {"relpath": job.relpath, "path": str(job.path), "sha256": job.sha256}
        try:
            self.jobs.send_bytes(json.dumps(document).encode())
        except OSError:  # it is gone; its sentinel says so
            pass

    def stop(self) -> None:
        """SIGTERM (grade_notebook unwinds and its warden kills its sandbox), SIGKILL if it lingers.
        Waits by asking the kernel (is_alive reaps), not on the sentinel a sandbox can write to."""
        for send, patience_s in ((self.process.terminate, 30.0), (self.process.kill, 30.0)):
            if self.process.is_alive():
                send()
            deadline = time.monotonic() + patience_s
            while self.process.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
        self.jobs.close()
        os.close(self.done_fd)


def grade_in_parallel(jobs: list[Job], workers: int, only, timeout_s, on_result, cache: "ResultsCache") -> None:
    """Grade `jobs` on `workers` processes, calling `on_result(job, cache entry)` here as each finishes."""
    context = multiprocessing.get_context("fork")  # workers share what this process already imported
    run, options = os.urandom(16).hex(), options_key(only, timeout_s)
    pending = list(reversed(jobs))
    pool: list[_Worker] = []

    def start_worker() -> _Worker:
        with interrupts_deferred():  # a Ctrl-C waits until the pool, which the `finally` stops, holds it
            worker = _Worker(context, pool, cache, run, only, timeout_s)
            pool.append(worker)
        return worker

    try:
        for _ in range(min(workers, len(jobs))):
            start_worker().give(pending.pop())
        while any(worker.job for worker in pool):
            busy = [worker for worker in pool if worker.job]
            # Not the workers' sentinels: a sandbox holds a copy of its worker's end of that pipe
            # too, and a write there would read as the worker's death. Whether a worker lives is
            # asked of the kernel (waitpid), at the latest every second.
            ready = multiprocessing.connection.wait([w.done_fd for w in busy], timeout=1.0)
            for worker in busy:
                if worker.done_fd in ready:
                    os.read(worker.done_fd, 4096)  # what it says does not matter
                entry = cache.result(worker.job, options, run)
                if entry is None and worker.process.is_alive():
                    continue  # still grading; a sandbox's write, not the worker's
                finished, worker.job = worker.job, None
                if entry is None:  # it died: a replacement takes the next notebook
                    entry = {"error": f"the process grading it ended abruptly (exit code {worker.process.exitcode})"}
                    pool.remove(worker)
                    worker.stop()
                    worker = start_worker()
                on_result(finished, entry)
                if pending:
                    worker.give(pending.pop())
    finally:
        for worker in pool:
            if worker.job is None and worker.process.is_alive():
                worker.give(None)
        for worker in pool:
            worker.stop()
        for leftover in cache.folder.glob(".*.tmp"):  # a worker stopped halfway through writing
            leftover.unlink(missing_ok=True)


def write_atomically(path: Path, text: str) -> None:
    """Written to a temporary name, then renamed: a reader (or an interrupted run) sees the old
    file or the new one, never half of one."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


class ResultsCache:
    """RESULTS/cache/: one JSON file per notebook of the class, named by its path in SUBMISSIONS."""

    def __init__(self, folder: Path, clean: bool = True):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        for leftover in folder.glob(".*.tmp") if clean else ():  # an interrupted write
            leftover.unlink(missing_ok=True)

    def _file(self, relpath: str) -> Path:
        return self.folder / f"{hashlib.sha256(relpath.encode()).hexdigest()[:24]}.json"

    def _read(self, relpath: str) -> dict | None:
        try:
            entry = json.loads(self._file(relpath).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return entry if isinstance(entry, dict) and entry.get("relpath") == relpath else None

    def get(self, job: Job, options: dict) -> dict | None:
        """An earlier run's result for this very content and these options."""
        entry = self._read(job.relpath)
        fits = entry is not None and entry.get("sha256") == job.sha256 and entry.get("options") == options
        return entry if fits and "report" in entry and not entry.get("changed") else None

    def result(self, job: Job, options: dict, run: str) -> dict | None:
        """This run's result for `job`, once its worker has written it."""
        entry = self._read(job.relpath)
        return entry if entry is not None and entry.get("run") == run and entry.get("options") == options else None

    def put(self, job: Job, options: dict, result: dict, run: str) -> None:
        entry = {"relpath": job.relpath, "sha256": job.sha256, "options": options, "run": run, **result}
        write_atomically(self._file(job.relpath), json.dumps(entry, indent=1) + "\n")
