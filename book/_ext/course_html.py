"""Sphinx extension for the course's HTML: a book that works offline, from file:// or any static server.

- Thebe (running code cells on a remote Binder kernel) needs the network and is not used here;
  Jupyter Book still adds its loader, twice, which logs a console error on every page. Its
  scripts are dropped.
- The course's stylesheet is added (tables scroll inside the text column, nothing scrolls
  sideways on a phone).
- Search results get their snippets from the book itself. Sphinx's search page fetches each
  result's HTML to cut a snippet from it: a browser refuses that on file:// (titles only, and a
  CORS error per result), and over http the snippet shows the page's raw TeX and its header
  buttons. Instead, the text of every page is written at build time, math made readable, into
  `_static/course_search_text.js`, which `course_search.js` loads on the search page only (a
  script, unlike a fetch, loads from file://). Sphinx's own fetch is switched off in
  _config.yml (`html_show_search_summary: false`).
"""
from __future__ import annotations

import html.parser
import json
import re
from pathlib import Path

STATIC = Path(__file__).resolve().parent.parent / "_static"
SEARCH_TEXT_FILE = "course_search_text.js"

# TeX commands the book's formulas use, as the characters a reader sees.
_TEX_SYMBOLS = {
    "cdot": "·", "times": "×", "le": "≤", "leq": "≤", "ge": "≥", "geq": "≥", "approx": "≈", "neq": "≠",
    "alpha": "α", "beta": "β", "gamma": "γ", "Psi": "Ψ", "psi": "ψ", "Phi": "Φ", "phi": "φ", "sigma": "σ",
    "mu": "μ", "lambda": "λ", "theta": "θ", "sum": "Σ", "infty": "∞", "to": "→", "rightarrow": "→",
    "lceil": "⌈", "rceil": "⌉", "lfloor": "⌊", "rfloor": "⌋", "ldots": "…", "dots": "…", "in": "∈",
}

# Commands a reader sees as words; any other command (\underbrace, \mathcal, ...) only shapes the
# formula and is dropped.
_TEX_WORDS = {"log", "ln", "exp", "max", "min", "sqrt", "sin", "cos", "lim", "mod", "arg", "softmax"}


def readable_tex(tex: str) -> str:
    """A formula's TeX as plain text a reader can follow in a search snippet: (S/n) rather than
    \\(S/n\\), (a)/(b) for fractions, symbols as characters, no braces or spacing commands."""
    tex = re.sub(r"^\s*(\\\(|\\\[|\$\$?)|(\\\)|\\\]|\$\$?)\s*$", "", tex.strip())
    for _ in range(3):  # nested fractions, innermost first
        tex = re.sub(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", tex)
    tex = re.sub(r"\\(?:text|mathrm|mathbf|operatorname|textrm|mathit)\{([^{}]*)\}", r"\1", tex)
    tex = re.sub(r"\\(left|right|big|Big|bigg|Bigg)\b", "", tex)
    tex = re.sub(r"\\[,;:! ]|~", " ", tex)
    tex = re.sub(r"\\([_%#&$])", r"\1", tex)  # escaped characters: \_ is an underscore
    tex = re.sub(r"\\([A-Za-z]+)", lambda m: _TEX_SYMBOLS.get(m.group(1), m.group(1) if m.group(1) in _TEX_WORDS else ""), tex)
    tex = tex.replace("{", "").replace("}", "").replace("&", " ").replace("\\\\", " ")
    return re.sub(r"\s+", " ", tex).strip()


class _PageText(html.parser.HTMLParser):
    """The text a reader sees in a page body: no scripts, styles or permalink markers; formulas
    through `readable_tex`; a table row as "header: value, header: value;" (a table flattened into
    a run of words reads as nonsense in a snippet); and where each section (an element with an id)
    begins, so that a result that links to a section gets its snippet from that section."""

    _SKIPPED = {"script", "style"}
    _BLOCKS = {"p", "div", "li", "ul", "ol", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "td", "th", "tr",
               "table", "section", "pre", "blockquote", "figure", "figcaption", "br", "hr"}
    _ANCHOR = "\x01{}\x02"  # where a section begins, until `text()` turns the marks into offsets

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self._skip_depth = 0  # inside a skipped element
        self._math_depth = 0  # inside a formula: its TeX is collected whole
        self._math: list[str] = []
        self._stack: list[tuple[str, bool, bool]] = []
        self._tables: list[dict] = []  # the tables we are in: header cells, the row so far, the open cell

    def _sink(self) -> list[str]:
        table = self._tables[-1] if self._tables else None
        return table["cell"] if table and table["cell"] is not None else self.parts

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag in self._BLOCKS:
            self._sink().append(" ")
        if attributes.get("id") and tag in ("section", "h1", "h2", "h3", "h4", "span", "div") and not self._tables:
            self.parts.append(self._ANCHOR.format(attributes["id"]))
        if tag == "table":
            self._tables.append({"headers": [], "row": [], "cell": None, "head": False, "all_th": True})
        elif self._tables and tag == "thead":
            self._tables[-1]["head"] = True
        elif self._tables and tag == "tr":
            self._tables[-1]["all_th"] = True
        elif self._tables and tag in ("td", "th"):
            self._tables[-1]["cell"] = []
            self._tables[-1]["all_th"] &= tag == "th"
        if tag in ("br", "img", "hr", "input", "meta", "link", "wbr"):
            return
        classes = (attributes.get("class") or "").split()
        skip = tag in self._SKIPPED or "headerlink" in classes
        math = "math" in classes and not self._math_depth
        self._stack.append((tag, skip, math))
        self._skip_depth += skip
        self._math_depth += math

    def handle_endtag(self, tag):
        while self._stack:
            opened, skip, math = self._stack.pop()
            self._skip_depth -= skip
            if math:
                self._math_depth -= 1
                self._sink().append(" " + readable_tex("".join(self._math)) + " ")
                self._math = []
            if opened == tag:
                break
        if tag in self._BLOCKS:
            self._sink().append(" ")
        if not self._tables:
            return
        table = self._tables[-1]
        if tag in ("td", "th") and table["cell"] is not None:
            table["row"].append(re.sub(r"\s+", " ", "".join(table["cell"])).strip())
            table["cell"] = None
        elif tag == "thead":
            table["head"] = False
        elif tag == "tr":
            row, table["row"] = table["row"], []
            if table["head"] or (table["all_th"] and not table["headers"]):
                table["headers"] = row
            elif len(row) == len(table["headers"]):
                self.parts.append(" " + ", ".join(f"{h}: {v}" if h else v for h, v in zip(table["headers"], row)) + ";")
            else:
                self.parts.append(" " + ", ".join(row) + ";")
        elif tag == "table":
            self._tables.pop()

    def handle_data(self, data):
        if self._skip_depth:
            return
        (self._math if self._math_depth else self._sink()).append(data)

    def text_and_sections(self) -> tuple[str, dict[str, int]]:
        """The text, and the offset in it where each section (by its id) begins."""
        marked = re.sub(r"\s+", " ", "".join(self.parts)).strip()
        text, sections, last = [], {}, 0
        for match in re.finditer("\x01([^\x02]*)\x02 ?", marked):
            text.append(marked[last:match.start()])
            sections.setdefault(match.group(1), len("".join(text)))
            last = match.end()
        text.append(marked[last:])
        return "".join(text).strip(), sections

    def text(self) -> str:
        return self.text_and_sections()[0]


def page_text(body_html: str) -> str:
    return page_text_and_sections(body_html)[0]


def page_text_and_sections(body_html: str) -> tuple[str, dict[str, int]]:
    parser = _PageText()
    parser.feed(body_html)
    parser.close()
    return parser.text_and_sections()


def _drop_thebe(app, pagename, templatename, context, doctree):
    def is_thebe(script) -> bool:
        filename = getattr(script, "filename", None) or ""
        body = getattr(script, "attributes", {}).get("body", "") or ""
        return "thebe" in filename or "THEBE_JS_URL" in body or "thebe" in body

    if "script_files" in context:
        context["script_files"] = [script for script in context["script_files"] if not is_thebe(script)]
    if "css_files" in context:
        context["css_files"] = [css for css in context["css_files"] if "thebe" not in (getattr(css, "filename", "") or "")]


def _text_store(app) -> Path:
    # Beside Sphinx's own record of the pages, so that a rebuild that writes only the changed pages
    # still has every page's text (and dropping that record drops these too).
    return Path(app.doctreedir) / "course_search_text"


def _remember_text(app, pagename, templatename, context, doctree):
    if doctree is not None and context.get("body"):
        path = _text_store(app) / f"{pagename}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        text, sections = page_text_and_sections(context["body"])
        path.write_text(json.dumps({"text": text, "sections": sections}, ensure_ascii=False), encoding="utf-8")


def _write_search_text(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    store = _text_store(app)
    texts = {name: json.loads((store / f"{name}.json").read_text(encoding="utf-8"))
             for name in sorted(app.env.found_docs) if (store / f"{name}.json").exists()}
    target = Path(app.outdir) / "_static" / SEARCH_TEXT_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("window.COURSE_SEARCH_TEXT = " + json.dumps(texts, ensure_ascii=False) + ";\n", encoding="utf-8")


def setup(app):
    app.config.html_static_path.append(str(STATIC))
    app.add_css_file("course.css")
    app.add_js_file("course_search.js")
    app.connect("html-page-context", _drop_thebe, priority=900)
    app.connect("html-page-context", _remember_text)
    app.connect("build-finished", _write_search_text)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
