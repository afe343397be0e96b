"""Figures the book draws from build-time measurements."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # figures are rendered into the book, never shown in a window
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
