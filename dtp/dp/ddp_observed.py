"""What torch's DistributedDataParallel really does on the pinned version, observed on a gloo
world, and how much communication each data-parallel variant leaves exposed after backward.
The book shows both at build time; tests/dp/test_ddp_observed.py pins the statements the book makes."""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dtp.common.models import tiny_mlp


def _ddp_buckets_on_rank(rank, world_size, widths, bucket_cap_mb, iterations):
    """Train DDP for a few iterations; a comm hook (which changes no bucketing) records, per
    iteration, each bucket DDP hands over for reduction: its index and its bytes, in order."""
    model = tiny_mlp(widths, seed=0)
    options = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = nn.parallel.DistributedDataParallel(model, **options)
    launched: list[list[tuple[int, int]]] = []

    def recording_all_reduce(_, bucket):
        launched[-1].append((bucket.index(), bucket.buffer().numel() * bucket.buffer().element_size()))
        future = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future()
        return future.then(lambda done: done.value()[0])

    ddp.register_comm_hook(None, recording_all_reduce)
    for _ in range(iterations):
        launched.append([])
        ddp(torch.randn(4, widths[0])).sum().backward()
    return {"launched": launched, "parameter_bytes": [p.numel() * p.element_size() for p in model.parameters()],
            "cap_bytes": ddp.bucket_bytes_cap}


def observe_ddp_buckets(widths, bucket_cap_mb: float | None = None, iterations: int = 3, world_size: int = 2) -> dict:
    """Per iteration, the (bucket index, bytes) DDP reduced, in launch order; None = DDP's default cap."""
    from dtp.common.world import run_world

    return run_world(_ddp_buckets_on_rank, world_size, (widths, bucket_cap_mb, iterations))[0]


def data_parallel_variant(variant: str, wrap, model, bucket_cap_bytes: int):
    """(the module to train, the call that finishes gradient synchronisation after backward) for
    `variant`: "after_backward" (`wrap(model)` averages the gradients once backward is done) or
    "bucketed" (`wrap(model, cap)` is a BucketedDDP whose all-reduces start during backward)."""
    if variant == "bucketed":
        trained = wrap(model, bucket_cap_bytes)
        return trained, trained.finish_gradient_sync
    return model, lambda: wrap(model)


def _exposed_on_rank(rank, world_size, variant, widths, batch, steps, bucket_cap_bytes, wrap):
    """Time one variant of data-parallel training: backward, and the synchronisation after it."""
    model = tiny_mlp(widths, seed=0)
    trained, synced = data_parallel_variant(variant, wrap, model, bucket_cap_bytes)
    inputs = torch.randn(batch, widths[0])
    rows = []
    for _ in range(steps):
        model.zero_grad()
        loss = trained(inputs).square().mean()
        dist.barrier()
        started = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        synced()
        rows.append((backward_done - started, time.perf_counter() - backward_done))
    return rows


def exposed_communication(variant: str, wrap, widths, batch: int = 64, steps: int = 7, bucket_cap_bytes: int = 1 << 20,
                          world_size: int = 2) -> dict:
    """Median backward time and median time spent after backward until gradients are synced
    (the exposed communication), over `steps` steps on the slowest rank. `variant` is
    "after_backward" (`wrap(model)` averages gradients once backward is done) or "bucketed"
    (`wrap(model, cap)` is a BucketedDDP whose all-reduces start during backward)."""
    from dtp.common.world import run_world

    per_rank = np.array(run_world(_exposed_on_rank, world_size,
                                  (variant, widths, batch, steps, bucket_cap_bytes, wrap)))  # (ranks, steps, 2)
    slowest = per_rank.max(axis=0)[1:]  # the first step warms up
    return {"backward_s": float(np.median(slowest[:, 0])), "exposed_s": float(np.median(slowest[:, 1]))}


def _construction_on_rank(rank, world_size, widths):
    """Ranks start from different weights and buffers; DDP's constructor and first forward."""
    model = tiny_mlp(widths, seed=rank, input_scaling=True)

    def spread():  # the largest difference from rank 0, over parameters and buffers
        gathered = [torch.empty(0)] * world_size
        flat = torch.cat([t.detach().reshape(-1) for t in model.state_dict().values()])
        dist.all_gather_object(gathered, flat)
        return max(float((g - gathered[0]).abs().max()) for g in gathered)

    before = spread()
    ddp = nn.parallel.DistributedDataParallel(model)  # broadcast_buffers=True by default
    after_construction = spread()
    model[0].scale.mul_(1 + rank)  # buffers drift apart (as running statistics would) ...
    drifted = spread()
    ddp(torch.randn(2, widths[0]))  # ... and the next forward broadcasts rank 0's again
    return {"before": before, "after_construction": after_construction, "drifted": drifted,
            "after_forward": spread()}


def observe_ddp_construction(widths=(8, 32, 16, 4), world_size: int = 2) -> dict:
    """Largest difference between ranks' parameters and buffers: before DDP, after wrapping,
    after the buffers drift, and after the next forward."""
    from dtp.common.world import run_world

    return run_world(_construction_on_rank, world_size, (widths,))[0]


def _bucket_view_on_rank(rank, world_size, widths, as_view):
    model = tiny_mlp(widths, seed=0)
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=as_view)
    for _ in range(2):
        ddp(torch.randn(4, widths[0])).sum().backward()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    return len(storages), len(list(model.parameters()))


def observe_gradient_as_bucket_view(widths=(8, 32, 16, 4), world_size: int = 2) -> dict:
    """How many distinct storages hold the parameters' gradients, with and without
    gradient_as_bucket_view (with it, each gradient is a view into its bucket's buffer)."""
    from dtp.common.world import run_world

    return {as_view: run_world(_bucket_view_on_rank, world_size, (widths, as_view))[0] for as_view in (False, True)}


def _accumulation_counts_on_rank(rank, world_size, accumulate, widths, micro_batches, steps):
    from dtp.common.traffic import CommunicationLog

    model = tiny_mlp(widths, seed=0)
    ddp = nn.parallel.DistributedDataParallel(model)

    def counted(_, bucket):  # DDP's default reduction, routed through Python so that the log sees it
        future = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future()
        return future.then(lambda done: done.value()[0])

    ddp.register_comm_hook(None, counted)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    per_step = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(step * world_size + rank)
        pieces = [(torch.randn(4, widths[0], generator=generator), torch.randn(4, widths[-1], generator=generator))
                  for _ in range(micro_batches)]
        optimizer.zero_grad()
        with CommunicationLog() as log:
            accumulate(ddp, optimizer, pieces)
        per_step.append(len(log.of("all_reduce")))
    return per_step


def all_reduces_per_accumulation_step(accumulate, micro_batches: int, widths=(8, 32, 16, 4), steps: int = 3,
                                      world_size: int = 2) -> list[int]:
    """All-reduces DDP issues per optimizer step when `accumulate(ddp, optimizer, pieces)` runs
    `micro_batches` micro-batches (counted through a comm hook on the process group)."""
    from dtp.common.world import run_world

    return run_world(_accumulation_counts_on_rank, world_size, (accumulate, widths, micro_batches, steps))[0]
