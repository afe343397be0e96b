"""What a page's source must say for it to render as meant (checked without building the book)."""
import pytest

from conftest import REPO

PAGES = sorted((REPO / "book").glob("*.md"))


@pytest.mark.parametrize("page", PAGES, ids=lambda path: path.name)
def test_every_glued_markdown_table_is_parsed_as_markdown(page):
    """A `{glue:md}` without `:format: myst` is shown as its raw text: pipes and dashes, not a table."""
    lines = page.read_text().splitlines()
    unparsed = [number + 1 for number, line in enumerate(lines) if line.startswith("```{glue:md}")
                and (number + 1 >= len(lines) or lines[number + 1].strip() != ":format: myst")]
    assert unparsed == [], f"{page.name}: lines {unparsed}"
