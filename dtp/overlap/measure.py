"""Wall-clock measurements of the overlap chapter, for the page (never for a verdict).

Each pattern runs on a real gloo world with computation of controlled length (`time.sleep`, which
leaves the CPU to gloo's worker threads, as a GPU's compute leaves the links to NCCL), once with
its communication waited on at once and once overlapped. A measurement returns the step's wall
time, the communication time measured alone in the same world, and the exposed time: the step
minus its compute. Numbers depend on the machine; the page prints them next to the model of
`dtp.overlap.model` computed from the measured communication time.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world
from dtp.overlap.runs import ComputeRecorder, plain_events
from dtp.zero.measure import FullTensorTracker

REPEATS = 5  # the fastest of a few runs: the least disturbed by whatever else the machine does


def _timed(function) -> float:
    dist.barrier()
    start = time.perf_counter()
    function()
    took = time.perf_counter() - start
    times = torch.tensor([took])
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
    return float(times)


def _fastest(function) -> float:
    _timed(function)  # warm-up: gloo sets up its buffers on a size's first use
    return min(_timed(function) for _ in range(REPEATS))


# --- ZeRO-3's forward: L units, each all-gathered before a compute of f seconds ---------------

def _zero3_forward_rank(rank, world_size, units, numel, compute_s, depths):
    pieces = [torch.full((numel // world_size,), float(rank)) for _ in range(units)]

    def gather(index):
        full = torch.empty(numel, dtype=torch.float32)
        return full, dist.all_gather_single(full, pieces[index], async_op=True)

    def forward(depth):
        in_flight = {}
        for index in range(units):
            for ahead in range(index, min(units, index + depth + 1)):  # this unit and `depth` more in flight
                if ahead not in in_flight:
                    in_flight[ahead] = gather(ahead)
            full, handle = in_flight.pop(index)
            handle.wait()
            time.sleep(compute_s)  # the unit's compute, which needs `full`
            del full

    gather_s = _fastest(lambda: gather(0)[1].wait())
    result = {"gather_s": gather_s, "compute_s": compute_s, "units": units}
    for depth in depths:
        tracker = FullTensorTracker()
        with tracker:
            forward(depth)  # the bytes alive, counted after every operation (one run)
        result[depth] = {"step_s": _fastest(lambda: forward(depth)), "peak_bytes": tracker.peaks.get("start", 0)}
    return result


def measure_zero3_forward(world_size=2, units=6, numel=2**21, compute_s=0.02, depths=(0, 1, 2)) -> dict:
    """ZeRO-3's forward on gloo with prefetch depth 0 (gather, wait, compute), 1 and 2: per depth
    the step time, exposed time (step - L·f) and the peak bytes of gathered weights alive."""
    result = run_world(_zero3_forward_rank, world_size, (units, numel, compute_s, depths))[0]
    for depth in depths:
        result[depth]["exposed_s"] = result[depth]["step_s"] - units * compute_s
    return result


# --- DDP: buckets all-reduced during a backward of B seconds ----------------------------------

def _ddp_rank(rank, world_size, buckets, numel, backward_s):
    grads = [torch.ones(numel // buckets) for _ in range(buckets)]

    def step(overlap):
        handles = []
        for bucket in range(buckets):
            time.sleep(backward_s / buckets)  # backward produces this bucket's gradients
            if overlap:
                handles.append(dist.all_reduce(grads[bucket], async_op=True))
        if not overlap:
            handles = [dist.all_reduce(g, async_op=True) for g in grads]
        for handle in handles:
            handle.wait()

    allreduce_s = _fastest(lambda: [dist.all_reduce(g) for g in grads])
    return {"allreduce_s": allreduce_s, "backward_s": backward_s, "buckets": buckets,
            "after_s": _fastest(lambda: step(False)), "overlapped_s": _fastest(lambda: step(True))}


def measure_ddp(world_size=2, buckets=4, numel=2**22, backward_s=0.08) -> dict:
    result = run_world(_ddp_rank, world_size, (buckets, numel, backward_s))[0]
    for key in ("after", "overlapped"):
        result[f"{key}_exposed_s"] = result[f"{key}_s"] - backward_s
    return result


# --- collective matmul: t ring steps, each transfer under a chunk's compute --------------------

def _ring_rank(rank, world_size, numel, gemm_s):
    t = world_size
    chunk = torch.full((numel,), float(rank))

    def plain():
        gathered = torch.empty(numel * t)
        dist.all_gather_single(gathered, chunk)
        time.sleep(gemm_s)  # the whole GEMM, after the whole all-gather

    def ring():
        current = chunk
        for step in range(t):
            if step < t - 1:
                incoming = torch.empty_like(current)
                handles = [dist.isend(current, (rank + 1) % t), dist.irecv(incoming, (rank - 1) % t)]
            time.sleep(gemm_s / t)  # this chunk's GEMM
            if step < t - 1:
                for handle in handles:
                    handle.wait()
                current = incoming

    def gather_alone():
        gathered = torch.empty(numel * t)
        dist.all_gather_single(gathered, chunk)

    return {"allgather_s": _fastest(gather_alone), "gemm_s": gemm_s, "chunks": t,
            "plain_s": _fastest(plain), "ring_s": _fastest(ring)}


def measure_collective_matmul(world_size=4, numel=2**20, gemm_s=0.06) -> dict:
    result = run_world(_ring_rank, world_size, (numel, gemm_s))[0]
    result["plain_exposed_s"] = result["plain_s"] - gemm_s
    result["ring_exposed_s"] = result["ring_s"] - gemm_s
    return result


# --- TP and EP: a collective the next op needs, and two micro-batches -------------------------

def _tp_ep_rank(rank, world_size, numel, compute_s):
    data = torch.ones(numel)
    outputs = torch.empty(numel)

    def all_to_all():
        dist.all_to_all_single(outputs, data)

    def serial_micro_batches():
        for _ in range(2):  # each micro-batch: dispatch + combine, then its compute
            all_to_all()
            all_to_all()
            time.sleep(compute_s)

    def two_micro_batches():
        # micro-batch A's all-to-alls run while micro-batch B computes, and the other way round
        first = [dist.all_to_all_single(torch.empty(numel), data, async_op=True) for _ in range(2)]
        time.sleep(compute_s)  # B's compute (its all-to-alls were done in the previous layer)
        for handle in first:
            handle.wait()
        second = [dist.all_to_all_single(torch.empty(numel), data, async_op=True) for _ in range(2)]
        time.sleep(compute_s)  # A's compute, under B's all-to-alls
        for handle in second:
            handle.wait()

    def tp_forward():
        dist.all_reduce(data)  # the next matrix product needs its result: nothing to hide it under
        time.sleep(compute_s)

    def tp_backward():
        handle = dist.all_reduce(data, async_op=True)  # the input gradient's all-reduce ...
        time.sleep(compute_s)  # ... under the weight-gradient product, which does not need it
        handle.wait()

    return {"all_to_all_s": 2 * _fastest(all_to_all), "all_reduce_s": _fastest(lambda: dist.all_reduce(data)),
            "compute_s": compute_s, "ep_serial_s": _fastest(serial_micro_batches),
            "ep_overlapped_s": _fastest(two_micro_batches), "tp_forward_s": _fastest(tp_forward),
            "tp_backward_s": _fastest(tp_backward)}


def measure_tp_and_ep(world_size=2, numel=2**21, compute_s=0.03) -> dict:
    result = run_world(_tp_ep_rank, world_size, (numel, compute_s))[0]
    result["ep_serial_exposed_s"] = result["ep_serial_s"] - 2 * compute_s
    result["ep_overlapped_exposed_s"] = result["ep_overlapped_s"] - 2 * compute_s
    result["tp_forward_exposed_s"] = result["tp_forward_s"] - compute_s
    result["tp_backward_exposed_s"] = result["tp_backward_s"] - compute_s
    return result


# --- what FSDP2 issues, and when, on the pinned torch ------------------------------------------

def _fsdp2_rank(rank, world_size, forward_prefetch):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if forward_prefetch:
        for layer, following in zip(model, list(model)[1:]):
            layer.set_modules_to_forward_prefetch([following])
    x = torch.randn(4, 16)
    model(x).sum().backward()  # FSDP2 initialises lazily, on the first forward
    tracker = FullTensorTracker()  # tags each product with the all-gathers its operands came from
    with CommunicationLog() as log, tracker, ComputeRecorder(log.events, tracker):
        log.mark("forward")
        loss = model(x).sum()
        log.mark("backward")
        loss.backward()
        log.mark("end")
    return plain_events(log.events)


def fsdp2_events(forward_prefetch: bool = False, world_size: int = 2) -> list[dict]:
    """Rank 0's ordered all-gathers, waits and products in one step of FSDP2 (`fully_shard` per
    Linear of a 4-layer model), with or without `set_modules_to_forward_prefetch`."""
    return run_world(_fsdp2_rank, world_size, (forward_prefetch,))[0]


def gathers_issued_ahead(events: list[dict], phase: str, stop: str) -> tuple[int, int]:
    """(all-gathers of the phase issued before the first product that uses the previous
    all-gather's weights, all-gathers of the phase after the first): issued ahead means the
    gather could run under the previous unit's compute. Products carry the numbers of the
    gathers their operands came from (`ComputeRecorder` with a tracker)."""
    labels = [e.get("label") for e in events]
    begin, end = labels.index(phase), labels.index(stop)
    numbered = {i: n for n, i in enumerate((i for i, e in enumerate(events) if e["op"] == "all_gather"), 1)}
    gathers = [i for i in range(begin, end) if i in numbered]
    ahead = 0
    for previous, current in zip(gathers, gathers[1:]):
        first_use = next((i for i in range(previous, end) if events[i]["op"] == "compute"
                          and numbered[previous] in events[i].get("gathers", [])), end)
        ahead += current < first_use
    return ahead, max(0, len(gathers) - 1)
