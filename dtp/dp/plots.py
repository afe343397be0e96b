"""The data-parallelism chapter's figures: bus bandwidth against message size on gloo, and the
communication each DDP variant leaves exposed after backward."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from dtp.dp import costs


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
