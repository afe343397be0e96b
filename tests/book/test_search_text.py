"""The text the book's search shows in its snippets (book/_ext/course_html.py): what a reader
sees on the page, formulas readable without MathJax, no scripts or permalink markers."""
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "book" / "_ext"))
from course_html import page_text, readable_tex  # noqa: E402


def test_formulas_read_as_plain_text():
    assert readable_tex(r"\(2\frac{n-1}{n} \cdot S\)") == "2(n-1)/(n) · S"
    assert readable_tex(r"\[ \frac{\frac{a}{b}}{c} \le \Psi \]") == "((a)/(b))/(c) ≤ Ψ"
    assert readable_tex(r"\(\sum_{r=1}^{t} \underbrace{\text{GeLU}(XA_r)}_{Z_r} \log n\)") == "Σ_r=1^t GeLU(XA_r)_Z_r log n"
    assert readable_tex(r"$$\left\lceil \mathrm{cf} \cdot T k / E \right\rceil$$") == "⌈ cf · T k / E ⌉"
    assert readable_tex(r"\(T_\mathrm{expert\_dp} + 5\%\)") == "T_expert_dp + 5%"


def test_page_text_keeps_what_a_reader_sees():
    body = ('<section><h1>Ring<a class="headerlink" href="#ring">#</a></h1><p>Each rank sends '
            '<span class="math notranslate nohighlight">\\(S/n\\)</span> bytes.</p>'
            '<script>var hidden = 1;</script><style>p {}</style><ul><li>one</li><li>two</li></ul></section>')
    assert page_text(body) == "Ring Each rank sends S/n bytes. one two"


def test_a_table_reads_as_labelled_rows():
    body = ('<table><thead><tr><th><p>model</p></th><th><p><span class="math">\\(L\\)</span></p></th></tr></thead>'
            '<tbody><tr><td><p>GPT-2 small</p></td><td><p>12</p></td></tr>'
            '<tr><td><p>GPT-3</p></td><td><p>96</p></td></tr></tbody></table><p>After.</p>')
    assert page_text(body) == "model: GPT-2 small, L: 12; model: GPT-3, L: 96; After."


def test_sections_are_located_in_the_text():
    from course_html import page_text_and_sections

    body = ('<section id="ring"><h1>Ring</h1><p>Intro.</p><section id="cost"><h2>Cost</h2><p>Bytes '
            '<span class="math">\\(S\\)</span>.</p></section></section>')
    text, sections = page_text_and_sections(body)
    assert text == "Ring Intro. Cost Bytes S ."
    assert text[sections["ring"]:].startswith("Ring") and text[sections["cost"]:].startswith("Cost Bytes")
