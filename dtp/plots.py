"""Figures the book draws from build-time measurements."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from . import costs


def bandwidth_figure(curves: dict[str, tuple[int, list[float]]], sizes_bytes, model=None):
    """Bus bandwidth against message size: `curves` maps a label to (ranks n, times in seconds,
    one per size). `model` = (n, alpha seconds, bandwidth bytes/s) adds a fitted alpha-beta
    model as a dashed line."""
    figure, axis = plt.subplots(figsize=(7.5, 4.2))
    sizes = np.asarray(sizes_bytes, dtype=float)
    for label, (n, times) in curves.items():
        busbw = [costs.bus_bandwidth(s, t, n) / 1e9 for s, t in zip(sizes, times)]
        axis.plot(sizes, busbw, marker="o", linestyle="-" if n == 2 else ":", label=label)
    if model is not None:
        n, alpha, beta = model
        dense = np.geomspace(sizes[0], sizes[-1], 100)
        fitted = [costs.bus_bandwidth(s, costs.ring_all_reduce_time(n, s, alpha, beta), n) / 1e9 for s in dense]
        axis.plot(dense, fitted, linestyle="--", color="gray", label=f"alpha-beta model fitted to the ring, {n} processes")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("message size S (bytes, log scale)")
    axis.set_ylabel("bus bandwidth (GB/s, log scale)")
    axis.set_title("All-reduce on gloo processes (CPU, loopback)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend(fontsize="small")
    figure.tight_layout()
    plt.close(figure)  # glue displays it; keep it out of the cell's own output
    return figure


def exposed_communication_figure(variants: dict[str, dict[str, float]]):
    """Per variant, one bar: backward time, then the communication still running after it."""
    figure, axis = plt.subplots(figsize=(7.5, 0.9 + 0.6 * len(variants)))
    for row, (label, timing) in enumerate(variants.items()):
        backward, exposed = timing["backward_s"] * 1e3, timing["exposed_s"] * 1e3
        axis.barh(row, backward, color="#4c72b0", label="backward" if row == 0 else None)
        axis.barh(row, exposed, left=backward, color="#c44e52", label="exposed communication" if row == 0 else None)
        axis.text(backward + exposed, row, f" {backward + exposed:.1f} ms", va="center")
    axis.set_yticks(range(len(variants)), list(variants))
    axis.invert_yaxis()
    axis.set_xlabel("time per training step (ms, median over steps, slowest rank)")
    axis.set_xlim(0, max(t["backward_s"] + t["exposed_s"] for t in variants.values()) * 1e3 * 1.25)
    axis.legend(loc="lower right", fontsize="small")
    figure.tight_layout()
    plt.close(figure)
    return figure


MEMORY_COLOURS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868", "activations": "#c44e52",
                  "logits": "#8172b3"}
MEMORY_LABELS = {"logits": "logits (fp32)"}


def memory_breakdown_figure(breakdowns: dict[str, dict[str, float]], device: str = "A100 80GB"):
    """One GPU's memory (GB = 10⁹ bytes) for each labelled set-up, as stacked bars on one shared
    linear axis (so that a 157 GB bar is drawn a seventh as long as a 1133 GB one), each labelled
    with its total, and the capacity of `device` (a key of dtp.memory.GPU_MEMORY_MIB) dashed. The
    legend names only the parts some bar has."""
    from .memory import GPU_MEMORY_MIB

    device_bytes = GPU_MEMORY_MIB[device] * 2**20
    device_gb = device_bytes / 1e9
    drawn = [component for component in MEMORY_COLOURS if any(b.get(component, 0.0) > 0 for b in breakdowns.values())]
    largest = max([sum(b.get(c, 0.0) for c in MEMORY_COLOURS) / 1e9 for b in breakdowns.values()] + [device_gb])
    figure, axes = plt.subplots(len(breakdowns), 1, figsize=(8, 1.1 * len(breakdowns) + 0.9), squeeze=False,
                                sharex=True)
    for axis, (label, breakdown) in zip(axes[:, 0], breakdowns.items()):
        left = 0.0
        for component in drawn:
            width = breakdown.get(component, 0.0) / 1e9
            axis.barh(0, width, left=left, color=MEMORY_COLOURS[component], label=MEMORY_LABELS.get(component, component))
            left += width
        axis.axvline(device_gb, color="black", linestyle="--", linewidth=1)
        axis.set_xlim(0, largest * 1.2)
        axis.text(left, 0, f" {left:,.1f} GB", va="center")
        axis.set_yticks([0], [label])
    axes[-1, 0].set_xlabel(f"GB per GPU (dashed: an {device}, {GPU_MEMORY_MIB[device]:,} MiB = {device_gb:.1f} GB)")
    handles, names = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, names, loc="upper center", ncol=max(len(names), 1), frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.9))
    plt.close(figure)
    return figure


def parallelism_map_figure(dp: int = 2, pp: int = 2, tp: int = 2):
    """The course on one picture: dp·pp·tp GPUs in dp nodes (tensor parallelism innermost, data
    parallelism outermost), the groups each dimension forms, the collective each needs and the
    link it rides. Rank r has coordinates tp = r mod tp, pp = (r // tp) mod pp, dp = r // (tp·pp).
    Expert parallelism is drawn carved out of the data-parallel groups."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    per_node = pp * tp
    figure, axis = plt.subplots(figsize=(10, 7.4))
    width, height, gap, node_gap, row = 2.1, 0.95, 0.5, 1.3, 1.9
    node_width = tp * (width + gap) - gap
    stage_colours = ["#dbe9f6", "#fde2cf", "#dff0d8", "#eadcf2"]
    centres = {}
    for node in range(dp):
        x0 = node * (node_width + node_gap)
        axis.add_patch(FancyBboxPatch((x0 - 0.3, -0.75), node_width + 0.6, pp * row + 0.25,
                                      boxstyle="round,pad=0.05", facecolor="none", edgecolor="#777777"))
        axis.text(x0 - 0.25, pp * row - 0.35, f"node {node}: GPUs linked by NVLink", fontsize=9, color="#555555")
        for stage in range(pp):
            for shard in range(tp):
                rank = node * per_node + stage * tp + shard
                x, y = x0 + shard * (width + gap), (pp - 1 - stage) * row
                axis.add_patch(FancyBboxPatch((x, y), width, height, boxstyle="round,pad=0.03",
                                              facecolor=stage_colours[stage % 4], edgecolor="#333333"))
                axis.text(x + width / 2, y + height / 2, f"GPU {rank}\nPP stage {stage} · TP shard {shard}",
                          ha="center", va="center", fontsize=8.5)
                centres[rank] = (x + width / 2, y + height / 2)
    for node in range(dp):  # tensor parallelism: neighbours in a node
        for stage in range(pp):
            ranks = [node * per_node + stage * tp + shard for shard in range(tp)]
            for a, b in zip(ranks, ranks[1:]):
                (xa, ya), (xb, yb) = centres[a], centres[b]
                axis.plot([xa + width / 2, xb - width / 2], [ya, yb], color="#1f77b4", linewidth=5, solid_capstyle="butt")
    for node in range(dp):  # pipeline: stage s to stage s+1
        for stage in range(pp - 1):
            for shard in range(tp):
                a, b = node * per_node + stage * tp + shard, node * per_node + (stage + 1) * tp + shard
                (xa, ya), (xb, yb) = centres[a], centres[b]
                axis.add_patch(FancyArrowPatch((xa, ya - height / 2), (xb, yb + height / 2), arrowstyle="<|-|>",
                                               mutation_scale=12, color="#ff7f0e", linewidth=2))
    if dp > 1:  # data parallelism (and expert parallelism inside it): the same position in every node
        for rank in range(per_node):
            (xa, ya), (xb, yb) = centres[rank], centres[(dp - 1) * per_node + rank]
            top = rank // tp == 0
            for colour, style, lift, bend in (("#2ca02c", "--", 0.0, -0.16), ("#9467bd", ":", 0.18, -0.22)):
                offset = height / 2 + lift if top else -height / 2 - lift
                axis.add_patch(FancyArrowPatch((xa, ya + offset), (xb, yb + offset), arrowstyle="-", color=colour,
                                               connectionstyle=f"arc3,rad={bend if top else -bend}",
                                               linestyle=style, linewidth=1.6))
    legend = [
        ("#1f77b4", "-", "tensor parallel (TP): each weight matrix split across the group; all-reduce of "
                         "activations, 2 in forward and 2 in backward per layer; inside a node (NVLink)"),
        ("#ff7f0e", "-", "pipeline parallel (PP): the layers split into stages; send/recv of activations "
                         "forward and of gradients backward, per micro-batch; inside or across nodes"),
        ("#2ca02c", "--", "data parallel (DP): the batch split across the group; all-reduce of gradients once "
                          "per step; ZeRO also shards optimizer states, gradients and weights over this group; "
                          "across nodes (InfiniBand)"),
        ("#9467bd", ":", "expert parallel (EP): the experts of MoE layers split over (part of) the DP group; "
                         "all-to-all of tokens, 2 in forward and 2 in backward per MoE layer"),
    ]
    import textwrap
    for colour, style, text in legend:
        axis.plot([], [], color=colour, linestyle=style, linewidth=3, label=textwrap.fill(text, 105))
    axis.legend(loc="upper left", bbox_to_anchor=(0.0, 0.02), fontsize=8.5, frameon=False, handlelength=3,
                labelspacing=0.9)
    axis.set_xlim(-0.5, dp * (node_width + node_gap) - node_gap + 0.5)
    axis.set_ylim(-1.05, pp * row)
    axis.set_aspect("equal")
    axis.axis("off")
    axis.set_title(f"{dp * pp * tp} GPUs as DP × PP × TP = {dp} × {pp} × {tp}, tensor parallelism innermost", fontsize=11)
    figure.tight_layout()
    plt.close(figure)
    return figure
