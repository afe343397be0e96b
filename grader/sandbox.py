"""Run learner code in a throwaway process with a time limit, and leave nothing behind.

Three processes take part:

    grader (or notebook kernel) -- never runs learner code; unpickles only plain data
      └─ warden                 -- grader code only: enforces the time limit, relays the result,
         │                         and is a child subreaper (PR_SET_CHILD_SUBREAPER), so every
         │                         process the learner's code starts, detached or not, ends up
         │                         its child and is killed before the warden reports
         └─ sandbox             -- runs `task()`: the learner's code, gloo ranks, anything they start

The sandbox starts a new session (no controlling terminal to write to), gives up every
capability when it runs as root (so it cannot open the grader's file descriptors through
/proc), writes its stdout and stderr to /dev/null and its temporary files to a folder the grader
removes. Before it runs `task()` it confines itself with Landlock (grader/landlock.py) where the
kernel has it: from then on it, and every process it starts, can read only the system, the
Python installation, the course's infrastructure and the notebook's folder, and write only its
scratch folder. Its result travels as bytes; the grader reads them with `transport.loads`.
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import multiprocessing
import multiprocessing.connection
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from dtp.common.processes import die_with_parent

from . import landlock, transport
from .interrupts import interrupts_deferred, let_interrupts_through

_PR_SET_DUMPABLE, _PR_CAPBSET_DROP = 4, 24
_PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 38, 36
_LIBC = ctypes.CDLL(None, use_errno=True)

SCRATCH_PREFIX = "dtp-sandbox-"
GRADER_CACHE_PREFIX = "dtp-grader-"  # grader/cli.py's folder for torch's caches
_WARDEN_SLACK_S = 15.0  # how long past the time limit the grader waits for its warden's report
_UNCONFINED_EXIT = 121  # the sandbox's exit status when the kernel refused its Landlock rules

_child_deadline: float | None = None  # set in a sandbox: when the warden will kill it


def seconds_left(default: float = 60.0) -> float:
    """Inside a sandbox, the time before the warden stops it; elsewhere `default`."""
    return default if _child_deadline is None else max(_child_deadline - time.monotonic(), 0.0)


def _prctl(option: int, value: int) -> bool:
    try:
        return _LIBC.prctl(option, value, 0, 0, 0) == 0
    except AttributeError:  # not Linux
        return False


def make_undumpable() -> None:
    """Other processes of this user can no longer read this one's memory or open its files
    through /proc/<pid>/ (ptrace access), unless they hold CAP_SYS_PTRACE."""
    _prctl(_PR_SET_DUMPABLE, 0)


def _drop_privileges() -> None:
    """No new privileges through exec, and for root no capabilities (CAP_SYS_PTRACE would
    reach into the grader's /proc entries): root's files stay readable as their owner's."""
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    if os.geteuid() != 0:
        return
    for capability in range(64):
        if not _prctl(_PR_CAPBSET_DROP, capability) and ctypes.get_errno() == 22:  # EINVAL: past the last one
            break

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header, data = Header(0x20080522, 0), (Data * 2)()  # _LINUX_CAPABILITY_VERSION_3, all sets empty
    try:
        _LIBC.capset(ctypes.byref(header), data)
    except AttributeError:
        pass


def _process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process on the machine."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                table[int(entry)] = (int(fields[1]), fields[0])
            except (OSError, IndexError, ValueError):
                continue
    return table


def descendants(root: int) -> list[int]:
    """Live (non-zombie) processes below `root`."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found, pending = [], list(children.get(root, []))
    while pending:
        pid = pending.pop()
        if table[pid][1] not in ("Z", "X"):
            found.append(pid)
        pending.extend(children.get(pid, []))
    return found


def _reap_children() -> bool:
    """Reap the children that have ended; True while any child remains."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
        return True
    except ChildProcessError:
        return False


def kill_descendants(give_up_after_s: float = 10.0) -> None:
    """SIGKILL every process below this one and reap them. As a subreaper this process
    inherits the orphans of the ones it kills, so the loop ends only when none is left."""
    deadline = time.monotonic() + give_up_after_s
    while time.monotonic() < deadline:
        alive = descendants(os.getpid())
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not _reap_children() and not alive:
            return
        time.sleep(0.002)


MEMORY_BUDGET_BYTES = 4 * 2**30  # per process of an exercise, beyond what the sandbox holds when it starts
LARGEST_FILE_BYTES = 2**30  # no file the learner's code writes may grow past this (the disk is shared)
_memory_cap_bytes: int | None = None  # set in a sandbox


def _cap_memory() -> None:
    """Limit the address space of the sandbox and everything it starts (ranks inherit the
    limit) to what it already maps plus a budget, so that a runaway allocation fails in the
    learner's code, with a clear status, instead of taking the machine's memory."""
    global _memory_cap_bytes
    try:
        with open("/proc/self/status") as status:
            mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return
    _memory_cap_bytes = mapped + MEMORY_BUDGET_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (_memory_cap_bytes, _memory_cap_bytes))


def memory_cap_bytes() -> int | None:
    """Inside a sandbox, the address-space limit its processes run under."""
    return _memory_cap_bytes


def _sandbox_main(task, writer, warden_ends, scratch_dir: str, workdir: str | None, warden_pid: int,
                  timeout_s: float, rules: list | None) -> None:
    global _child_deadline
    _child_deadline = time.monotonic() + timeout_s
    die_with_parent(warden_pid)
    to_grader, *stop_pipe = warden_ends
    to_grader.close()  # only the warden speaks to the grader, and only the grader stops the warden
    for fd in stop_pipe:
        os.close(fd)
    os.setsid()  # a session of its own: no terminal to write fake lines to, and one group to kill
    _prctl(_PR_SET_DUMPABLE, 1)  # its own /proc entries stay usable by the libraries it runs
    _drop_privileges()
    import torch
    _cap_memory()
    # Python ignores SIGXFSZ, so a write past the limit fails with OSError (File too large).
    resource.setrlimit(resource.RLIMIT_FSIZE, (LARGEST_FILE_BYTES, LARGEST_FILE_BYTES))
    # A forked copy of a parent's OpenMP thread pool (a kernel that ran torch ops) can hang on its
    # first parallel region; one thread avoids that pool, and checks are small anyway.
    torch.set_num_threads(1)
    tempfile.tempdir = scratch_dir
    os.environ["TMPDIR"] = scratch_dir
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):  # the only folder it may write to
        os.environ[variable] = os.path.join(scratch_dir, variable.lower())
    if workdir:
        os.chdir(workdir)  # relative paths and imports mean what they mean in the learner's kernel
        sys.path.insert(0, workdir)
    if rules is not None:
        try:
            landlock.confine(rules)
        except OSError:
            os._exit(_UNCONFINED_EXIT)  # never run learner code less confined than the report says
    # The learner's prints must not interleave with the grader's report or a kernel's streams,
    # nor a crash report (pytest's faulthandler writes to a copy of the terminal's descriptor).
    faulthandler.disable()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - lives as long as this short process
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        writer.send_bytes(transport.dumps(task()))
    finally:
        os._exit(0)  # skip the parent's atexit handlers (a notebook kernel's, pytest's)


def _warden_main(task, to_grader, scratch_dir, workdir, grader_pid, timeout_s, rules) -> None:
    """Start the sandbox, wait for its result, its end, the time limit or the grader's SIGTERM, kill
    everything below, then report to the grader: a JSON header line, and the sandbox's bytes if it
    returned. The SIGTERM handler only writes a byte to a pipe the wait watches: an exception raised
    from a handler can land anywhere (inside the fork of the sandbox, a finaliser) and be lost there."""
    header, payload = {"kind": "timeout"}, b""
    stop_reader, stop_writer = os.pipe()
    os.set_blocking(stop_writer, False)
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: os.write(stop_writer, b"!"))  # the grader gives up
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the grader's to handle
        let_interrupts_through()  # started with them held (run_isolated)
        die_with_parent(grader_pid, signal.SIGTERM)  # a killed grader still gets a clean-up
        make_undumpable()
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        context = multiprocessing.get_context("fork")
        reader, writer = context.Pipe(duplex=False)
        sandbox = context.Process(target=_sandbox_main, daemon=False,
                                  args=(task, writer, (to_grader, stop_reader, stop_writer), scratch_dir, workdir,
                                        os.getpid(), timeout_s, rules))
        sandbox.start()
        writer.close()
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = multiprocessing.connection.wait([reader, sandbox.sentinel, stop_reader], timeout=left)
            if stop_reader in ready:
                header = {"kind": "stopped"}
                break
            if reader in ready:
                try:
                    payload = reader.recv_bytes(transport.MAX_BYTES)
                    header = {"kind": "returned"}
                except EOFError:
                    sandbox.join()
                    header = {"kind": "crashed", "exitcode": sandbox.exitcode}
                except OSError:
                    header = {"kind": "oversized"}
                break
            if sandbox.sentinel in ready and not reader.poll(0.2):
                sandbox.join()
                header = {"kind": "crashed", "exitcode": sandbox.exitcode}
                break
    finally:
        kill_descendants()
        shutil.rmtree(scratch_dir, ignore_errors=True)
        try:
            to_grader.send_bytes(json.dumps(header).encode())
            to_grader.send_bytes(payload)
        finally:
            os._exit(0)


@dataclass
class ChildOutcome:
    kind: str  # "returned", "timeout", "crashed", "unreadable" or "unconfined"
    value: object = None
    exitcode: int | None = None


def _remove_orphaned_scratch_dirs() -> None:
    """Scratch folders (and the CLI's torch cache folders) of graders that were killed outright
    (SIGKILL runs no clean-up): their names carry the grader's pid, so a folder whose grader is
    gone can go."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        prefix = next((p for p in (SCRATCH_PREFIX, GRADER_CACHE_PREFIX) if name.startswith(p)), None)
        if prefix is None:
            continue
        owner = name[len(prefix):].split("-", 1)[0]
        if owner.isdigit() and not os.path.exists(f"/proc/{owner}") and os.path.isdir("/proc/self"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def run_isolated(task, timeout_s: float, workdir: str | None = None) -> ChildOutcome:
    """Run `task()` in a sandbox under a warden, in the folder `workdir` if given. `task` returns
    plain data (see `transport.plain`); it comes back as `ChildOutcome("returned", value)`."""
    context = multiprocessing.get_context("fork")
    reader, writer = context.Pipe(duplex=False)
    _remove_orphaned_scratch_dirs()
    scratch_dir = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-")
    # Worked out here, once, rather than in each forked sandbox (whose every write copies a page).
    rules = landlock.sandbox_rules(workdir or os.getcwd(), scratch_dir) if landlock.abi_version() else None
    warden = context.Process(target=_warden_main, daemon=False,
                             args=(task, writer, scratch_dir, workdir, os.getpid(), timeout_s, rules))
    try:
        with interrupts_deferred():  # a Ctrl-C now is raised once the `finally` below knows the warden
            warden.start()
            writer.close()
        if not reader.poll(timeout_s + _WARDEN_SLACK_S):
            return ChildOutcome("timeout")
        header = json.loads(reader.recv_bytes(4096))
        payload = reader.recv_bytes(transport.MAX_BYTES)
        if header["kind"] == "returned":
            try:
                return ChildOutcome("returned", transport.loads(payload))
            except transport.UnreadableData as exc:
                return ChildOutcome("unreadable", str(exc))
        if header["kind"] in ("timeout", "stopped"):
            return ChildOutcome("timeout")
        if header["kind"] == "oversized":
            return ChildOutcome("unreadable", f"more than {transport.MAX_BYTES >> 20} MiB of data")
        if header.get("exitcode") == _UNCONFINED_EXIT:
            return ChildOutcome("unconfined", exitcode=_UNCONFINED_EXIT)
        return ChildOutcome("crashed", exitcode=header.get("exitcode"))
    except (EOFError, OSError, ValueError):
        return ChildOutcome("crashed")
    finally:
        if warden.pid is not None:  # started
            if warden.is_alive():
                warden.terminate()  # SIGTERM: the warden kills the sandbox and all below, then exits
                warden.join(10)
            if warden.is_alive():
                warden.kill()
            warden.join()
        writer.close()
        reader.close()
        shutil.rmtree(scratch_dir, ignore_errors=True)
