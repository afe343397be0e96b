"""Figures of pipeline schedules: Gantt charts, activations held over time, measured bubbles.

Every figure is drawn from `dtp.pp.schedules` timelines (or from timelines measured on real
processes), so the book, the notebook's explorer and the checks show the same schedules.
matplotlib is imported when a figure is drawn, not with this module: the notebook imports this
module, and the grader runs the notebook's imports once per exercise.
"""
from __future__ import annotations

import numpy as np

from dtp.pp import schedules as pipeline


def _pyplot():
    import matplotlib.pyplot as plt

    return plt

KIND_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868"}
# The book's column is about 680 px wide and figures are drawn at 100 dpi: a figure this wide is
# shown at its own size, so a font of FONT_PT points is FONT_PT * 100/72 px (8 pt: 11 px).
COLUMN_WIDTH_IN = 6.8
FONT_PT = 8


def _luminance(colour) -> float:
    """WCAG relative luminance of a colour."""
    from matplotlib.colors import to_rgb

    channels = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in to_rgb(colour)]
    return 0.2126 * channels[0] + 0.7152 * channels[1] + 0.0722 * channels[2]


def contrast_ratio(foreground, background) -> float:
    """WCAG contrast ratio between two colours (1 to 21; 4.5 is the minimum for normal text)."""
    light, dark = sorted((_luminance(foreground), _luminance(background)), reverse=True)
    return (light + 0.05) / (dark + 0.05)


def label_colour(background) -> str:
    """Black or white, whichever reads better on `background`."""
    return max(("black", "white"), key=lambda colour: contrast_ratio(colour, background))
KIND_LABELS = {"F": "F: forward", "B": "B: backward (input gradient when W is split off)",
               "W": "W: weight gradient"}


def timeline_rows(timeline: pipeline.Timeline) -> list[list[tuple]]:
    """Per stage, (kind, micro-batch, chunk, start, end) of every op."""
    return [[(op[0], op[1], op[2], start, end) for op, start, end in zip(ops, starts, ends)]
            for ops, starts, ends in zip(timeline.schedule, timeline.start, timeline.end)]


def draw_gantt(axis, rows: list[list[tuple]], *, label_ops: bool = True, min_label_width: float = 0.0) -> None:
    """One row of bars per stage (stage 0 on top): colour by kind, the micro-batch's number in
    the bar on a solid patch of the bar's colour in black or white, whichever contrasts more (so
    the hatching of an odd-numbered chunk never runs through it), bars narrower than
    `min_label_width` (in data units) left unlabelled."""
    for stage, ops in enumerate(rows):
        for kind, micro_batch, chunk, start, end in ops:
            colour = KIND_COLOURS[kind]
            axis.barh(stage, end - start, left=start, height=0.8, color=colour, edgecolor="white",
                      linewidth=0.6, hatch="//" if chunk % 2 else None)
            if label_ops and end - start > 0 and end - start >= min_label_width:
                axis.text((start + end) / 2, stage, str(micro_batch), ha="center", va="center", fontsize=FONT_PT,
                          color=label_colour(colour),
                          bbox=dict(boxstyle="square,pad=0.1", facecolor=colour, edgecolor="none"))
    axis.set_yticks(range(len(rows)), [f"stage {s}" for s in range(len(rows))], fontsize=FONT_PT)
    axis.tick_params(axis="x", labelsize=FONT_PT)
    axis.set_ylim(len(rows) - 0.5, -0.5)
    axis.grid(True, axis="x", alpha=0.3)


def _legend(figure, kinds: set, interleaved: bool) -> None:
    plt = _pyplot()
    handles = [plt.Rectangle((0, 0), 1, 1, color=KIND_COLOURS[k]) for k in "FBW" if k in kinds]
    labels = [KIND_LABELS[k] for k in "FBW" if k in kinds]
    if interleaved:
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="gray", hatch="//"))
        labels.append("odd-numbered chunk (interleaved)")
    figure.legend(handles, labels, loc="lower center", ncol=2, frameon=False, fontsize=FONT_PT)


def gantt_figure(timelines: dict, time_unit: str = "time (units of one forward pass, t_F = 1)"):
    """Gantt charts of several timelines (label -> Timeline) on one shared time axis, each titled
    with its bubble fraction and its stages' peak activations."""
    plt = _pyplot()
    figure, axes = plt.subplots(len(timelines), 1, figsize=(COLUMN_WIDTH_IN, 1.2 + 0.36 * sum(
        len(t.schedule) for t in timelines.values()) + 0.5 * len(timelines)), sharex=True, squeeze=False)
    kinds, interleaved = set(), False
    span = max(t.makespan for t in timelines.values())
    for axis, (label, timeline) in zip(axes[:, 0], timelines.items()):
        # a number (about 7 px wide at FONT_PT) fits a bar at least 1/45 of the ~580 px axis wide
        draw_gantt(axis, timeline_rows(timeline), min_label_width=span / 45)
        axis.set_title(f"{label}: bubble {timeline.bubble_fraction:.1%} of the step, peak activations per stage "
                       f"{timeline.peak_in_flight}", fontsize=FONT_PT, loc="left")
        kinds |= {op[0] for ops in timeline.schedule for op in ops}
        interleaved |= pipeline.chunk_count(timeline.schedule) > 1
    axes[-1, 0].set_xlabel(time_unit, fontsize=FONT_PT)
    _legend(figure, kinds, interleaved)
    figure.tight_layout(rect=(0, 0.55 / figure.get_figheight(), 1, 1))  # room for two rows of legend
    plt.close(figure)  # glue and display show it; keep it out of the cell's own output
    return figure


def in_flight_figure(timelines: dict, time_unit: str = "time (units of one forward pass, t_F = 1)"):
    """Activation sets each stage holds over time, one panel per timeline (label -> Timeline)."""
    plt = _pyplot()
    # at most two panels a row, the column's width across: every label stays >= 9 px on the page
    columns = min(2, len(timelines))
    rows = -(-len(timelines) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(COLUMN_WIDTH_IN, 0.6 + 2.4 * rows), sharey=True, squeeze=False)
    for axis in axes.flat[len(timelines):]:
        axis.set_visible(False)
    for axis, (label, timeline) in zip(axes.flat, timelines.items()):
        p = len(timeline.schedule)
        colours = plt.cm.viridis(np.linspace(0, 0.9, p))
        for stage in range(p):
            times, counts = pipeline.in_flight_over_time(timeline, stage)
            axis.step(times + [timeline.makespan], counts + [counts[-1]], where="post", color=colours[stage],
                      label=f"stage {stage}")
        axis.set_title(label, fontsize=FONT_PT + 1)
        axis.set_xlabel(time_unit if len(timelines) == 1 else "time (t_F = 1)", fontsize=FONT_PT)
        axis.tick_params(labelsize=FONT_PT)
        axis.grid(True, alpha=0.3)
    for axis in axes[:, 0]:
        axis.set_ylabel("activation sets held\n(chunk sets if interleaved)", fontsize=FONT_PT)
    axes[0, -1].legend(fontsize=FONT_PT)
    figure.tight_layout()
    plt.close(figure)
    return figure


def measured_bubble_figure(p: int, micro_batches: list, measured: list, replayed: list | None = None):
    """Wall-clock bubble of a real pipeline (machine-dependent) against (p-1)/(m+p-1), and, when
    given, the bubble of the same runs replayed on the grader's logical clock."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(COLUMN_WIDTH_IN, 3.8))
    dense = np.arange(1, max(micro_batches) + 1)
    formula = np.array([pipeline.bubble_fraction(p, m) for m in dense])
    axis.plot(dense, 100 * formula, color="gray", label="(p-1)/(m+p-1)")
    axis.plot(micro_batches, [100 * b for b in measured], "o", color="#c44e52", label="wall clock, sleeping stages")
    if replayed is not None:
        axis.plot(micro_batches, [100 * b for b in replayed], "x", color="#4c72b0", markersize=9,
                  label="replayed on the logical clock (the grader's)")
    axis.set_xscale("log", base=2)
    axis.set_xticks(micro_batches, [str(m) for m in micro_batches])
    axis.set_xlabel("micro-batches per step, m")
    axis.set_ylabel("bubble (% of p × step time)")
    axis.set_title(f"1F1B on {p} processes, compute replaced by sleeps", fontsize=10)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    plt.close(figure)
    return figure


def measured_gantt_figure(logs: list, title: str):
    """Gantt chart of a measured run: logs[s] lists (kind, micro-batch, start, end) in seconds."""
    plt = _pyplot()
    origin = min(start for log in logs for _, _, start, _ in log)
    rows = [[(kind, mb, 0, 1e3 * (start - origin), 1e3 * (end - origin)) for kind, mb, start, end in log]
            for log in logs]
    figure, axis = plt.subplots(figsize=(COLUMN_WIDTH_IN, 1.0 + 0.45 * len(logs)))
    span = max(end for ops in rows for *_, end in ops)
    draw_gantt(axis, rows, min_label_width=span / 45)
    axis.set_xlabel("wall-clock time since the first op started (ms)", fontsize=FONT_PT)
    axis.set_title(title, fontsize=FONT_PT, loc="left")
    _legend(figure, {kind for log in logs for kind, *_ in log}, False)
    figure.tight_layout(rect=(0, 0.55 / figure.get_figheight(), 1, 1))
    plt.close(figure)
    return figure
