"""The chapter's figures label what they show, and the notebook's schedule explorer redraws
and reports the simulated bubble and memory whenever a control changes."""
import dtp.pipeline_widgets
from dtp import pipeline, pipeline_plots


def test_explorer_redraws_and_reports_on_every_change(monkeypatch):
    drawn = []
    monkeypatch.setattr(dtp.pipeline_widgets, "gantt_figure", lambda timelines: drawn.append(timelines))
    explorer = dtp.pipeline_widgets.schedule_explorer()
    controls = {child.description: child for box in explorer.children[:2] for child in box.children}
    assert list(drawn[-1]) == ["1F1B"]
    controls["schedule"].value = "GPipe"
    controls["micro-batches m"].value = 16
    assert len(drawn) == 3 and drawn[-1]["GPipe"].peak_in_flight == [16] * 4
    assert explorer.children[2].value.startswith("GPipe, p = 4, m = 16: bubble 15.8% of the step")
    assert "bubble 15.8% of the step" in dtp.pipeline_widgets.explore("1F1B", 4, 16, 1)[1]
    assert dtp.pipeline_widgets.explore("interleaved 1F1B", 4, 6, 2) == (
        None, "interleaved 1F1B needs m to be a multiple of p: m = 6, p = 4")


def test_figures_label_their_axes():
    timelines = {name: pipeline.simulate_named(name, 2, 4, 2) for name in pipeline.SCHEDULES}
    for figure in (pipeline_plots.gantt_figure(timelines), pipeline_plots.in_flight_figure(timelines),
                   pipeline_plots.measured_bubble_figure(4, [4, 8], [0.44, 0.29])):
        axes = figure.get_axes()
        assert axes[-1].get_xlabel() and any(axis.get_ylabel() or axis.get_yticklabels() for axis in axes)
    gantt = pipeline_plots.gantt_figure(timelines)
    assert "ZB-H1: bubble" in gantt.get_axes()[-1].get_title(loc="left")
    logs = [[("F", 0, 1.0, 1.05), ("B", 0, 1.2, 1.3)], [("F", 0, 1.06, 1.11), ("B", 0, 1.11, 1.19)]]
    assert "ms" in pipeline_plots.measured_gantt_figure(logs, "a run").get_axes()[0].get_xlabel()
