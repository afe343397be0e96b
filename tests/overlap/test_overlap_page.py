"""The overlap pages: every number their text shows is glued from code run at build time, every
glued value is used, every measured table shows the model beside the measurement with their
ratio (a static check; the measurements themselves run when the book is built), and the
exercise notebook's statements say what its exercises ask."""
import re

import nbformat
import pytest

from conftest import REPO, solution_path

PAGES = {name: (REPO / "book" / f"{name}.md").read_text() for name in ("overlap", "overlap_gpu")}
PAGE = PAGES["overlap"]
MEASURED = ("ddp_table", "zero3_table", "tp_table", "ring_table", "ep_table")


@pytest.mark.parametrize("name", sorted(PAGES))
def test_every_glued_name_in_the_text_is_computed_and_every_computed_one_is_shown(name):
    page = PAGES[name]
    shown = set(re.findall(r"\{glue:(?:text|md)\}`([a-z0-9_]+)`", page)) | set(re.findall(r"```\{glue:md\} ([a-z0-9_]+)", page))
    computed = set(re.findall(r'glue\("([a-z0-9_]+)"', page))
    assert shown == computed, (shown - computed, computed - shown)


def test_the_page_shows_why_gloo_s_event_loop_runs_beside_the_rank_measured_at_build_time():
    """The harness's thread placement is a claim about gloo on this machine: the page measures
    both placements when it is built, and says whether the real-time priority was allowed."""
    assert "placement = overlap_measure.measure_event_loop_placement()" in PAGE
    assert "```{glue:md} loop_table" in PAGE and "{glue:text}`realtime_allowed`" in PAGE


def test_measured_numbers_are_labelled_as_this_machine_s():
    for table in MEASURED:
        before = PAGE[:PAGE.index(f"```{{glue:md}} {table}")]
        paragraph = before[before.rindex("\n\n", 0, len(before) - 2):]
        assert "this machine" in " ".join(paragraph.split()), table


def test_every_measured_table_shows_the_model_and_the_ratio():
    for table in MEASURED:
        assert re.search(rf'glue\("{table}", compared\(', PAGE), table
    assert re.search(r'"measured exposed", "model", "measured / model", "middle half of the rounds"', PAGE)
    # every measured row's ratio goes into the page's summary, through compared()
    assert "ratios.extend(" in PAGE and "ratio_range" in PAGE


def test_the_ddp_table_shows_how_much_each_row_amplifies_an_error_in_one_all_reduce():
    """Where the chain of all-reduces outlasts backward the exposure is a difference of long times
    and the measured/model ratio spreads: the page shows each row's error gain and explains it."""
    assert re.search(r'glue\("ddp_table", compared\(ddp\["rows"\], "error gain"', PAGE)
    assert "{glue:text}`ddp_worst_gain`" in PAGE and "{glue:text}`ddp_fit_miss`" in PAGE


def test_the_exercise_statement_counts_the_functions_it_lists():
    """Exercise 1 says how many functions to write; it lists them, and the check reads them."""
    from grader.checks.overlap.model import ExposureModel

    cells = nbformat.read(solution_path("overlap"), as_version=4).cells
    statement = next(c.source for c in cells if c.cell_type == "markdown" and "## Exercise 1" in c.source)
    words = {"three": 3, "four": 4, "five": 5, "six": 6}
    said = words[re.search(r"Write (\w+) functions", statement).group(1)]
    listed = re.findall(r"^- `(\w+)\(", statement, re.M)
    assert said == len(listed) == len(ExposureModel.reads) and set(listed) == set(ExposureModel.reads)
