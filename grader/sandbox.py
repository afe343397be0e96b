"""Run a function in a forked child process with a time limit, and leave nothing behind.

The child becomes the leader of a new process group, so every process it starts (the ranks of a
gloo world) can be killed with it in one `killpg`, on success, timeout, crash or Ctrl-C. Its
temporary files go to a folder the parent creates and removes, so a killed child leaves none.
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from dtp.world import die_with_parent


_child_deadline: float | None = None  # set in a sandbox child: when the parent will kill it


def seconds_left(default: float = 60.0) -> float:
    """Inside a sandbox child, the time before the grader stops it; elsewhere `default`."""
    return default if _child_deadline is None else max(_child_deadline - time.monotonic(), 0.0)


@dataclass
class ChildOutcome:
    kind: str  # "returned", "timeout" or "crashed"
    value: object = None
    exitcode: int | None = None


def _child_main(task, writer, scratch_dir: str, workdir: str | None, parent_pid: int, timeout_s: float) -> None:
    global _child_deadline
    _child_deadline = time.monotonic() + timeout_s
    os.setpgid(0, 0)
    die_with_parent(parent_pid)  # a SIGKILLed grader cannot clean up; the kernel then ends us
    # A forked copy of a parent's OpenMP thread pool (a kernel that ran torch ops) can hang on its
    # first parallel region; one thread avoids that pool, and checks are small anyway.
    torch.set_num_threads(1)
    tempfile.tempdir = scratch_dir
    os.environ["TMPDIR"] = scratch_dir
    if workdir:
        os.chdir(workdir)  # relative paths mean what they mean in the learner's kernel
    # The learner's prints must not interleave with the grader's report or a kernel's streams.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - lives as long as this short process
    sys.stderr = sys.stdout
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        writer.send(task())
    finally:
        writer.close()
        os._exit(0)  # skip the parent's atexit handlers (a notebook kernel's, pytest's)


SCRATCH_PREFIX = "dtp-sandbox-"


def _remove_orphaned_scratch_dirs() -> None:
    """Scratch folders of graders that were killed outright (SIGKILL runs no clean-up): their
    names carry the grader's pid, so a folder whose grader is gone can go."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(SCRATCH_PREFIX):
            continue
        owner = name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}") and os.path.isdir("/proc/self"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_isolated(task, timeout_s: float, workdir: str | None = None) -> ChildOutcome:
    """Run `task()` (which must return something picklable) in a forked child process group,
    in the folder `workdir` if given."""
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    _remove_orphaned_scratch_dirs()
    scratch_dir = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    child = context.Process(target=_child_main, daemon=False,
                            args=(task, writer, scratch_dir, workdir, os.getpid(), timeout_s))
    child.start()
    try:
        os.setpgid(child.pid, child.pid)  # also here, so a kill right after start finds the group
    except (ProcessLookupError, PermissionError):
        pass
    writer.close()
    try:
        if not reader.poll(timeout_s):
            return ChildOutcome("timeout")
        try:
            return ChildOutcome("returned", reader.recv())
        except EOFError:
            child.join()
            return ChildOutcome("crashed", exitcode=child.exitcode)
    finally:
        _kill_group(child.pid)
        child.kill()
        child.join()
        reader.close()
        shutil.rmtree(scratch_dir, ignore_errors=True)
