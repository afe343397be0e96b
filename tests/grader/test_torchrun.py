"""The course's multi-process programs run unchanged under torchrun (env:// initialisation,
gloo on this machine): one demo per chapter, launched with `torchrun --nproc-per-node`."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from grader.demos import DEMOS

TORCHRUN = Path(sys.executable).parent / "torchrun"


@pytest.mark.parametrize("chapter", sorted(DEMOS))
def test_each_chapters_demo_runs_under_torchrun(chapter, tmp_path):
    processes, _ = DEMOS[chapter]
    # torch keeps two folders in TMPDIR after the run, its launcher's logs (torchelastic_*) and its
    # compiler's cache (torchinductor_*, made when a module imports the compiler): point TMPDIR at
    # pytest's folder so that the test run leaves nothing in /tmp, and check the demo left nothing else
    environment = dict(os.environ, TMPDIR=str(tmp_path))
    completed = subprocess.run([str(TORCHRUN), "--nproc-per-node", str(processes), "-m", "grader.demos", chapter],
                               cwd=REPO, capture_output=True, text=True, timeout=600, env=environment)
    assert [path.name for path in tmp_path.iterdir()
            if not path.name.startswith(("torchelastic_", "torchinductor_"))] == []
    assert completed.returncode == 0, completed.stderr[-2000:]
    lines = [line for line in completed.stdout.splitlines() if line.startswith(f"{chapter}: ")]
    assert len(lines) == 1, completed.stdout  # printed once, by rank 0
    assert f"{processes} ranks" in lines[0]


def test_a_demo_refuses_a_world_of_the_wrong_size():
    completed = subprocess.run([sys.executable, "-c", "from dtp.common.world import run_world; run_world(print, 3)"],
                               cwd=REPO, capture_output=True, text=True, timeout=120,
                               env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1",
                                    "PATH": "/usr/bin"})
    assert completed.returncode != 0 and "--nproc-per-node 3" in completed.stderr
