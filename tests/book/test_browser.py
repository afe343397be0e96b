"""Every page of the built book as a reader sees it, in a real browser with the network off:
math typeset, images loaded, no console error, internal links resolving, tables within the text
column (or in a scrolling container), nothing requested from outside the book; from file:// and
from a static server. A screenshot of each page's first screen goes to _build/screenshots/.

Needs Debian's Chromium (/usr/bin/chromium; `make test` installs it when run as root) and
Playwright's Python package (in requirements.txt; its own browser download is not used)."""
from __future__ import annotations

import functools
import http.server
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from conftest import REPO

HTML = REPO / "_build" / "html"
SCREENSHOTS = REPO / "_build" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(not (HTML / "index.html").exists(), reason="book not built: run `make book`")

PAGES = sorted(str(p.relative_to(HTML)) for p in [HTML / "index.html", *(HTML / "book").glob("*.html"),
                                                   *(HTML / "notebooks").glob("*.html")])
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail("the browser tests need Chromium: `apt-get install chromium` (make test does it as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def static_server():
    """The built book served over HTTP on 127.0.0.1, as a reader would host it."""
    handler = functools.partial(QuietHandler, directory=str(HTML))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class PageVisit:
    """A page opened with every request outside `allowed_prefix` blocked and recorded."""

    def __init__(self, browser, url: str, allowed_prefix: str, width: int = 1280):
        self.context = browser.new_context(viewport={"width": width, "height": 900})
        self.page = self.context.new_page()
        self.console_errors: list[str] = []
        self.outside_requests: list[str] = []
        self.page.on("console", lambda message: self.console_errors.append(message.text)
                     if message.type == "error" else None)
        self.page.on("pageerror", lambda error: self.console_errors.append(str(error)))

        def route(request_route):
            if request_route.request.url.startswith(allowed_prefix):
                request_route.continue_()
            else:
                self.outside_requests.append(request_route.request.url)
                request_route.abort()

        self.page.route("**/*", route)
        self.page.goto(url, wait_until="load")
        if url.endswith("/index.html"):  # the book's index redirects to its first page
            self.page.wait_for_url(lambda address: not address.endswith("/index.html"))
            self.page.wait_for_load_state("load")
        self.page.wait_for_function("!window.MathJax || (window.MathJax.startup && window.MathJax.startup.promise)")
        self.page.evaluate("window.MathJax && window.MathJax.startup ? window.MathJax.startup.promise : null")

    def close(self):
        self.context.close()


def _check_page(visit: PageVisit, page_path: str) -> None:
    page = visit.page
    assert visit.outside_requests == [], f"{page_path} requested {visit.outside_requests[:3]}"
    assert visit.console_errors == [], f"{page_path} logged {visit.console_errors[:3]}"
    text = page.inner_text("main")
    assert not re.search(r"\\\(|\\\[|\$\$", text), f"{page_path} shows raw TeX"
    broken = page.evaluate("[...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)")
    assert broken == [], f"{page_path}: images that did not load: {broken[:3]}"
    hashed_alt = page.evaluate("[...document.querySelectorAll('main img')].map(i => i.alt)"
                               ".filter(a => !a.trim() || /[0-9a-f]{32}/.test(a))")
    assert hashed_alt == [], f"{page_path}: figures need alt text that describes them, found {hashed_alt[:2]}"
    too_wide = page.evaluate("""() => {
        const column = document.querySelector('main article') || document.querySelector('main');
        const limit = column.getBoundingClientRect().right + 1;
        return [...column.querySelectorAll('table')].filter(table => {
            let scroller = table.parentElement;
            while (scroller && scroller !== column) {
                const style = getComputedStyle(scroller);
                if (['auto', 'scroll'].includes(style.overflowX) && scroller.getBoundingClientRect().right <= limit)
                    return false;
                scroller = scroller.parentElement;
            }
            return table.getBoundingClientRect().right > limit;
        }).map(table => table.innerText.slice(0, 60));
    }""")
    assert too_wide == [], f"{page_path}: tables wider than the text column: {too_wide}"
    _check_rendering(page, page_path, desktop=True)


# A word (or number) of a table cell drawn over two lines: the cell was squeezed instead of the table
# scrolling in its box. Each word's characters as one Range: a word broken in two has two boxes.
_BROKEN_CELL_WORDS = """() => {
    const broken = [];
    for (const cell of document.querySelectorAll('main article td, main article th')) {
        const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
        for (let node = walker.nextNode(); node; node = walker.nextNode()) {
            if (node.parentElement.closest('mjx-container')) continue;
            for (const match of node.data.matchAll(/[^\\s\\-\\u2010-\\u2014/]+/g)) {  // a line may end at a hyphen or slash
                const range = document.createRange();
                range.setStart(node, match.index);
                range.setEnd(node, match.index + match[0].length);
                const lines = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
                if (lines.size > 1) broken.push(match[0]);
            }
        }
    }
    return broken;
}"""

# Display equations wider than their box: at 1280 px none (long ones are broken over lines); on a
# phone they may scroll, inside a box that shows it can (the shadow at its edge, course.css).
_WIDE_EQUATIONS = """() => [...document.querySelectorAll('main mjx-container[display="true"]')]
    .filter(box => box.scrollWidth > box.clientWidth + 1)
    .map(box => ({tex: (box.querySelector('mjx-assistive-mml') || box).textContent.slice(0, 60),
                  scrolls: ['auto', 'scroll'].includes(getComputedStyle(box).overflowX),
                  cue: getComputedStyle(box).backgroundImage.includes('gradient')}))"""

# Markdown's code marks printed as text: a value glued as text (glue:text) that holds `name`
# shows the backticks; glued as Markdown (glue:md) it is set as code.
_PROSE_BACKTICKS = """() => { const main = document.querySelector('main').cloneNode(true);
    main.querySelectorAll('pre, code, kbd, script, style, mjx-container').forEach(node => node.remove());
    return main.textContent.match(/.{0,30}`.{0,30}/g) || []; }"""


def _check_rendering(page, page_path: str, desktop: bool) -> None:
    """What no reader should see: a table cell squeezed until its words break, Markdown table syntax,
    code marks or TeX commands printed as text (in the page or inside a typeset formula), a formula in error,
    and (at 1280 px) a display formula wider than the column."""
    broken = page.evaluate(_BROKEN_CELL_WORDS)
    assert broken == [], f"{page_path} at {'1280' if desktop else '390'} px: table cells break inside {broken[:5]}"
    if desktop:
        text = page.inner_text("main")
        # (the rule row as text: Sphinx turns its "---" into an em dash)
        assert not re.search(r"\|\s*:?(?:-{3,}|[\u2013\u2014]):?\s*\|", text), f"{page_path} shows a Markdown table as text"
        assert not re.search(r"\\(?:[A-Za-z]{2,}|_)", text), f"{page_path} shows a TeX command as text"
        backticks = page.evaluate(_PROSE_BACKTICKS)
        assert backticks == [], f"{page_path} shows Markdown code marks as text: {backticks[:3]}"
        math = page.evaluate("[...document.querySelectorAll('main mjx-assistive-mml, main mjx-merror')]"
                             ".map(node => node.tagName + ': ' + node.textContent)")
        raw = [formula for formula in math if formula.startswith("MJX-MERROR") or re.search(r"\\[A-Za-z_]", formula)]
        assert raw == [], f"{page_path}: formulas with raw TeX or errors: {raw[:3]}"
        wide = page.evaluate(_WIDE_EQUATIONS)
        assert wide == [], f"{page_path}: display formulas wider than the text column at 1280 px: {wide[:3]}"
    else:
        uncued = [box for box in page.evaluate(_WIDE_EQUATIONS) if not (box["scrolls"] and box["cue"])]
        assert uncued == [], f"{page_path}: formulas cut off at 390 px without a scroll cue: {uncued[:3]}"


def _internal_links(page) -> list[str]:
    """Links to files of the book that do not exist (relative to where the page ended up: the
    book's index.html redirects to its first page)."""
    here = Path(unquote(urlparse(page.url).path)).parent
    missing = []
    for href in page.evaluate("[...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'))"):
        parsed = urlparse(href)
        if parsed.scheme or href.startswith("#") or href.startswith("mailto:"):
            continue
        target = here / unquote(parsed.path)
        if not target.exists():
            missing.append(href)
    return missing


def _phone_overflow(visit: PageVisit, page_path: str) -> None:
    """At 390 px (a phone), no page is wider than the screen: long headings and inline code wrap,
    wide content scrolls inside its own box; the pipeline explorer's labels stay readable."""
    page = visit.page
    page.set_viewport_size({"width": 390, "height": 900})
    page.wait_for_function("window.innerWidth === 390")
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"{page_path} scrolls {overflow} px sideways at 390 px"
    smallest = page.evaluate("""Math.min(...[...document.querySelectorAll('.course-pipeline-explorer svg text')]
                                .map(t => t.getBoundingClientRect().height).filter(h => h > 0), 99)""")
    assert smallest >= 8, f"{page_path}: the pipeline explorer's text is {smallest:.1f} px high"
    _check_rendering(page, page_path, desktop=False)


@pytest.mark.parametrize("page_path", PAGES)
def test_page_from_file_on_a_desktop_and_a_phone(browser, page_path):
    """Each page opened once from file://: the reader's checks at 1280 px (and a screenshot), then
    the same page narrowed to a phone's 390 px."""
    visit = PageVisit(browser, (HTML / page_path).as_uri(), "file://")
    try:
        _check_page(visit, page_path)
        assert _internal_links(visit.page) == []
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        visit.page.screenshot(path=str(SCREENSHOTS / (page_path.replace("/", "__") + ".png")))
        _phone_overflow(visit, page_path)
    finally:
        visit.close()


# Served over http, the pages differ from file:// only in how their own files are fetched: the
# pages that fetch the most (the first page behind the index's redirect, a chapter with figures,
# widgets and math, a rendered notebook) stand for the rest.
SERVED_PAGES = [page for page in ("index.html", "book/pipeline_parallel.html", "notebooks/09_topology.html")
                if page in PAGES]


@pytest.mark.parametrize("page_path", SERVED_PAGES)
def test_page_from_a_static_server(browser, static_server, page_path):
    visit = PageVisit(browser, f"{static_server}/{page_path}", static_server)
    try:
        _check_page(visit, page_path)
    finally:
        visit.close()


def _search(visit: PageVisit) -> list[str]:
    """The snippets of a search, once Sphinx has listed every result and each has its snippet."""
    page = visit.page
    # Sphinx lists the results one by one; judge them once the search has finished and every result
    # has its snippet (a busy machine only makes this take longer).
    page.wait_for_function("/finished/i.test(document.querySelector('#search-results .search-summary, "
                           "#search-results p')?.textContent || '')", timeout=60000)
    page.wait_for_function("[...document.querySelectorAll('ul.search > li')].every(li => li.querySelector('p.context'))",
                           timeout=60000)
    snippets = page.eval_on_selector_all("ul.search li p.context", "nodes => nodes.map(n => n.textContent)")
    assert len(snippets) == page.locator("ul.search > li").count() > 0
    return snippets


def test_search_snippets_come_from_the_text_that_matched(browser):
    """A result that links to a section gets its snippet from that section, from the window that
    holds the most of the query: for "ZeRO-3 prefetch" every snippet shows a term of the query, and
    the first result (the best match) both, never the page's first "ZeRO-3" far from any prefetch."""
    visit = PageVisit(browser, f"{HTML.as_uri()}/search.html?q=ZeRO-3+prefetch", "file://")
    try:
        snippets = [snippet.lower() for snippet in _search(visit)]
        assert all("prefetch" in snippet or "zero-3" in snippet for snippet in snippets), snippets
        assert "zero-3" in snippets[0] and "prefetch" in snippets[0], snippets[0]
    finally:
        visit.close()


@pytest.mark.parametrize("served", ["file", "http"])
def test_search_shows_readable_snippets_offline(browser, static_server, served):
    """Search from file:// and over http: results with a snippet of the page's text around the term,
    highlighted, with formulas readable (no TeX delimiters) and no page-header debris; no request
    refused (Sphinx's own snippets fetch each page, which file:// refuses with a CORS error)."""
    root = HTML.as_uri() if served == "file" else static_server
    visit = PageVisit(browser, f"{root}/search.html?q=all-reduce", "file://" if served == "file" else static_server)
    try:
        page = visit.page
        snippets = _search(visit)
        assert visit.outside_requests == [] and visit.console_errors == [], visit.console_errors[:3]
        assert all("reduce" in snippet.lower() for snippet in snippets), snippets[:3]
        assert not [snippet for snippet in snippets if re.search(r"\\\(|\\\[|\$\$|\\frac|\.pdf", snippet)], snippets
        assert page.locator("ul.search li p.context span.highlighted").count() >= len(snippets)
    finally:
        visit.close()


def _memory_page() -> Path:
    return HTML / "book" / "memory.html"


def test_the_static_memory_calculator_agrees_with_the_course_library(browser):
    """Random models and layouts typed into the page's calculator (context parallelism c > 1 in
    the first case and most others): every number it shows equals dtp.memory.calculator's, to the byte;
    a context-parallel size that is no whole number, or does not divide the sequence, is named and
    nothing is computed for it."""
    import numpy as np

    from dtp.memory import formulas as memory
    from dtp.memory.calculator import Layout, memory_per_gpu
    from dtp.common.gpt import GPTConfig

    visit = PageVisit(browser, _memory_page().as_uri(), "file://")
    page, rng = visit.page, np.random.default_rng(2026)
    try:
        calculator = page.locator(".course-memory-calculator")
        assert calculator.count() == 1, "the memory page has no static calculator"
        for case in range(12):
            heads = int(rng.choice([8, 16, 32, 64, 96]))
            stages = int(rng.choice([1, 2, 4, 8]))
            values = dict(layers=int(rng.integers(stages, 120)), hidden=heads * int(rng.choice([64, 128])), heads=heads,
                          seq=int(rng.choice([512, 1024, 2048, 4096, 8192])), vocab=int(rng.integers(1000, 256000)),
                          micro_batch=int(rng.integers(1, 9)), tp=int(rng.choice([1, 2, 4, 8])),
                          pp=stages, dp=int(rng.choice([1, 2, 8, 64, 1024])),
                          cp=int(rng.choice([1, 2, 4, 8, 16])) if case else 4)
            recipe, stage = str(rng.choice(list(memory.RECIPES))), int(rng.integers(0, 4))
            recompute, sp = str(rng.choice(list(memory.RECOMPUTE))), bool(rng.integers(0, 2))
            for name, value in values.items():
                calculator.locator(f"input[name={name}]").fill(str(value))
            calculator.locator("select[name=recipe]").select_option(recipe)
            calculator.locator("select[name=zero]").select_option(str(stage))
            calculator.locator("select[name=recompute]").select_option(recompute)
            calculator.locator("input[name=sp]").set_checked(sp)
            config = GPTConfig(vocab_size=values["vocab"], n_positions=values["seq"], n_layers=values["layers"],
                               hidden=values["hidden"], n_heads=heads)
            layout = Layout(values["tp"], values["pp"], values["dp"], stage, sp, recompute, values["micro_batch"],
                            context_parallel=values["cp"])
            shown = float(calculator.locator("[data-output=parameters]").get_attribute("data-value"))
            assert shown == memory.gpt_parameter_count(config)
            for pipeline_stage in ("first", "last"):
                expected = memory_per_gpu(config, recipe, layout, pipeline_stage)
                for component, value in {**expected, "total": sum(expected.values())}.items():
                    cell = calculator.locator(f'[data-stage={pipeline_stage}][data-component="{component}"]')
                    assert float(cell.get_attribute("data-bytes")) == pytest.approx(value, rel=1e-12, abs=1e-6), \
                        (component, pipeline_stage, values, recipe, stage, recompute, sp)
        calculator.locator("input[name=seq]").fill("4096")
        for bad, problem in (("0", "context parallel c must be a whole number"), ("1.5", "context parallel c must be"),
                             ("3", "c must divide s")):
            calculator.locator("input[name=cp]").fill(bad)
            assert problem in calculator.locator(".calculator-problems").inner_text(), bad
            shown = calculator.locator("table").inner_text()
            assert "Infinity" not in shown and "NaN" not in shown and "fits" not in shown and "needs" not in shown, shown
        calculator.locator("input[name=cp]").fill("2")
        assert calculator.locator(".calculator-problems").inner_text().strip() == ""
        assert visit.console_errors == [] and visit.outside_requests == []
    finally:
        visit.close()


@pytest.mark.parametrize("field, value, problem", [
    ("dp", "", "data parallel N_d must be a whole number"), ("dp", "0", "data parallel N_d must be a whole number"),
    ("layers", "2.5", "layers L must be a whole number"), ("tp", "-4", "tensor parallel t must be a whole number"),
    ("tp", "5", "t must divide a"), ("pp", "200", "more pipeline stages than layers")])
def test_the_static_memory_calculator_names_bad_input_and_computes_nothing(browser, field, value, problem):
    visit = PageVisit(browser, _memory_page().as_uri(), "file://")
    try:
        calculator = visit.page.locator(".course-memory-calculator")
        calculator.locator(f"input[name={field}]").fill(value)
        assert problem in calculator.locator(".calculator-problems").inner_text()
        shown = calculator.locator("table").inner_text()
        assert "Infinity" not in shown and "NaN" not in shown and "fits" not in shown and "needs" not in shown, shown
        calculator.locator("input[name=dp]").fill("16")  # fixing the input brings the numbers back
        calculator.locator("input[name=tp]").fill("8")
        calculator.locator("input[name=pp]").fill("8")
        calculator.locator("input[name=layers]").fill("96")
        assert calculator.locator(".calculator-problems").inner_text().strip() == ""
        assert "fits" in calculator.locator("table").inner_text() or "needs" in calculator.locator("table").inner_text()
        assert visit.console_errors == []
    finally:
        visit.close()


def test_the_memory_calculator_presets_are_named_by_their_parameter_count(browser):
    """Each preset's label states the parameter count the calculator then shows (a "70B" label on a
    64.7B shape misled readers), and the bars have a legend for every colour."""
    from dtp.memory.calculator import PRESETS

    visit = PageVisit(browser, _memory_page().as_uri(), "file://")
    try:
        calculator = visit.page.locator(".course-memory-calculator")
        for field in ("tp", "pp"):  # a layout every preset admits (t divides the heads, p <= L)
            calculator.locator(f"input[name={field}]").fill("1")
        for name in PRESETS:
            calculator.locator("select[name=preset]").select_option(name)
            shown = float(calculator.locator("[data-output=parameters]").get_attribute("data-value"))
            label = re.search(r"\(([0-9.]+)([MB]) parameters\)", name)
            assert label, name
            assert shown == pytest.approx(float(label.group(1)) * (1e6 if label.group(2) == "M" else 1e9), rel=0.005), name
        colours = calculator.locator(".calculator-bar span").evaluate_all(
            "spans => [...new Set(spans.map(s => s.className).filter(c => c.startsWith('calculator-bar-')))]")
        keyed = calculator.locator(".calculator-legend i").evaluate_all("keys => keys.map(k => k.className)")
        assert colours and set(colours) <= set(keyed), (colours, keyed)
    finally:
        visit.close()


def test_the_static_pipeline_explorer_agrees_with_the_course_library(browser):
    """Random schedules, sizes and message times in the page's explorer: every op's start and
    end, the makespan, both bubbles and the peaks equal dtp.pp.schedules's."""
    import json

    import numpy as np

    from dtp.pp import schedules as pipeline

    visit = PageVisit(browser, (HTML / "book" / "pipeline_parallel.html").as_uri(), "file://")
    page, rng = visit.page, np.random.default_rng(1130)
    try:
        explorer = page.locator(".course-pipeline-explorer")
        assert explorer.count() == 1, "the pipeline page has no static explorer"
        for _ in range(12):
            name = str(rng.choice(list(pipeline.SCHEDULES)))
            p = int(rng.integers(1, 9))
            m = p * int(rng.integers(1, 4)) if name == "interleaved 1F1B" else int(rng.integers(1, 17))
            v, message = int(rng.integers(1, 5)), float(rng.choice([0.0, 0.05, 0.3]))
            explorer.locator("select[name=schedule]").select_option(name)
            for field, value in (("p", p), ("m", m), ("v", v), ("p2p", message)):
                explorer.locator(f"input[name={field}]").fill(str(value))
            shown = json.loads(explorer.get_attribute("data-timeline"))
            expected = json.loads(pipeline.timeline_json(name, p, m, v, p2p_time=message))
            case = (name, p, m, v, message)
            for key in ("makespan", "bubble_fraction", "bubble_over_ideal"):
                assert shown[key] == pytest.approx(expected[key], rel=1e-12, abs=1e-12), (key, case)
            assert shown["peak_in_flight"] == expected["peak_in_flight"], case
            assert len(shown["ops"]) == len(expected["ops"]), case
            for mine, theirs in zip(shown["ops"], expected["ops"]):
                assert {k: mine[k] for k in ("stage", "kind", "micro_batch", "chunk")} == \
                    {k: theirs[k] for k in ("stage", "kind", "micro_batch", "chunk")}, case
                assert (mine["start"], mine["end"]) == pytest.approx((theirs["start"], theirs["end"]), abs=1e-9), case
        assert visit.console_errors == [] and visit.outside_requests == []
    finally:
        visit.close()
