"""One model of how much communication a training step cannot hide, used for every parallelism.

A collective runs on its own engine (NCCL kernels on their own CUDA stream; gloo's worker
threads here), so it can proceed while the rank computes something that does not need its
result. Per phase of a step,

    exposed = max(0, communication - the computation that does not depend on it)

and a step's exposed communication is the sum over its phases. The functions below apply this to
each parallelism. Times are in any one unit (seconds, milliseconds): the functions only add,
subtract and compare them. Communication of one phase is assumed to run on one engine, one
collective after another (they share the links); computation of one rank runs one op at a time.
"""
from __future__ import annotations

from dtp.pp import schedules as pipeline


def exposed(communication: float, independent_compute: float) -> float:
    """The part of one phase's communication that no independent computation hides."""
    return max(0.0, communication - independent_compute)


def exposed_over_phases(phases) -> float:
    """Sum of `exposed(communication, compute)` over (communication, compute) phases."""
    return sum(exposed(communication, compute) for communication, compute in phases)


# --- data parallelism: gradient buckets all-reduced during backward ---------------------------

def ddp_exposed(allreduce_time: float, backward_time: float, buckets: int) -> float:
    """DDP with `buckets` equal buckets: bucket k is ready after k/b of backward and its
    all-reduce (C/b) starts then, or when the previous one ends. The last one finishes at
    max(B/b + C, B + C/b), so what sticks out of backward is max(C/b, C - B(b-1)/b): the last
    bucket always, more if the all-reduces together outlast backward after the first bucket."""
    b, c = buckets, allreduce_time
    return max(c / b, c - backward_time * (b - 1) / b)


def ddp_exposed_serial(allreduce_time: float, backward_time: float, buckets: int) -> float:
    """The same step by simulation: an all-reduce engine that takes bucket k when it is ready
    (k·B/b) and free. Agrees with `ddp_exposed` (tests/overlap/test_overlap_model.py)."""
    free = 0.0
    for k in range(1, buckets + 1):
        free = max(free, k * backward_time / buckets) + allreduce_time / buckets
    return max(0.0, free - backward_time)


# --- ZeRO-3 / FSDP: the next unit gathered during this unit's compute --------------------------

def fsdp_forward_exposed(units: int, gather_time: float, compute_time: float, prefetch: bool = True) -> float:
    """Forward over L units, each all-gathered (g) before its compute (f). Without prefetch every
    gather waits: L·g. With the next unit's gather issued before this unit's compute, only the
    first gather is fully exposed and each later one sticks out by max(0, g - f)."""
    if not prefetch:
        return units * gather_time
    return gather_time + (units - 1) * exposed(gather_time, compute_time)


def fsdp_backward_exposed(units: int, gather_time: float, reduce_scatter_time: float, compute_time: float,
                          prefetch: bool = True) -> float:
    """Backward over L units, each gathered again (g), computed (b) and its gradient
    reduce-scattered (r). With prefetch, the backward of unit k hides the gather of unit k-1 and
    the reduce-scatter of unit k+1 (they share the links): the first gather and the last
    reduce-scatter are exposed, and each phase sticks out by max(0, its communication - b)."""
    g, r, b = gather_time, reduce_scatter_time, compute_time
    if not prefetch:
        return units * (g + r)
    if units == 1:
        return g + r
    return g + r + exposed(g, b) + (units - 2) * exposed(g + r, b) + exposed(r, b)


def fsdp_gathered_units_alive(prefetch_depth: int, units: int) -> int:
    """Gathered units alive at once: the one computing and `prefetch_depth` gathered ahead."""
    return min(units, 1 + prefetch_depth)


# --- tensor parallelism: the critical path, and collective matmul --------------------------------

def tp_layer_exposed(allreduce_time: float, weight_gradient_time: float) -> float:
    """A Megatron transformer layer: forward has two all-reduces (after attention, after the MLP)
    whose result the next matrix product needs, so both are exposed; each of backward's two
    input-gradient all-reduces runs under the weight-gradient product of the same layer."""
    return 2 * allreduce_time + 2 * exposed(allreduce_time, weight_gradient_time)


def collective_matmul_exposed(allgather_time: float, gemm_time: float, chunks: int) -> float:
    """All-gather then GEMM split into t ring steps: t - 1 transfers of A/(t-1) each, each under
    one chunk's GEMM (G/t); the last chunk's GEMM has nothing left to hide. With t = 1 nothing
    is split and the whole all-gather is exposed."""
    t = chunks
    if t == 1:
        return allgather_time
    return (t - 1) * exposed(allgather_time / (t - 1), gemm_time / t)


# --- pipeline parallelism: messages between dependent stages -------------------------------------

def pp_exposed(stages: int, micro_batches: int, message_time: float, forward_time: float = 1.0,
               backward_time: float = 2.0) -> float:
    """How much longer a 1F1B step takes when every activation or gradient message takes
    `message_time`, from the course's schedule simulator (`dtp.pp.schedules.simulate`). Not only the
    fill and drain: 1F1B's steady state alternates one forward and one backward per stage, and
    each waits for a message from a neighbour that itself waited, so messages stay on the
    critical path there too (the page shows the simulator's numbers)."""
    times = {"F": forward_time, "B": backward_time, "W": 0.0}
    schedule = pipeline.one_f_one_b_schedule(stages, micro_batches)
    return pipeline.simulate(schedule, times, message_time).makespan - pipeline.simulate(schedule, times).makespan


# --- expert parallelism: two micro-batches, one's all-to-all under the other's compute ----------

def ep_exposed(all_to_all_time: float, compute_time: float, overlapped: bool = True) -> float:
    """A MoE layer run on two micro-batches, each with dispatch + combine all-to-alls of
    `all_to_all_time` and `compute_time` of attention and experts. Serially both micro-batches'
    all-to-alls are exposed; overlapped, each runs under the other micro-batch's compute."""
    if not overlapped:
        return 2 * all_to_all_time
    return 2 * exposed(all_to_all_time, compute_time)
