"""A world check that declares `preimport = ()` saves the grader a second (torch._dynamo's import)
only if its ranks really need none of torch's lazily imported modules: otherwise every rank would
import them on its own, all at once. Grading each such exercise on its solution, in a fresh
process, must import none of them in any process it forks."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dtp.common.world import LAZY_TORCH_MODULES
from grader.registry import COURSE_CHAPTERS, chapter_exercises

REPO = Path(__file__).resolve().parents[2]
SOLUTIONS = {json.loads(path.read_text())["metadata"]["dtp"]["chapter"]: path
             for path in (REPO / "solutions").glob("*.ipynb")}

# Grades the exercises named on the command line; logs every import of a lazy module made by a
# process other than this one to a file opened before any sandbox starts (the sandbox may write to
# what it inherited, not open files).
_CHILD = r"""
import json, os, sys
log = open(sys.argv[1], "w")
lazy = set(json.loads(sys.argv[2]))
main = os.getpid()

class Watch:
    def find_spec(self, name, path, target=None):
        if name in lazy and os.getpid() != main:
            log.write(name + "\n")
            log.flush()
        return None

from grader.grading import grade_exercise
from grader.notebook import NotebookCode, read_course_notebook
from grader.registry import find_exercise
from grader.student import StudentCode

notebook, _ = read_course_notebook(sys.argv[3])
code = NotebookCode.parse(notebook)
sys.meta_path.insert(0, Watch())
statuses = {}
for exercise_id in sys.argv[4:]:
    exercise = find_exercise(exercise_id)
    definitions = code.definitions(exercise.reads)
    statuses[exercise_id] = grade_exercise(
        exercise, lambda: StudentCode.from_definitions(definitions, as_main=True), None,
        os.path.dirname(sys.argv[3])).status
print(json.dumps(statuses))
"""


def _grade_watched(child: str, log: Path, notebook: Path, exercises: list[str]) -> dict:
    """Run `child` on the exercises; their statuses (the lazy imports seen are in `log`)."""
    completed = subprocess.run([sys.executable, "-c", child, str(log), json.dumps(LAZY_TORCH_MODULES),
                                str(notebook), *exercises], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _declared_none(chapter: str) -> list[str]:
    return [ex.id for ex in chapter_exercises(chapter) if ex.check.runs_world and not ex.check.preimport]


@pytest.mark.parametrize("chapter", [c for c in COURSE_CHAPTERS if _declared_none(c)])
def test_world_checks_declaring_no_preimport_import_none_of_torchs_lazy_modules(chapter, tmp_path):
    notebook = SOLUTIONS[chapter]
    exercises = _declared_none(chapter)
    log = tmp_path / "imports.log"
    statuses = _grade_watched(_CHILD, log, notebook, exercises)
    assert statuses == dict.fromkeys(exercises, "passed")  # the worlds ran
    imported = sorted(set(log.read_text().split()))
    assert not imported, f"{chapter}: {exercises} declare preimport = () but their ranks imported {imported}"


def test_the_watch_sees_a_rank_that_imports_a_lazy_module(tmp_path):
    """The test above can fail: the ZeRO chapter's ranks build torch optimizers, so grading zero.zero1
    without the preimport it declares logs torch._dynamo."""
    log = tmp_path / "imports.log"
    child = _CHILD.replace("from grader.grading import grade_exercise",
                           "from grader.registry import find_exercise as _find\n"
                           "_find('zero.zero1').check.preimport = ()\n"
                           "from grader.grading import grade_exercise")
    assert _grade_watched(child, log, SOLUTIONS["zero"], ["zero.zero1"]) == {"zero.zero1": "passed"}
    assert "torch._dynamo" in log.read_text().split()
