"""The expert-parallelism pages' corrected claims (issue 34's review) stay corrected: the numbers come
from build-time code (tests/ep/test_ep_routing.py holds that code to the claims, tests/book/test_book.py
the built values); these tests hold the prose, which no build can check, to the same."""
import re

from conftest import REPO

BOOK = REPO / "book"
PAGES = {path.name: path.read_text() for path in sorted(BOOK.glob("expert_parallel*.md"))}
PRACTICE = PAGES["expert_parallel_practice.md"]


def _paragraph(text: str, phrase: str) -> str:
    """The paragraph (blank-line separated) that contains `phrase`."""
    start = text.index(phrase)
    return text[text.rfind("\n\n", 0, start) + 2:text.find("\n\n", start)]


def test_deepseek_v3_is_not_said_to_balance_without_an_auxiliary_loss():
    for name, text in PAGES.items():
        assert not re.search(r"DeepSeek-V3 balances\s+without", text), name
    paragraph = " ".join(_paragraph(PRACTICE, "complementary sequence-wise balance loss").split())
    assert "does not drop the auxiliary loss" in paragraph
    assert "{cite:t}`deepseekai2024v3`, section 2.1.2" in paragraph
    assert r"$\alpha = 0.0001$ (section 4.2)" in paragraph


def test_cross_node_copies_are_bounded_by_the_other_nodes_not_by_k():
    prose = " ".join(PRACTICE.split())
    assert "crosses up to $\\min(k, N-1)$ times" in prose and "its own node needs no copy" in prose
    assert "T \\cdot \\min(M, N-1) \\cdot h \\cdot w" in prose and "T \\cdot \\min(k, N-1) \\cdot h \\cdot w" in prose
    assert "{glue:text}`node_limit_saving`" in prose and "max_cross_node_dispatch_bytes" in prose
    assert not re.search(r"still crosses up to \$k\$ times", prose)
