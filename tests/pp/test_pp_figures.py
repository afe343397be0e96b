"""The chapter's figures label what they show, and the notebook's schedule explorer redraws
and reports the simulated bubble and memory whenever a control changes."""
import dtp.pp.widgets
from dtp.pp import schedules as pipeline, plots as pipeline_plots


def test_explorer_redraws_and_reports_on_every_change(monkeypatch):
    drawn = []
    monkeypatch.setattr(dtp.pp.widgets, "gantt_figure", lambda timelines: drawn.append(timelines))
    explorer = dtp.pp.widgets.schedule_explorer()
    controls = {child.description: child for box in explorer.children[:2] for child in box.children}
    assert list(drawn[-1]) == ["1F1B"]
    controls["schedule"].value = "GPipe"
    controls["micro-batches m"].value = 16
    assert len(drawn) == 3 and drawn[-1]["GPipe"].peak_in_flight == [16] * 4
    assert explorer.children[2].value.startswith("GPipe, p = 4, m = 16: bubble 15.8% of the step")
    assert "bubble 15.8% of the step" in dtp.pp.widgets.explore("1F1B", 4, 16, 1)[1]
    assert dtp.pp.widgets.explore("interleaved 1F1B", 4, 6, 2) == (
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


COLUMN_PX = 680  # the book's text column; wider figures are scaled down to it


def _texts(figure):
    return [text for text in figure.findobj(lambda artist: hasattr(artist, "get_fontsize") and hasattr(artist, "get_text"))
            if text.get_visible() and text.get_text().strip()]


def test_figure_text_stays_at_least_9_px_in_the_books_column():
    """Issue 21, item 21: figures were drawn 10-13.6 in wide and shown in a 680 px column, which
    shrank their text to about 6 px. At 100 dpi a point is 100/72 px."""
    timelines = {name: pipeline.simulate_named(name, 4, 8, 2) for name in pipeline.SCHEDULES}
    logs = [[("F", k, 0.01 * k, 0.01 * k + 0.005) for k in range(4)] for _ in range(4)]
    for figure in (pipeline_plots.gantt_figure(timelines), pipeline_plots.in_flight_figure(timelines),
                   pipeline_plots.gantt_figure({"1F1B": timelines["1F1B"]}),
                   pipeline_plots.measured_gantt_figure(logs, "a run"),
                   pipeline_plots.measured_bubble_figure(4, [4, 8], [0.44, 0.29])):
        width_px = figure.get_figwidth() * 100
        scale = min(1.0, COLUMN_PX / width_px)
        smallest = min(text.get_fontsize() * 100 / 72 * scale for text in _texts(figure))
        assert smallest >= 9, (figure.get_axes()[0].get_title(loc="left"), smallest)


def test_micro_batch_numbers_contrast_with_their_bar_also_on_hatched_chunks():
    """Issue 21, item 21: a number sits on a solid patch of its bar's colour (hatching never runs
    through it), in black or white, with a WCAG contrast of at least 4.5."""
    figure = pipeline_plots.gantt_figure({"interleaved": pipeline.simulate_named("interleaved 1F1B", 2, 4, 2),
                                          "ZB-H1": pipeline.simulate_named("ZB-H1", 2, 4)})
    labels = [text for axis in figure.get_axes() for text in axis.texts]
    assert labels
    for text in labels:
        patch = text.get_bbox_patch()
        assert patch is not None and patch.get_fill()
        assert pipeline_plots.contrast_ratio(text.get_color(), patch.get_facecolor()) >= 4.5
    assert pipeline_plots.contrast_ratio("white", pipeline_plots.KIND_COLOURS["B"]) < 4.5  # why white was not enough
