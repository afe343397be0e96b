"""The memory chapter's figure: one GPU's memory, part by part, for several set-ups."""
from __future__ import annotations

import matplotlib.pyplot as plt

MEMORY_COLOURS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868", "activations": "#c44e52",
                  "logits": "#8172b3"}
MEMORY_LABELS = {"logits": "logits (fp32)"}


def memory_breakdown_figure(breakdowns: dict[str, dict[str, float]], device: str = "A100 80GB"):
    """One GPU's memory (GB = 10⁹ bytes) for each labelled set-up, as stacked bars on one shared
    linear axis (so that a 157 GB bar is drawn a seventh as long as a 1133 GB one), each labelled
    with its total, and the capacity of `device` (a key of dtp.memory.formulas.GPU_MEMORY_MIB) dashed. The
    legend names only the parts some bar has."""
    from dtp.memory.formulas import GPU_MEMORY_MIB

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
