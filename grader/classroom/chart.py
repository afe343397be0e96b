"""The summary's chart: per exercise, how many students passed, failed, ... as stacked bars, drawn
with matplotlib into a PNG that the HTML page embeds (no file beside it, nothing fetched). Points
are all or nothing, so an exercise's score distribution is exactly these counts."""
from __future__ import annotations

import base64
import io

# The order of the segments, and colours told apart also without colour vision (Okabe and Ito's palette).
OUTCOME_COLOURS = {"passed": "#009E73", "failed": "#D55E00", "error": "#E69F00", "timeout": "#CC79A7",
                   "missing": "#56B4E9", "not handed in": "#BBBBBB"}


def outcome_chart(counts: list[tuple[str, dict[str, int]]]) -> tuple[str, str]:
    """(the PNG as base64, its alt text) for [(exercise id, {outcome: students})]."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = [exercise_id for exercise_id, _ in counts]
    figure = Figure(figsize=(8, 1.4 + 0.3 * len(names)), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    rows = list(range(len(names)))
    left = [0] * len(names)
    for outcome, colour in OUTCOME_COLOURS.items():
        widths = [by_outcome.get(outcome, 0) for _, by_outcome in counts]
        if any(widths):
            axes.barh(rows, widths, left=left, color=colour, label=outcome, height=0.7)
            left = [start + width for start, width in zip(left, widths)]
    axes.set_yticks(rows, names)
    axes.invert_yaxis()  # the first exercise on top, as in the table
    axes.set_xlabel("students")
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.spines[["top", "right"]].set_visible(False)
    figure.legend(loc="outside lower center", ncols=6, frameon=False)
    png = io.BytesIO()
    figure.savefig(png, format="png", metadata={"Software": None})  # the same counts give the same bytes
    return base64.b64encode(png.getvalue()).decode("ascii"), alt_text(counts)


def alt_text(counts: list[tuple[str, dict[str, int]]]) -> str:
    parts = []
    for exercise_id, by_outcome in counts:
        listed = ", ".join(f"{by_outcome[o]} {o}" for o in OUTCOME_COLOURS if by_outcome.get(o))
        parts.append(f"{exercise_id}: {listed or 'no student'}")
    return "Stacked bars of students per exercise by outcome. " + "; ".join(parts) + "."
