"""The topology chapter's figures: where one rank's groups lie on the cluster, what the planner's
step time is made of, and the 3D run's losses beside single-process training."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from dtp.topology.mesh import parallel_groups, world_size

GROUP_STYLES = {"tp": ("tab:blue", "s", "TP group"), "ep": ("tab:purple", "D", "EP group"),
                "pp": ("tab:orange", "^", "PP group"), "expert_dp": ("tab:green", "v", "expert_dp group"),
                "dp": ("tab:green", "o", "DP group")}
PART_STYLES = {"compute": ("compute", "#a6bddb"), "bubble": ("pipeline bubble", "#d0d0d0"),
               "tp": ("TP all-reduces", "#08519c"), "ep": ("EP all-to-alls", "#9467bd"),
               "pp": ("PP send/recv", "#ff7f0e"), "dp": ("DP gradients", "#2ca02c"),
               "expert_dp": ("expert gradients", "#98df8a"), "cp": ("CP ring K/V", "#8c564b"),
               "optimizer": ("optimizer step", "#bcbd22")}


def group_map_figure(sizes: dict[str, int], order, gpus_per_node: int, rank: int = 0, title: str = ""):
    """Every GPU of the layout as a dot at (node, GPU in the node); the GPUs of `rank`'s group of
    each dimension marked, each dimension in its own panel."""
    n = world_size(sizes)
    nodes = n // gpus_per_node
    groups = {name: next(group for group in groups_ if rank in group)
              for name, groups_ in parallel_groups(sizes, order).items()}
    names = [name for name in ("tp", "ep", "pp", "expert_dp", "dp") if name in groups]
    figure, axes = plt.subplots(len(names), 1, figsize=(9, 1.35 * len(names) + 0.9), sharex=True)
    all_nodes, all_slots = np.divmod(np.arange(n), gpus_per_node)
    for axis, name in zip(np.atleast_1d(axes), names):
        colour, marker, label = GROUP_STYLES[name]
        axis.scatter(all_nodes, all_slots, s=4, color="#cccccc")
        node, slot = np.divmod(np.array(groups[name]), gpus_per_node)
        spanned = len(set(node.tolist()))
        axis.scatter(node, slot, s=28, color=colour, marker=marker)
        axis.set_title(f"rank {rank}'s {label}: {len(groups[name])} GPUs on {spanned} node{'s' * (spanned > 1)}",
                       fontsize=9, loc="left")
        axis.set_ylim(-1, gpus_per_node)
        axis.set_yticks([0, gpus_per_node - 1])
        axis.set_ylabel("GPU in node", fontsize=8)
    axis.set_xlim(-1, nodes)
    axis.set_xlabel(f"node (of {nodes}, {gpus_per_node} GPUs each)")
    if title:
        figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    plt.close(figure)
    return figure


def step_time_figure(rows_by_model: dict[str, list[dict]], top: int = 6):
    """Stacked bars of the estimated step time's parts for the fastest layouts of each model."""
    figure, axes = plt.subplots(len(rows_by_model), 1, figsize=(9, 2.1 * len(rows_by_model) * top / 6 + 1.2),
                                squeeze=False)
    for axis, (title, rows) in zip(axes[:, 0], rows_by_model.items()):
        shown = rows[:top][::-1]
        labels = [f"tp {r['tp']} pp {r['pp']} dp {r['dp']}" + (f" ep {r['ep']}" if r["ep"] > 1 else "")
                  + f", ZeRO-{r['zero_stage']}" for r in shown]
        left = np.zeros(len(shown))
        for part, (name, colour) in PART_STYLES.items():
            widths = np.array([r["times"].get(part, 0.0) for r in shown])
            if widths.any():
                axis.barh(labels, widths, left=left, color=colour, label=name)
                left += widths
        axis.set_title(title, fontsize=10, loc="left")
        axis.tick_params(axis="y", labelsize=8)
        axis.set_xlabel("estimated time per step (s)")
        axis.grid(True, axis="x", alpha=0.3)
    handles = {}
    for axis in axes[:, 0]:
        for handle, label in zip(*axis.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    figure.legend(handles.values(), handles.keys(), loc="upper center", ncol=4, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.9))
    plt.close(figure)
    return figure


def loss_figure(losses: list[float], reference: list[float], label: str):
    """Loss per step of a parallel run (markers) on single-process training (line)."""
    figure, axis = plt.subplots(figsize=(7, 3.6))
    steps = np.arange(1, len(reference) + 1)
    axis.plot(steps, reference, color="black", linewidth=1.5, label="one process, whole batch")
    axis.plot(steps, losses, linestyle="none", marker="o", markersize=7, markerfacecolor="none",
              color="tab:red", label=label)
    axis.set_xlabel("training step")
    axis.set_ylabel("cross-entropy (nats per byte)")
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
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


def ratio_figure(results: list[dict], trend: dict, tolerance: float = 0.10):
    """Predicted over published speed against the GPUs of each run (log scale): the fitted table's
    rows hollow, held-out rows filled, one marker per source; the ±tolerance band and the held-out
    rows' least-squares line against log10(GPUs) (`trend`: its slope and intercept)."""
    figure, axis = plt.subplots(figsize=(8.5, 5.6))
    markers = ["o", "s", "^", "D", "v", "P", "X", "*", "<", ">"]
    groups = list(dict.fromkeys((result["run"].source, result["run"].fitted) for result in results))
    for index, (source, fitted) in enumerate(groups):
        mine = [result for result in results if (result["run"].source, result["run"].fitted) == (source, fitted)]
        colour = f"C{index % 10}"
        axis.scatter([result["run"].cluster.gpus for result in mine], [result["ratio"] for result in mine],
                     marker=markers[index % len(markers)], s=36, zorder=3, label=source + (" (fitted)" if fitted else ""),
                     facecolors="none" if fitted else colour, edgecolors=colour)
    gpus = np.array([result["run"].cluster.gpus for result in results])
    span = np.logspace(np.log10(gpus.min()) - 0.1, np.log10(gpus.max()) + 0.1, 50)
    axis.fill_between(span, 1 - tolerance, 1 + tolerance, color="#e4e4e4", lw=0, zorder=0, label=f"±{tolerance:.0%}")
    axis.plot(span, trend["intercept"] + trend["slope"] * np.log10(span), color="black", lw=1,
              zorder=2, label=f"held-out trend: {trend['slope']:+.3f} per tenfold GPUs")
    axis.axhline(1.0, color="black", lw=0.5, ls=":")
    axis.set_xscale("log")
    axis.set_xlabel("GPUs")
    axis.set_ylabel("predicted / published speed")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.13), frameon=False)
    figure.tight_layout()
    plt.close(figure)
    return figure
