"""Figures the book draws from build-time measurements."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from . import costs


def bandwidth_figure(n: int, sizes_bytes, times_by_label: dict, model: tuple[float, float] | None = None):
    """Bus bandwidth against message size for several all-reduce implementations, with an
    optional fitted alpha-beta model (alpha seconds, beta bytes/s) as a dashed line."""
    figure, axis = plt.subplots(figsize=(7, 4))
    sizes = np.asarray(sizes_bytes, dtype=float)
    for label, times in times_by_label.items():
        busbw = [costs.bus_bandwidth(s, t, n) / 1e9 for s, t in zip(sizes, times)]
        axis.plot(sizes, busbw, marker="o", label=label)
    if model is not None:
        alpha, beta = model
        dense = np.geomspace(sizes[0], sizes[-1], 100)
        fitted = [costs.bus_bandwidth(s, costs.ring_all_reduce_time(n, s, alpha, beta), n) / 1e9 for s in dense]
        axis.plot(dense, fitted, linestyle="--", color="gray", label="alpha-beta model (fit to the ring)")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("message size S (bytes)")
    axis.set_ylabel("bus bandwidth (GB/s)")
    axis.set_title(f"All-reduce on {n} gloo processes (CPU, loopback)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    plt.close(figure)  # glue displays it; keep it out of the cell's own output
    return figure


MEMORY_COLOURS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer states": "#55a868", "activations": "#c44e52"}


def memory_breakdown_figure(breakdowns: dict[str, dict[str, float]], device_bytes: float = 80 * 2**30):
    """One GPU's memory (GB = 10⁹ bytes) for each labelled set-up, as a stacked bar on its own
    linear axis (set-ups differ by orders of magnitude), with the device's capacity dashed
    (by default an "80GB" GPU, which holds 80 GiB = 85.9 GB)."""
    device_gb = device_bytes / 1e9
    figure, axes = plt.subplots(len(breakdowns), 1, figsize=(8, 1.1 * len(breakdowns) + 0.9), squeeze=False)
    for axis, (label, breakdown) in zip(axes[:, 0], breakdowns.items()):
        left = 0.0
        for component, colour in MEMORY_COLOURS.items():
            width = breakdown.get(component, 0.0) / 1e9
            axis.barh(0, width, left=left, color=colour, label=component)
            left += width
        axis.axvline(device_gb, color="black", linestyle="--", linewidth=1)
        axis.set_xlim(0, max(left, device_gb) * 1.18)
        axis.text(left, 0, f" {left:,.1f} GB", va="center")
        axis.set_yticks([0], [label])
        axis.set_xlabel(f"GB per GPU (dashed: the GPU's {device_bytes / 2**30:g} GiB = {device_gb:.1f} GB)"
                        if axis is axes[-1, 0] else None)
    handles, names = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, names, loc="upper center", ncol=len(names), frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.9))
    plt.close(figure)
    return figure
