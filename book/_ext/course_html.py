"""Sphinx extension for the course's HTML: a book that works offline, from file:// or any static server.

- Thebe (running code cells on a remote Binder kernel) needs the network and is not used here;
  Jupyter Book still adds its loader, twice, which logs a console error on every page. Its
  scripts are dropped.
- The course's stylesheet is added (tables scroll inside the text column).
"""
from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).resolve().parent.parent / "_static"


def _drop_thebe(app, pagename, templatename, context, doctree):
    def is_thebe(script) -> bool:
        filename = getattr(script, "filename", None) or ""
        body = getattr(script, "attributes", {}).get("body", "") or ""
        return "thebe" in filename or "THEBE_JS_URL" in body or "thebe" in body

    if "script_files" in context:
        context["script_files"] = [script for script in context["script_files"] if not is_thebe(script)]
    if "css_files" in context:
        context["css_files"] = [css for css in context["css_files"] if "thebe" not in (getattr(css, "filename", "") or "")]


def setup(app):
    app.config.html_static_path.append(str(STATIC))
    app.add_css_file("course.css")
    app.connect("html-page-context", _drop_thebe, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
