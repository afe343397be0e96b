"""The built book (make test builds it before running pytest): exercise notebooks published
unexecuted and downloadable, solutions never published, measured figures and numbers present."""
import re

import nbformat
import pytest

from conftest import EXERCISES, REPO, SOLUTIONS

HTML = REPO / "_build" / "html"
pytestmark = pytest.mark.skipif(not (HTML / "index.html").exists(), reason="book not built: run `make book`")

SOLUTION_BLOCK = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)


def solution_lines() -> set[str]:
    """Distinctive lines of code that only the solutions contain (not also in the notebook's
    own statements and demos, outside the solution markers)."""
    lines, public = set(), set()
    for path in SOLUTIONS.glob("*.ipynb"):
        for cell in nbformat.read(path, as_version=4).cells:
            for block in SOLUTION_BLOCK.findall(cell.source):
                lines |= {line.strip() for line in block.splitlines() if len(line.strip()) > 25}
            public |= {line.strip() for line in SOLUTION_BLOCK.sub("", cell.source).splitlines()}
    return lines - public


@pytest.mark.parametrize("exercise", sorted(EXERCISES.glob("*.ipynb")), ids=lambda p: p.name)
def test_exercise_notebooks_are_published_unexecuted_with_a_download(exercise):
    page = HTML / "notebooks" / exercise.with_suffix(".html").name
    assert page.exists()
    assert f'href="../_sources/notebooks/{exercise.name}"' in page.read_text()  # the download button
    assert (HTML / "_sources" / "notebooks" / exercise.name).read_bytes() == exercise.read_bytes()


def test_no_solution_is_published():
    secret = solution_lines()
    assert len(secret) > 10
    assert not (HTML / "solutions").exists() and not (HTML / "_sources" / "solutions").exists()
    for path in HTML.rglob("*"):
        if not path.is_file() or path.suffix not in {".html", ".ipynb", ".md", ".txt", ".js"}:
            continue
        text = path.read_text(errors="replace")
        assert "BEGIN SOLUTION" not in text, path
        if path.suffix in {".ipynb", ".md"}:  # raw sources, where a solution line would appear verbatim
            if path.suffix == ".ipynb":
                text = "\n".join(cell.source for cell in nbformat.reads(text, as_version=4).cells)
            leaked = secret & {line.strip() for line in text.splitlines()}
            assert not leaked, f"{path} shows solution code: {sorted(leaked)[:2]}"


def test_chapter_pages_show_their_build_time_results():
    memory = (HTML / "book" / "memory.html").read_text()
    assert "124,439,808" in memory and "174,604,259,328" in memory  # computed, and checked against torch
    data_parallel = (HTML / "book" / "data_parallel.html").read_text()
    assert "<img" in data_parallel  # the bandwidth figure measured on gloo
    assert "1,572,864" in data_parallel  # 2(n-1)/n·S for n = 4 and S = 1 MiB, measured beside the formula
    for page in (memory, data_parallel):
        assert "Traceback" not in page
