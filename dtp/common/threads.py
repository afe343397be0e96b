"""Torch on one thread for small tensors."""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_on_one_thread():
    """Run the block with torch's intra-op pool at one thread, then restore it. For the course's
    small tensors more threads only contend, and on a busy machine much worse: a parallel region
    waits for its slowest thread, and a descheduled thread held a 0.07 s reference computation
    up to 6.5 s (2 threads, 2 cores, 2 CPU-bound processes beside it; 1.9 s at most on one
    thread, median 0.04 s). The sandbox and every gloo rank run on one thread too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
