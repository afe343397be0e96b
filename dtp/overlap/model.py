"""One model of how much communication a training step cannot hide, used for every parallelism.

A collective runs on its own engine (NCCL kernels on their own CUDA stream; gloo's worker
threads here), so it can proceed while the rank computes something that does not need its
result. Per phase of a step,

    exposed = max(0, communication - the computation that does not depend on it)

and a step's exposed communication is the sum over its phases. The functions below apply this to
each parallelism. Times are in any one unit (seconds, milliseconds): the functions only add,
subtract and compare them. Communication of one phase is assumed to run on one engine, one
collective after another (they share the links; NCCL runs one stream's collectives in order);
computation of one rank runs one op at a time.

Two refinements, each an explicit argument whose default (0) gives the plain model above:

- `alpha`: a fixed cost of every collective (launch, rendezvous of the ranks, protocol round
  trips), added to the bandwidth time passed in: a collective of n bytes takes
  `collective_time(n, bandwidth, alpha)` = alpha + n / bandwidth. Functions that take a total
  communication time split into pieces (DDP's buckets, collective matmul's chunks) add alpha per
  piece, which is why more pieces are not always better.
- `contention`: epsilon, how much slower computation runs while a collective is in flight
  (NCCL's kernels take SMs and memory bandwidth from the matrix products): compute that overlaps
  a collective progresses at 1/(1+epsilon) of its speed. `GPU_CONTENTION` is an estimate for a
  GPU; a sleep (the page's measurements) has none.

Where the rank's own thread pays for issuing each collective (a CPU running gloo: tens of
microseconds a call), `launch` is that cost, spent on the compute engine, never hidden; a GPU's
CPU thread runs ahead of its kernels and hides it, so a planner leaves it at 0.

API (all times in one unit; `exposed` means what the step takes beyond its computation alone):

    collective_time(nbytes, bandwidth, alpha=0)                         -> alpha + nbytes/bandwidth
    exposed(communication, independent_compute, contention=0)          one phase
    exposed_over_phases(phases, contention=0)                          sum over (comm, compute)
    ddp_exposed(allreduce_time, backward_time, buckets, alpha=0, contention=0, launch=0)
    ddp_exposed_serial(allreduce_time, backward_time, buckets, alpha=0, contention=0, launch=0)  simulated
    ddp_best_buckets(allreduce_time, backward_time, alpha, most=4096, launch=0)
    fsdp_forward_exposed(units, gather_time, compute_time, prefetch=True, alpha=0, contention=0, launch=0)
    fsdp_forward_exposed_units(gather_times, compute_times, depth=1, contention=0, launch=0)   uneven
    fsdp_backward_exposed(units, gather_time, reduce_scatter_time, compute_time, prefetch=True,
                          alpha=0, contention=0, first_gather=True)
    fsdp_gathered_units_alive(prefetch_depth, units)
    tp_layer_exposed(allreduce_time, weight_gradient_time, alpha=0, contention=0)
    collective_matmul_exposed(allgather_time, gemm_time, chunks, alpha=0, contention=0,
                              piece_overhead=0)
    pp_exposed(stages, micro_batches, message_time, forward_time=1, backward_time=2, alpha=0)
    ep_exposed(all_to_all_time, compute_time, overlapped=True, alpha=0, contention=0)
    schedule_time(program, contention=0, launch=0)                     one rank's program, simulated
    program_exposed(program, contention=0, launch=0)                   its time beyond its compute
    ddp_program, after_backward_program, fsdp_forward_program, collective_matmul_program
                                                                       the programs the page runs

`schedule_time` runs a rank's program (compute, issue, wait, in order) on one compute engine and
one link: every closed form above is checked against it (tests/overlap/test_overlap_model.py), and
the page's measurements run the same programs on gloo.
"""
from __future__ import annotations

from dtp.pp import schedules as pipeline

# How much slower a GPU's matrix products run while a collective is in flight, as an estimate:
# DeepSeek-V3 dedicates 20 of an H800's 132 SMs to communication (DeepSeek-AI 2024, section
# 3.2.2); a product left the other 112 runs at best 112/132 as fast, 1/(1+e) with e = 132/112 - 1.
# SM sharing only: memory-bandwidth contention and the tail of a wave that no longer fits (a
# GEMM sized for 132 SMs) make it larger, few-SM communication kernels (TE's userbuffers) smaller.
GPU_CONTENTION = 132 / 112 - 1


def collective_time(nbytes: float, bandwidth: float, alpha: float = 0.0) -> float:
    """The alpha-beta cost of one collective: a fixed alpha plus its bytes over the bandwidth."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return alpha + nbytes / bandwidth


def exposed(communication: float, independent_compute: float, contention: float = 0.0) -> float:
    """The part of one phase's communication that no independent computation hides. With
    contention e the computation runs at 1/(1+e) of its speed while the collective is in flight:
    the phase lasts max(c, f + c·e/(1+e)), and what it adds to f is max(c - f, c·e/(1+e))."""
    c, f = communication, independent_compute
    return max(0.0, c - f, c * contention / (1 + contention))


def exposed_over_phases(phases, contention: float = 0.0) -> float:
    """Sum of `exposed(communication, compute, contention)` over (communication, compute) phases."""
    return sum(exposed(communication, compute, contention) for communication, compute in phases)


# --- one rank's program on one compute engine and one link --------------------------------------

def schedule_time(program, contention: float = 0.0, launch: float = 0.0) -> float:
    """When one rank's program ends. Steps, in order: ("compute", seconds), ("issue", name,
    seconds): the rank spends `launch` issuing it, then the collective joins the link's queue
    (collectives run one after another, each once issued and once the previous one ended),
    ("wait", name): the rank waits until it has ended. Compute runs at 1/(1+contention) of its
    speed while the link is busy. A collective never waited on still counts if it ends last."""
    now, link_free, ends = 0.0, 0.0, {}
    busy, first = [], 0  # (start, end) of each collective, in order; busy[first:] may still overlap
    for step in program:
        kind = step[0]
        if kind == "issue":
            now += launch
            start = max(now, link_free)
            link_free = ends[step[1]] = start + step[2]
            busy.append((start, link_free))
        elif kind == "wait":
            now = max(now, ends[step[1]])
        elif kind == "compute":
            while first < len(busy) and busy[first][1] <= now:
                first += 1
            now = _compute_until(now, step[1], busy[first:], contention)
        else:
            raise ValueError(f"unknown step {step!r}: use compute, issue or wait")
    return max([now, *ends.values()])


def _compute_until(now: float, work: float, busy: list, contention: float) -> float:
    """When `work` seconds of compute started at `now` end, slowed inside the busy intervals
    (in order, none ending before `now`). Every collective that can overlap it was issued before
    it started, so `busy` is complete."""
    for start, end in busy:
        if start > now:  # full speed up to the next busy interval
            free = min(work, start - now)
            now, work = now + free, work - free
        if work <= 0:
            break
        slowed = min(work * (1 + contention), end - now)
        now, work = now + slowed, work - slowed / (1 + contention)
    return now + max(0.0, work)


def program_exposed(program, contention: float = 0.0, launch: float = 0.0) -> float:
    """What the program takes beyond its computation alone."""
    return schedule_time(program, contention, launch) - sum(step[1] for step in program if step[0] == "compute")


def error_gain(program, contention: float = 0.0, launch: float = 0.0, relative: float = 0.25) -> float:
    """By how much an error of `relative` (25 %: what one collective's time can be off its fitted
    line) in every collective's time is multiplied in the program's exposed time:
    (Δexposed / exposed) / relative. About 1 when one collective sticks out (the last DDP bucket);
    b·p / exposed when a chain of b collectives of p each outlasts the computation, because the
    exposure is then the difference of two long times (b·p - B(b-1)/b). A finite error, not a
    derivative: a row just short of that point, which the error pushes over it, shows a large gain
    too. Infinite where the model says nothing is exposed."""
    base = program_exposed(program, contention, launch)
    scaled = [(*step[:2], step[2] * (1 + relative)) if step[0] == "issue" else step for step in program]
    return (program_exposed(scaled, contention, launch) - base) / (relative * base) if base > 0 else float("inf")


# --- data parallelism: gradient buckets all-reduced during backward ---------------------------

def ddp_exposed(allreduce_time: float, backward_time: float, buckets: int, alpha: float = 0.0,
                contention: float = 0.0, launch: float = 0.0) -> float:
    """DDP with `buckets` equal buckets: bucket k is ready after k/b of backward and its
    all-reduce (alpha + C/b, C the bandwidth time of all gradients) starts then, or when the
    previous one ends. The last one finishes at max(B/b + b·(alpha + C/b), B + alpha + C/b), so
    what sticks out of backward is max(alpha + C/b, b·alpha + C - B(b-1)/b): the last bucket
    always, more if the all-reduces together outlast backward after the first bucket. The alpha
    per bucket makes the best b finite (`ddp_best_buckets`). A `launch` per bucket lengthens
    backward by b·launch: max(p + b·launch, b·p - B(b-1)/b + launch), p = alpha + C/b. With
    contention e, backward runs at 1/(1+e) while a bucket is in flight: when each all-reduce ends
    before the next bucket is ready (p < (1+e)·B/b) every one of the first b - 1 costs backward
    p·e/(1+e) and the last sticks out whole; otherwise the all-reduces run back to back from the
    first bucket on. Both at once: max(p + (b-1)·p·e/(1+e), b·p - B(b-1)/b) (with a launch cost too,
    simulated)."""
    b, piece = buckets, alpha + allreduce_time / buckets
    if contention and launch:
        return ddp_exposed_serial(allreduce_time, backward_time, buckets, alpha, contention, launch)
    if contention:
        return max(piece + (b - 1) * piece * contention / (1 + contention), b * piece - backward_time * (b - 1) / b)
    return max(piece + b * launch, b * piece - backward_time * (b - 1) / b + launch)


def ddp_program(allreduce_time: float, backward_time: float, buckets: int, alpha: float = 0.0) -> list:
    """The DDP step as a program: each bucket's share of backward, then its all-reduce issued."""
    program = []
    for k in range(buckets):
        program += [("compute", backward_time / buckets), ("issue", k, alpha + allreduce_time / buckets)]
    return program + [("wait", k) for k in range(buckets)]


def after_backward_program(program) -> list:
    """The same steps with every collective issued after the last compute: nothing hides them."""
    computes = [step for step in program if step[0] == "compute"]
    return computes + [step for step in program if step[0] != "compute"]


def ddp_exposed_serial(allreduce_time: float, backward_time: float, buckets: int, alpha: float = 0.0,
                       contention: float = 0.0, launch: float = 0.0) -> float:
    """The same step by simulation (`schedule_time`). Agrees with `ddp_exposed` without
    contention (tests/overlap/test_overlap_model.py)."""
    program = ddp_program(allreduce_time, backward_time, buckets, alpha)
    return max(0.0, program_exposed(program, contention, launch))


def ddp_best_buckets(allreduce_time: float, backward_time: float, alpha: float, most: int = 4096,
                     launch: float = 0.0) -> int:
    """The number of equal buckets that exposes least: with alpha > 0 (or a launch cost) a finite
    one, because each bucket adds to the chain of all-reduces while only shortening the last
    bucket by C/b."""
    return min(range(1, most + 1),
               key=lambda b: (ddp_exposed(allreduce_time, backward_time, b, alpha, launch=launch), b))


# --- ZeRO-3 / FSDP: the next unit gathered during this unit's compute --------------------------

def fsdp_forward_exposed(units: int, gather_time: float, compute_time: float, prefetch: bool = True,
                         alpha: float = 0.0, contention: float = 0.0, launch: float = 0.0) -> float:
    """Forward over L units, each all-gathered (g, plus alpha) before its compute (f). Without
    prefetch every gather waits: L·g. With unit i+1's gather issued once unit i's has arrived and
    before unit i computes, only the first gather is fully exposed and each later one sticks out
    by max(0, g - f). With equal units a deeper prefetch changes nothing: the link is the bound
    (`fsdp_forward_exposed_units` shows when it helps). Issuing each of the L gathers costs
    `launch` on the rank's thread: L·launch more."""
    g = gather_time + alpha
    if not prefetch:
        return units * (g + launch)
    return units * launch + g + (units - 1) * exposed(g, compute_time, contention)


def fsdp_forward_program(gather_times, compute_times, depth: int = 1) -> list:
    """ZeRO-3's forward with prefetch depth d as a program: for unit i, issue its gather if not
    yet in flight and wait for it; then issue units i+1..i+d not yet in flight; compute unit i."""
    issued, program = set(), []
    for i, compute in enumerate(compute_times):
        for j in range(i, min(len(gather_times), i + depth + 1)):
            if j not in issued:
                issued.add(j)
                program.append(("issue", j, gather_times[j]))
            if j == i:
                program.append(("wait", i))
        program.append(("compute", compute))
    return program


def fsdp_forward_exposed_units(gather_times, compute_times, depth: int = 1, contention: float = 0.0,
                               launch: float = 0.0) -> float:
    """Exposed time of a forward whose units differ (`gather_times[i]`, `compute_times[i]`,
    each gather with its alpha), prefetching `depth` units ahead (0: none). Deeper prefetch helps
    when a big gather follows a short compute (an embedding, uneven wrapping): started one unit
    earlier it has two computes to hide under. With equal units it never helps."""
    return program_exposed(fsdp_forward_program(gather_times, compute_times, depth), contention, launch)


def fsdp_backward_exposed(units: int, gather_time: float, reduce_scatter_time: float, compute_time: float,
                          prefetch: bool = True, alpha: float = 0.0, contention: float = 0.0,
                          first_gather: bool = True) -> float:
    """Backward over L units, each gathered again (g), computed (b) and its gradient
    reduce-scattered (r), alpha added to each collective. With prefetch, the backward of unit k
    hides the gather of unit k-1 and the reduce-scatter of unit k+1 (on separate streams in
    FSDP2, but over the same links): the first gather and the last reduce-scatter are exposed,
    and each phase sticks out by max(0, its communication - b). `first_gather=False`: the unit
    backward starts with was never resharded (FSDP2's root keeps its parameters after forward),
    so its gather does not exist."""
    g, r, b = gather_time + alpha, reduce_scatter_time + alpha, compute_time
    first = g if first_gather else 0.0
    if not prefetch:
        return units * (g + r) - (g - first)
    if units == 1:
        return first + r
    return (first + r + exposed(g, b, contention) + (units - 2) * exposed(g + r, b, contention)
            + exposed(r, b, contention))


def fsdp_gathered_units_alive(prefetch_depth: int, units: int) -> int:
    """Gathered units alive at once: the one computing and `prefetch_depth` gathered ahead."""
    return min(units, 1 + prefetch_depth)


# --- tensor parallelism: the critical path, and collective matmul --------------------------------

def tp_layer_exposed(allreduce_time: float, weight_gradient_time: float, alpha: float = 0.0,
                     contention: float = 0.0) -> float:
    """A Megatron transformer layer: forward has two all-reduces (after attention, after the MLP)
    whose result the next matrix product needs, so both are exposed; each of backward's two
    input-gradient all-reduces runs under the weight-gradient product of the same layer."""
    a = allreduce_time + alpha
    return 2 * a + 2 * exposed(a, weight_gradient_time, contention)


def collective_matmul_exposed(allgather_time: float, gemm_time: float, chunks: int, alpha: float = 0.0,
                              contention: float = 0.0, piece_overhead: float = 0.0) -> float:
    """All-gather then GEMM split into t ring steps: t - 1 transfers of A/(t-1) each (plus
    alpha), each under one chunk's GEMM (G/t); the last chunk's GEMM has nothing left to hide.
    With t = 1 nothing is split and the whole all-gather (A + alpha) is exposed. A piece of the
    GEMM runs less efficiently than the whole (Wang et al. 2023): `piece_overhead` is what each
    of the t pieces adds, so the exposure, counted against the unsplit GEMM, is least at a
    finite t. The same holds for a GEMM followed by a reduce-scatter, mirrored: there the first
    piece's GEMM has no transfer to hide, and each partial sum travels under the next piece."""
    t = chunks
    if t == 1:
        return allgather_time + alpha
    piece = gemm_time / t + piece_overhead
    return t * piece_overhead + (t - 1) * exposed(allgather_time / (t - 1) + alpha, piece, contention)


def collective_matmul_program(allgather_time: float, gemm_time: float, chunks: int, alpha: float = 0.0) -> list:
    """Collective matmul as a program: at each of the t steps but the last, the ring transfer of
    the next piece (A/(t-1) + alpha) issued, then this piece's product (G/t), then the wait."""
    program = []
    for step in range(chunks):
        if step < chunks - 1:
            program.append(("issue", step, allgather_time / (chunks - 1) + alpha))
        program.append(("compute", gemm_time / chunks))
        if step < chunks - 1:
            program.append(("wait", step))
    return program


# --- pipeline parallelism: messages between dependent stages -------------------------------------

def pp_exposed(stages: int, micro_batches: int, message_time: float, forward_time: float = 1.0,
               backward_time: float = 2.0, alpha: float = 0.0) -> float:
    """How much longer a 1F1B step takes when every activation or gradient message takes
    `message_time` (plus alpha), from the course's schedule simulator (`dtp.pp.schedules.simulate`).
    Not only the fill and drain: 1F1B's steady state alternates one forward and one backward per
    stage, and each waits for a message from a neighbour that itself waited, so messages stay on
    the critical path there too (the page shows the simulator's numbers)."""
    times = {"F": forward_time, "B": backward_time, "W": 0.0}
    schedule = pipeline.one_f_one_b_schedule(stages, micro_batches)
    return (pipeline.simulate(schedule, times, message_time + alpha).makespan
            - pipeline.simulate(schedule, times).makespan)


# --- expert parallelism: two micro-batches, one's all-to-all under the other's compute ----------

def ep_exposed(all_to_all_time: float, compute_time: float, overlapped: bool = True, alpha: float = 0.0,
               contention: float = 0.0) -> float:
    """A MoE layer run on two micro-batches, each with dispatch + combine all-to-alls of
    `all_to_all_time` (alpha added to each of the two) and `compute_time` of attention and
    experts. Serially both micro-batches' all-to-alls are exposed; overlapped, each runs under
    the other micro-batch's compute."""
    c = all_to_all_time + 2 * alpha
    if not overlapped:
        return 2 * c
    return 2 * exposed(c, compute_time, contention)
