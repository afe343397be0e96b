"""Measurements the book makes at build time on a real gloo world."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from dtp.common.world import run_world


def _time_all_reduce_on_rank(rank, world_size, all_reduce, sizes_bytes, repeats):
    durations = []
    for size in sizes_bytes:
        tensor = torch.ones(size // 4)
        all_reduce(tensor.clone())  # warm-up: connections and buffers
        per_repeat = []
        for _ in range(repeats):
            work = tensor.clone()
            dist.barrier()
            started = time.perf_counter()
            all_reduce(work)
            per_repeat.append(time.perf_counter() - started)
        durations.append(per_repeat)
    return durations


def all_reduce_times(all_reduce, world_size: int, sizes_bytes, repeats: int = 7) -> np.ndarray:
    """Median time in seconds of `all_reduce(tensor)` for each size: a repeat lasts as long as its
    slowest rank, and the median over repeats damps the noise of a shared machine."""
    per_rank = run_world(_time_all_reduce_on_rank, world_size, (all_reduce, list(sizes_bytes), repeats),
                         timeout_s=600, collective_timeout_s=120)
    slowest = np.max(np.array(per_rank), axis=0)  # (sizes, repeats)
    return np.median(slowest, axis=1)


@dataclass
class AlphaBetaFit:
    alpha_s: float  # the fitted fixed cost of one ring step, in seconds
    bandwidth: float  # bytes per second
    relative_residuals: np.ndarray  # (model - measured) / measured, one per size


def fit_alpha_beta(n: int, sizes_bytes, times_s) -> AlphaBetaFit:
    """Fit the ring model t = 2(n-1)·alpha + 2(n-1)/n·S/bandwidth by least squares on relative
    errors (each time weighted by 1/t), so that the small, latency-bound messages count as
    much as the large ones; a plain fit lets the largest times decide the intercept alone."""
    sizes, times = np.asarray(sizes_bytes, dtype=float), np.asarray(times_s, dtype=float)
    design = np.stack([np.full_like(sizes, 2 * (n - 1)), 2 * (n - 1) / n * sizes], axis=1) / times[:, None]
    (alpha, seconds_per_byte), *_ = np.linalg.lstsq(design, np.ones_like(times), rcond=None)
    model = 2 * (n - 1) * alpha + 2 * (n - 1) / n * sizes * seconds_per_byte
    return AlphaBetaFit(float(alpha), float(1 / seconds_per_byte), (model - times) / times)


def training_flops_counted(model: torch.nn.Module, batch: int, seq: int) -> int:
    """FLOPs of one forward and backward pass as PyTorch's FlopCounterMode counts them (matrix
    multiplies). Build the model on the meta device and nothing is computed or allocated."""
    from torch.utils.flop_counter import FlopCounterMode

    device = next(model.parameters()).device
    tokens = torch.zeros(batch, seq, dtype=torch.long, device=device)
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    return counter.get_total_flops()
