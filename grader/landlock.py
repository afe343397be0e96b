"""What the sandbox, and every process it starts, may read and write: a Landlock allow-list.

Learner code runs in the sandbox, and anything it starts (`subprocess.run([sys.executable, ...])`,
`sh -c 'cat ...'`, a forked child) inherits the sandbox's Landlock domain across fork and exec.
An in-process guard cannot follow a child Python or a shell; the kernel can. After `confine`, a
path is usable only if it lies beneath a rule below, whatever route reaches it (a relative path,
`os.open` with a `dir_fd`, `/proc/self/root/...`, a symbolic link): Landlock checks the file
itself, not the name the caller used.

What may be read (and executed):
- the system (/usr, /lib*, /bin, /sbin, /etc, /proc, /sys, /dev) and the Python installation
  (the interpreter's prefixes and every `sys.path` entry outside the course's checkout);
- in the checkout: the venv, the grader package except `grader/checks/` (the checks' judges
  and oracles), and the course library's infrastructure modules, `DTP_READABLE`;
- the learner's notebook folder, and the sandbox's scratch folder.

What is left out, and why: `solutions/` (the answers), `.git` (every version of them),
`tests/` (correct alternatives of each exercise), `book/`, `grader/checks/`, and every `dtp`
module not in `DTP_READABLE`. The `dtp` modules left out are those that hold the course's
answers: the closed forms and implementations that checks name in `references` (each chapter's
formulas, schedules, layers and planner, and `dtp.common.gpt`), the modules built from them (the
memory calculator: memory per GPU for any layout; `dtp.zero.runs`: ZeRO-1/2/3 on gloo). A new `dtp` module is unreadable until it is
added to `DTP_READABLE`: forgetting to list one costs a lazy import, never an answer. What the
sandbox itself already imported stays usable (Landlock governs opening files, not memory): the
grader imports the reference modules an exercise needs before the sandbox is forked, and
`guard` makes the references trip when called.

What may be written: only the scratch folder and /dev/null. Signals and abstract unix sockets
are scoped to the sandbox's own processes (ABI 6 and later), so learner code cannot signal the
grader or its warden. Network access is not restricted: gloo worlds talk TCP on 127.0.0.1.

Where the kernel has no Landlock (macOS, Linux before 5.13, a container that filters the system
calls), `abi_version()` is 0 and the grader grades as before, with the in-process guard only,
and says so in its report.
"""
from __future__ import annotations

import ctypes
import functools
import os
import stat
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# The course library's modules that hold no answer (paths below dtp/, without .py): every package's
# __init__ (docstrings only), launching worlds, logging traffic, toy models, the simulated network,
# measuring saved activations and held memory, figures, widgets.
DTP_READABLE = ("__init__", "common/__init__", "common/measure", "common/models", "common/processes",
                "common/traffic", "common/world", "memory/__init__", "memory/activations", "memory/plots",
                "memory/widgets", "dp/__init__", "dp/ddp_observed", "dp/plots", "dp/simulated", "tp/__init__",
                "pp/__init__", "pp/plots", "pp/widgets", "ep/__init__", "zero/__init__", "zero/measure",
                "overlap/__init__", "cp/__init__", "topology/__init__", "topology/plots")

SYSTEM_READABLE = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/sbin", "/etc", "/proc", "/sys", "/dev")

# Landlock's ABI, from <linux/landlock.h>; the system call numbers are the same on every architecture.
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION, _RULE_PATH_BENEATH = 1, 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_REMOVE_DIR, _REMOVE_FILE, _MAKE_CHAR, _MAKE_DIR, _MAKE_REG = 1 << 4, 1 << 5, 1 << 6, 1 << 7, 1 << 8
_MAKE_SOCK, _MAKE_FIFO, _MAKE_BLOCK, _MAKE_SYM = 1 << 9, 1 << 10, 1 << 11, 1 << 12
_REFER, _TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
_PR_SET_NO_NEW_PRIVS = 38

READ = EXECUTE | READ_FILE | READ_DIR
_ABI_1_ACCESS = (EXECUTE | WRITE_FILE | READ_FILE | READ_DIR | _REMOVE_DIR | _REMOVE_FILE | _MAKE_CHAR | _MAKE_DIR
                 | _MAKE_REG | _MAKE_SOCK | _MAKE_FIFO | _MAKE_BLOCK | _MAKE_SYM)
_FILE_ACCESS = EXECUTE | WRITE_FILE | READ_FILE | _TRUNCATE  # the rights a rule on a file (not a folder) may grant


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@functools.lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _syscall(number: int, *args) -> int:
    result = _libc().syscall(ctypes.c_long(number), *args)
    if result < 0:
        error = ctypes.get_errno()
        raise OSError(error, f"Landlock system call {number}: {os.strerror(error)}")
    return result


@functools.lru_cache(maxsize=1)
def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 where there is none."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        return _syscall(_CREATE_RULESET, ctypes.c_void_p(None), ctypes.c_size_t(0),
                        ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):  # ENOSYS, EOPNOTSUPP (built but disabled), a seccomp filter
        return 0


def unavailable_reason() -> str | None:
    """None where learner code is confined; otherwise one line for the report."""
    if abi_version():
        return None
    return ("this system has no Landlock (Linux 5.13 or later): learner code was graded with the in-process "
            "guard only, and could have read the solutions and the course's reference modules")


def _handled_access(abi: int) -> int:
    return _ABI_1_ACCESS | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _repo_rules(workdir: str | None) -> list[tuple[str, int]]:
    """The parts of the course's checkout the sandbox may read."""
    rules = [(str(REPO), READ_DIR)]  # names only: imports list the folders on sys.path
    grader = REPO / "grader"
    rules += [(str(entry), READ) for entry in grader.iterdir() if entry.name != "checks"]
    # grader.checks itself, empty, so that `import grader` works; not the chapters' checks
    rules += [(str(entry), READ) for entry in (grader / "checks").glob("__init__.py")]
    rules += [(str(entry), READ) for entry in (grader / "checks" / "__pycache__").glob("__init__.*")]
    for module in DTP_READABLE:
        source = REPO / "dtp" / f"{module}.py"
        rules.append((str(source), READ))
        cache = source.parent / "__pycache__"
        if cache.is_dir():
            rules += [(str(pyc), READ) for pyc in cache.iterdir() if pyc.name.startswith(f"{source.stem}.")]
    notebooks = str(REPO / "notebooks")
    if workdir and _is_within(workdir, notebooks):  # the one folder of the checkout written for learners
        rules.append((workdir, READ))
    return rules


def _outside_repo_rules(path: str) -> list[tuple[str, int]]:
    """`path` readable, except the checkout: a folder that holds the checkout is opened entry by
    entry, down to it (its other entries are the learner's or the system's)."""
    repo = str(REPO)
    if _is_within(path, repo):
        return []
    if not _is_within(repo, path):
        return [(path, READ)]
    rules = [(path, READ_DIR)]
    for entry in os.scandir(path):
        rules += _outside_repo_rules(entry.path)
    return rules


def sandbox_rules(workdir: str | None, scratch_dir: str) -> list[tuple[str, int]]:
    """(path, rights) for the sandbox of one exercise whose learner code runs in `workdir`."""
    full = _handled_access(abi_version())
    readable = [*SYSTEM_READABLE, sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix,
                os.path.dirname(os.path.realpath(sys.executable))]
    readable += [entry for entry in sys.path if entry and os.path.isabs(entry)]
    rules: list[tuple[str, int]] = []
    venv, repo = os.path.realpath(sys.prefix), str(REPO)
    for path in dict.fromkeys(os.path.realpath(p) for p in readable):
        # The venv, even where it lies inside the checkout; no other part of the checkout, nor
        # a folder that holds it (the repository root is on sys.path in an editable install).
        if _is_within(path, venv) or not (_is_within(path, repo) or _is_within(repo, path)):
            rules.append((path, READ))
    rules += _repo_rules(os.path.realpath(workdir) if workdir else None)
    if workdir:
        rules += _outside_repo_rules(os.path.realpath(workdir))
    rules += [(os.path.realpath(scratch_dir), full), (os.devnull, READ_FILE | WRITE_FILE | _TRUNCATE)]
    return rules


def confine(rules: list[tuple[str, int]]) -> None:
    """Restrict this process and every process it will start to `rules`, for good. Paths that
    do not exist are skipped. Raises OSError where the kernel refuses."""
    abi = abi_version()
    if not abi:
        raise OSError("Landlock is not available")
    handled = _handled_access(abi)
    attr = _RulesetAttr(handled, 0, (_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else _RulesetAttr.scoped.offset
    ruleset = _syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this system (/lib32, a sys.path entry that is gone)
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    access &= _FILE_ACCESS
                rule = _PathBeneathAttr(access & handled, fd)
                _syscall(_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), ctypes.byref(rule),
                         ctypes.c_uint32(0))
            finally:
                os.close(fd)
        if _libc().prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        _syscall(_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
