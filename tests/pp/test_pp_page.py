"""The pipeline pages' corrected claims (issue 21, items 9-17) stay corrected: the numbers come
from build-time code (tests/pp/test_pp_pipeline.py and tests/pp/test_pp_torch.py hold that code to the
claims); these tests hold the page's prose, which no build can check, to the same."""
import re
from conftest import REPO

import pytest

BOOK = REPO / "book"
PAGE = (BOOK / "pipeline_parallel.md").read_text()  # schedules and their bubbles
PRACTICE = (BOOK / "pipeline_parallel_practice.md").read_text()  # newer schedules, messages, real runs


def _prose(page: str) -> str:
    """The text a reader sees: the page without its code cells."""
    return re.sub(r"```\{code-cell\}.*?```", "", page, flags=re.S)


PROSE, PRACTICE_PROSE = _prose(PAGE), _prose(PRACTICE)


def test_interleaving_does_not_claim_v_times_the_messages():  # item 9
    assert not re.search(r"\$v\$ times as many messages", PROSE)
    assert "$(pv-1)/(p-1)$, not by $v$" in PROSE


def test_pipeline_messages_are_not_said_to_overlap_with_computation():  # item 10
    for prose in (PROSE, PRACTICE_PROSE):
        assert not re.search(r"messages between neighbours that overlap with\s+computation", prose)
    assert "few bytes\nper FLOP" in PRACTICE_PROSE and "{glue:text}`pp_ratio`" in PRACTICE_PROSE


def test_gpipe_memory_names_re_materialization():  # item 11
    assert "re-materializes" in PROSE and "{glue:text}`remat_checkpointed`" in PROSE


@pytest.mark.parametrize("phrase", ["Tied embeddings", "global gradient norm", "inf and NaN",
                                    "{glue:text}`kept_whole`", "korthikanti2022reducing"])
def test_unequal_stages_are_covered(phrase):  # item 12
    assert phrase in PAGE


def test_interleaved_formula_states_its_conditions():  # item 13
    assert "$m$ must be a multiple of\n$p$" in PROSE and "{glue:text}`uneven_bubble`" in PROSE


def test_zb_h1_memory_count_is_called_an_upper_bound():  # item 14
    assert "upper bound on the bytes" in PROSE


def test_micro_batches_are_tied_to_the_global_batch():  # item 15
    assert "$m = B/(b \\cdot DP)$" in PROSE and "{glue:md} dp_table" in PROSE


def test_newer_schedules_and_torchs_list():  # item 16
    for phrase in ("**ZB-V**", "**DualPipe**", "deepseekai2024v3", "{glue:md}`torch_schedules`", "fig-pp-gantt-newer"):
        assert phrase in PRACTICE


@pytest.mark.parametrize("page", sorted(BOOK.glob("*.md")), ids=lambda path: path.name)
def test_the_two_narayanan_2021_papers_are_named_where_cited(page):
    """Item 17: both render as "Narayanan et al. 2021"; the prose next to each citation names
    which paper it is."""
    text = page.read_text()
    for key, name in (("narayanan2021efficient", "Megatron-LM"), ("narayanan2021memory", "PipeDream-2BW")):
        for match in re.finditer(key, text):
            assert name in text[max(0, match.start() - 200):match.end() + 60], (page.name, key, match.start())
