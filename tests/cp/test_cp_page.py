"""The context-parallel page: every number its text shows is glued from code run at build time,
and every glued value is used (a static check; the page itself runs when the book is built)."""
import re

from conftest import REPO

PAGE = (REPO / "book" / "context_parallel.md").read_text()


def test_every_glued_name_in_the_text_is_computed_and_every_computed_one_is_shown():
    shown = set(re.findall(r"\{glue:(?:text|md)\}`([a-z0-9_]+)`", PAGE)) | set(re.findall(r"```\{glue:md\} ([a-z0-9_]+)", PAGE))
    computed = set(re.findall(r'glue\("([a-z0-9_]+)"', PAGE))
    assert shown == computed, (shown - computed, computed - shown)


def test_llama_3s_layout_is_computed_from_its_four_degrees():
    """Llama 3 405B's 128K stage: TP 8, CP 16, PP 16, DP 8 (Table 4 of the paper), 16,384 GPUs;
    the page glues the data-parallel degree and the product, never a typed number."""
    prose = re.sub(r"```\{code-cell\}.*?```", "", PAGE, flags=re.S)
    assert "{glue:text}`llama_dp`" in prose and "{glue:text}`llama_gpus`" in prose
    assert not re.search(r"data\s+parallelism\s+\d", prose)
    degrees = dict(re.findall(r"\b([tcpd])=(\d+)", re.search(r"LLAMA = dict\((.*?)\)", PAGE, re.S).group(1)))
    assert [int(degrees[k]) for k in "tcpd"] == [8, 16, 16, 8]
