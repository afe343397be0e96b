"""What an exercise refuses is derived from the library modules that hold its oracle
(grader/checks/references.py): every public function and class there, and what they call, except
what the check's own sandbox side runs. Each derived name trips in a sandbox, the harness does not,
and a warning shown from a refused module's file is not taken for reading its source."""
import inspect
import os
import pickle

import pytest

from grader import guard
from grader.checks.references import INFRASTRUCTURE, is_infrastructure, library_closure, public_members, sandbox_side
from grader.registry import chapter_exercises

DERIVED_CHAPTERS = ("ep", "overlap", "cp")
EXERCISES = [exercise for chapter in DERIVED_CHAPTERS for exercise in chapter_exercises(chapter)]


def in_a_fork(function):
    """`function()`'s return value, computed in a forked child (the guard changes the process for good)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            result = ("ok", function())
        except BaseException as error:  # noqa: BLE001 - reported to the parent
            result = ("raised", f"{type(error).__name__}: {error}")
        os.write(writer, pickle.dumps(result))
        os._exit(0)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    status, value = pickle.loads(data)
    assert status == "ok", value
    return value


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda exercise: exercise.id)
def test_every_public_member_of_the_oracle_modules_is_refused_unless_the_check_runs_it(exercise):
    check = exercise.check
    assert check.oracle_modules, f"{exercise.id} should derive its references (@refuses_library)"
    members = library_closure([m for module in check.oracle_modules for m in public_members(module)])
    left = {name for name in members - set(check.references) if not is_infrastructure(name)}
    runs_in_sandbox = library_closure(sandbox_side(type(check)))
    assert left <= runs_in_sandbox, f"{exercise.id} lets the learner call {sorted(left - runs_in_sandbox)}"


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda exercise: exercise.id)
def test_every_refused_library_function_trips_when_called_in_the_sandbox(exercise):
    def trips() -> list[str]:
        originals = {}
        for dotted in exercise.check.references:
            if dotted.startswith("dtp."):
                originals[dotted] = guard._resolve(dotted)[2]
        guard.install(exercise.check.references)
        not_tripping = []
        for dotted, target in originals.items():
            if inspect.isclass(target):
                if "tripwire" not in target.__init__.__code__.co_filename:
                    not_tripping.append(dotted)
                continue
            try:
                target()
                not_tripping.append(dotted)
            except guard.UsesCourseReference:
                pass
            except BaseException:  # noqa: BLE001 - ran the library's code: not refused
                not_tripping.append(dotted)
        return not_tripping

    assert in_a_fork(trips) == []


def test_a_warning_from_a_refused_modules_file_shows_no_line_and_trips_nothing():
    """dtp.overlap.runs holds both a harness the sandbox runs and an oracle it refuses: a warning
    raised while the harness runs reads the file's line through linecache, which must get nothing
    (as under Landlock), while opening the file outright still trips."""
    import linecache

    from dtp.overlap import runs
    from grader.registry import find_exercise

    def sandbox():
        check = find_exercise("overlap.bucket_overlap").check
        guard.preload(check)  # as the grader does before it forks the sandbox: no source line cached
        guard.install(check.references)
        lines = linecache.getlines(runs.__file__)
        try:
            open(runs.__file__).close()
            opened = "opened"
        except guard.UsesCourseReference:
            opened = "tripped"
        return lines, opened, list(guard.tripped)

    lines, opened, tripped = in_a_fork(sandbox)
    assert lines == [] and opened == "tripped" and tripped == ["calls the course's reference source runs.py; this "
                                                               "exercise asks you to write it yourself"]


def test_infrastructure_names_exist():
    import importlib

    for name in INFRASTRUCTURE:
        module, _, attribute = name.rpartition(".")
        try:
            importlib.import_module(name)
        except ImportError:
            assert hasattr(importlib.import_module(module), attribute), name
