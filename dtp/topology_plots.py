"""The topology chapter's figures: where one rank's groups lie on the cluster, what the planner's
step time is made of, and the 3D run's losses beside single-process training."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from .topology import parallel_groups, world_size

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
