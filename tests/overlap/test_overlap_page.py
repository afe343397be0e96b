"""The overlap page: every number its text shows is glued from code run at build time, and every
glued value is used (a static check; the measurements themselves run when the book is built)."""
import re
from conftest import REPO

PAGE = (REPO / "book" / "overlap.md").read_text()


def test_every_glued_name_in_the_text_is_computed_and_every_computed_one_is_shown():
    shown = set(re.findall(r"\{glue:text\}`([a-z0-9_]+)`", PAGE)) | set(re.findall(r"```\{glue:md\} ([a-z0-9_]+)", PAGE))
    computed = set(re.findall(r'glue\("([a-z0-9_]+)"', PAGE))
    assert shown == computed, (shown - computed, computed - shown)


def test_measured_numbers_are_labelled_as_this_machine_s():
    for table in ("ddp_table", "zero3_table", "tp_table", "ring_table", "ep_table"):
        before = PAGE[:PAGE.index(f"```{{glue:md}} {table}")]
        paragraph = before[before.rindex("\n\n", 0, len(before) - 2):]
        assert "this machine" in " ".join(paragraph.split()), table
