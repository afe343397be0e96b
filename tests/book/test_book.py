"""The built book (make test builds it before running pytest): exercise notebooks published
unexecuted and downloadable, solutions never published, measured figures and numbers present."""
import ast
import json
import re

import nbformat
import pytest

from conftest import EXERCISES, REPO, SOLUTIONS

HTML = REPO / "_build" / "html"
pytestmark = pytest.mark.skipif(not (HTML / "index.html").exists(), reason="book not built: run `make book`")

SOLUTION_BLOCK = re.compile(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", re.S)


def _code_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip()]


def solution_lines() -> set[str]:
    """Distinctive lines of the solutions: longer than 25 characters, and not also in the
    notebooks' own statements and demos outside the solution markers."""
    lines, public = set(), set()
    for path in SOLUTIONS.glob("*.ipynb"):
        for cell in nbformat.read(path, as_version=4).cells:
            for block in SOLUTION_BLOCK.findall(cell.source):
                lines |= {line for line in _code_lines(block) if len(line) > 25}
            public |= set(_code_lines(SOLUTION_BLOCK.sub("", cell.source)))
    return lines - public


# One distinctive line can be generic code that a page may well contain too (`if isinstance(layer,
# nn.Linear):`); two or more in one published file are a solution shown.
LEAK = 2


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
            leaked = secret & set(_code_lines(text))
            assert len(leaked) < LEAK, f"{path} shows solution code: {sorted(leaked)[:3]}"


# A number each page computes at build time (deterministic: formulas, exact counts), and whether
# the page shows a figure measured or drawn at build time.
PAGE_RESULTS = {
    "memory": (["124,439,808", "174,604,259,328"], True),  # parameter counts, checked against torch's numel
    "data_parallel": (["1,572,864"], True),  # 2(n-1)/n·S for n = 4, S = 1 MiB, measured beside the formula
    "tensor_parallel": (["2,048", "12,288"], False),  # a block's all-reduce, bsh·4 B, and 4·2(t-1)/t·S sent at t = 4
    "tensor_parallel_practice": (["67,108,864"], True),  # the source notes' all-reduce: 4096 tokens × 8192 × 2 bytes
    "pipeline_parallel": (["9.86"], True),  # 7/71 for p = 8, m = 64, not 7/70
    "pipeline_parallel_practice": (["1.24", "34.6"], True),  # messages over compute, %; 1F1B's step, slow messages
    "expert_parallel": (["46,702,792,704"], True),  # Mixtral's parameters, equal to torch's count
    "expert_parallel_practice": (["671", "411.0", "234.9"], False),  # DeepSeek-V3's 671B; node 0's cross-node bounds
    "zero": (["120.0", "31.4", "16.6", "1.9"], True),  # the ZeRO paper's Figure 1 (7.5B, Nd = 64), in GB
    "zero_practice": (["20,043", "13,416"], False),  # ring bytes per step: ZeroRedundancyOptimizer's, ZeRO-1's
    "overlap": (["4.2", "8.4", "12.6"], False),  # ZeRO-3's gathered MB at prefetch depth 0, 1, 2 (1 + d units)
    "overlap_gpu": (["0.18", "152"], False),  # GPU_CONTENTION = 132/112 - 1; what it costs a hidden 1 ms collective (µs)
    # ring bytes per rank at c = 4; zigzag's equal causal work; Llama 3's 128K stage on 8·16·16·8 GPUs (DP 8,
    # not 4); a causal zigzag ring step hides its transfer from twice the full block's 1,237 tokens
    "context_parallel": (["49,152", "144", "16,384", "2,474"], False),
    "topology": (["8192", "1024"], True),  # the notes' layout multiplied out, and with EP inside DP
    "planner": (["408.6"], True),  # the 409B model's parameters (B)
    "planner_validation": (["3.50", "40.4%"], True),  # DeepSeek-V3's IB copies M(N-1)/N; Llama 3's 400/989.4
    "planner_cli": (["python -m dtp.topology.plan --model moe-409b"], False),  # the command, run at build time
}


@pytest.mark.parametrize("page", sorted(PAGE_RESULTS))
def test_chapter_pages_show_their_build_time_results(page):
    html = (HTML / "book" / f"{page}.html").read_text()
    numbers, has_figure = PAGE_RESULTS[page]
    for number in numbers:
        assert number in html, f"{page}: {number} missing"
    assert ("<img" in html) == has_figure
    assert "Traceback" not in html


def _glued(page: str) -> dict:
    """{name: text} of the values a page glued as it was built."""
    glue = json.loads((REPO / "_build" / "jupyter_execute" / "book" / f"{page}.glue.json").read_text())
    return {name: ast.literal_eval(entry["data"]["text/plain"]) for name, entry in glue.items()
            if "text/plain" in entry["data"] and not entry["data"]["text/plain"].startswith("<")}


def test_node_limited_routing_saves_what_the_tight_bounds_say():
    """With one copy per destination node a token crosses at most min(k, N - 1) times, min(M, N - 1)
    with the node limit: on 8 nodes with k = 8 and M = 4 the limit saves 7/4 = 1.75x of the bound,
    not k/M = 2x (411.0 MB against 234.9 MB for node 0's 4096 tokens, not 469.8 MB)."""
    from dtp.ep import routing

    glued = _glued("expert_parallel_practice")
    plain, limited = (routing.max_cross_node_dispatch_bytes(4096, 8, 8, 7168, 2, max_nodes=m) for m in (None, 4))
    assert glued["node_bound_plain"] == f"{plain / 1e6:.1f}" == "411.0"
    assert glued["node_bound_limited"] == f"{limited / 1e6:.1f}" == "234.9"
    assert glued["node_limit_saving"] == "1.75" and glued["node_naive_saving"] == "2"
    assert glued["node_other_nodes"] == 7
    html = (HTML / "book" / "expert_parallel_practice.html").read_text()
    assert "469.8" not in html and "411.0" in html
