"""Pipeline parallelism: schedules, a timeline simulator and the closed forms they obey.

A model is cut into p stages, one per rank, and the batch into m micro-batches. A **schedule**
says, for every stage, the order in which it runs its operations: a list per stage of
`Op(kind, micro_batch, chunk)` with kind

    "F"  forward of one micro-batch through the stage's layers
    "B"  backward: the full backward, or, when the schedule also has "W" ops (a *split*
         backward, as in the zero-bubble schedules), only the gradient with respect to the
         stage's input, which the previous stage is waiting for
    "W"  the weight gradient of a split backward, which nobody waits for

With interleaving each stage holds v model chunks: chunk c of stage s is *virtual stage*
c·p + s of the p·v pieces the model is cut into, so a micro-batch visits stages 0..p-1 v times.
Micro-batches, chunks and stages are numbered from 0.

`simulate` times a schedule; book, notebook explorer and grader all draw and check these
functions. The grader's oracle is a separate event simulation (grader/checks/pp/schedules.py), and
tests/pp/test_pp_pipeline.py holds the two and the closed forms to each other.
"""
from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

# The first backward with an explicit gradient tensor (what every pipeline stage but the last
# calls) imports sympy through torch.autograd._make_grads: half a second, paid by every forked
# rank that has not inherited the import. Importing it here, once, keeps it out of measurements.
import torch
import torch.distributed as dist
import torch.fx.experimental.symbolic_shapes  # noqa: F401
from torch import nn

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


class Op(NamedTuple):
    """One operation of a stage: a plain tuple ("F", micro_batch, chunk)."""
    kind: str
    micro_batch: int
    chunk: int = 0


Schedule = list  # list (one per stage) of lists of Op

# Op times the book and the explorer use: input gradient and weight gradient each cost about a
# forward (two matrix products against the forward's one), so a whole backward, B + W, costs 2.
UNIT_TIMES = {FORWARD: 1.0, BACKWARD: 1.0, WEIGHT: 1.0}


# --- schedule generators ----------------------------------------------------------------------

def gpipe_schedule(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every stage runs all m forwards, then all m backwards. With
    m = 1 this is naive model parallelism: one stage works at a time."""
    _check_sizes(p, m)
    return [[Op(FORWARD, k) for k in range(m)] + [Op(BACKWARD, k) for k in range(m)] for _ in range(p)]


def one_f_one_b_schedule(p: int, m: int) -> Schedule:
    """1F1B (PipeDream-Flush; Narayanan et al. 2021): stage s runs min(p-s-1, m) warm-up forwards,
    then alternates one forward and one backward (steady state), then runs the backwards left
    (cool-down). A micro-batch's backward starts as soon as possible, so stage s never holds more
    than min(p-s, m) micro-batches' activations, whatever m is."""
    _check_sizes(p, m)
    return _warm_up_then_alternate(p, m, lambda stage: min(p - stage - 1, m), lambda kind, k: Op(kind, k))


def _warm_up_then_alternate(p: int, total: int, warm_up, nth) -> Schedule:
    """Each stage's ops of a 1F1B-style schedule: `warm_up(stage)` forwards, then one forward and
    one backward in turn, then the backwards left; `nth(kind, k)` is the k-th op of that kind."""
    schedule = []
    for stage in range(p):
        warm = warm_up(stage)
        ops = [nth(FORWARD, k) for k in range(warm)]
        for k in range(warm, total):
            ops += [nth(FORWARD, k), nth(BACKWARD, k - warm)]
        ops += [nth(BACKWARD, k) for k in range(total - warm, total)]
        schedule.append(ops)
    return schedule


def interleaved_schedule(p: int, m: int, v: int, warm_up_factor: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2), v chunks per stage, m a multiple
    of p. Forwards go in rounds: p micro-batches through chunk 0, the same p through chunk 1, ...,
    chunk v-1, then the next p micro-batches; backwards in the same rounds with the chunks in
    reverse. Stage s first runs (v-1)·p + 2(p-s-1) forwards: micro-batch 0 must go forward
    through all p·v virtual stages and back through those after stage s's last chunk before
    stage s can run its first backward, and these forwards keep it busy until then.
    `warm_up_factor` replaces the 2 (Megatron-LM's choice): 1 gives the same step when messages
    take no time, and a slower one when they do (the book and tests/pp/test_pp_pipeline.py compare)."""
    _check_sizes(p, m, v)
    if m % p:
        raise ValueError(f"the interleaved schedule needs m to be a multiple of p (m={m}, p={p})")
    total = m * v

    def nth(kind: str, k: int) -> Op:
        chunk = (k // p) % v
        return Op(kind, (k // (p * v)) * p + k % p, chunk if kind == FORWARD else v - 1 - chunk)

    return _warm_up_then_alternate(p, total, lambda stage: min((v - 1) * p + warm_up_factor * (p - stage - 1), total),
                                   nth)


def zb_h1_schedule(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, section 2.1): 1F1B's forwards and input-gradient backwards B, with
    each weight gradient W split off and delayed. Stage s runs 1F1B's p-s-1 warm-up forwards and
    keeps up to s weight gradients pending, so every stage holds at most p micro-batches (the
    peak of 1F1B's first stage); the pending W fill the waits of the cool-down."""
    _check_sizes(p, m)
    schedule = []
    for stage in range(p):
        warm_up = min(p - stage - 1, m)
        ops = [Op(FORWARD, k) for k in range(warm_up)]
        pending: deque[int] = deque()
        for k in range(warm_up, m):  # steady state: F, B, and a W once s of them are pending
            ops += [Op(FORWARD, k), Op(BACKWARD, k - warm_up)]
            pending.append(k - warm_up)
            if len(pending) > stage:
                ops.append(Op(WEIGHT, pending.popleft()))
        for k in range(m - warm_up, m):  # cool-down: each B, then the oldest pending W
            ops.append(Op(BACKWARD, k))
            pending.append(k)
            ops.append(Op(WEIGHT, pending.popleft()))
        ops += [Op(WEIGHT, k) for k in pending]
        schedule.append(ops)
    return schedule


SCHEDULES = {"GPipe": gpipe_schedule, "1F1B": one_f_one_b_schedule,
             "interleaved 1F1B": interleaved_schedule, "ZB-H1": zb_h1_schedule}


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called `name` (a key of SCHEDULES); v is used by the interleaved one only."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; one of {', '.join(SCHEDULES)}")
    return interleaved_schedule(p, m, v) if name == "interleaved 1F1B" else SCHEDULES[name](p, m)


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    if min(p, m, v) < 1:
        raise ValueError(f"p, m and v must be at least 1 (p={p}, m={m}, v={v})")


# --- the timeline simulator -------------------------------------------------------------------

@dataclass(frozen=True)
class Timeline:
    """When every op of a schedule ran: start[s][i] and end[s][i] for op i of stage s."""
    schedule: Schedule
    start: list
    end: list
    makespan: float
    bubble_fraction: float  # idle stage-time over all stage-time, p·makespan
    bubble_over_ideal: float  # idle stage-time over busy stage-time (Megatron-LM's ratio)
    peak_in_flight: list  # per stage, most (micro-batch, chunk) activation sets held at once


def is_split(schedule: Schedule) -> bool:
    """Whether the schedule splits the backward into B and W (it has W ops)."""
    return any(op[0] == WEIGHT for ops in schedule for op in ops)


def chunk_count(schedule: Schedule) -> int:
    return 1 + max((op[2] for ops in schedule for op in ops), default=0)


def durations(schedule: Schedule, times: dict) -> dict:
    """Duration of each kind of op: a B without W ops after it is the whole backward, B + W."""
    weight = times.get(WEIGHT, 0.0)
    full_backward = times[BACKWARD] if is_split(schedule) else times[BACKWARD] + weight
    return {FORWARD: times[FORWARD], BACKWARD: full_backward, WEIGHT: weight}


# Where chunk c of stage s sits in the model: "interleaved" (Megatron-LM) puts it at virtual
# stage c·p + s, so a micro-batch visits the stages 0..p-1 v times; "V" (ZB-V, DualPipeV; two
# chunks) at s for chunk 0 and 2p-1-s for chunk 1, so it goes down the stages and back up, and
# the turn and the loss stay on one rank (the last, and the first).
PLACEMENTS = ("interleaved", "V")


def virtual_stage(chunk: int, stage: int, p: int, placement: str = "interleaved") -> int:
    if placement == "V":
        return stage if chunk == 0 else 2 * p - 1 - stage
    return chunk * p + stage


def dependencies(op: Op, stage: int, p: int, v: int, placement: str = "interleaved") -> list[tuple[str, int, int, int]]:
    """The ops `op` (run by `stage`) waits for, as (kind, micro-batch, chunk, stage)."""
    kind, micro_batch, chunk = op[0], op[1], op[2]
    virtual, last = virtual_stage(chunk, stage, p, placement), p * v - 1
    def at(kind_, virtual_):
        if placement == "V":
            return (kind_, micro_batch, 0, virtual_) if virtual_ < p else (kind_, micro_batch, 1, 2 * p - 1 - virtual_)
        return (kind_, micro_batch, virtual_ // p, virtual_ % p)
    if kind == FORWARD:
        return [at(FORWARD, virtual - 1)] if virtual > 0 else []
    if kind == BACKWARD:
        return [at(FORWARD, virtual)] + ([at(BACKWARD, virtual + 1)] if virtual < last else [])
    return [at(BACKWARD, virtual)]


def simulate(schedule: Schedule, times: dict, p2p_time: float = 0.0, chunk_scale: list | None = None,
             placement: str = "interleaved") -> Timeline:
    """Time a schedule: each stage runs its ops in order, one at a time, each as soon as the
    stage is free and the ops it depends on have ended (plus `p2p_time` for a result that comes
    from another stage: one activation or gradient message; links are never shared). `times`
    holds the duration of one op of each kind, {"F": .., "B": .., "W": ..} (of one chunk);
    `chunk_scale[c]`, when given, multiplies the times of chunk c's ops (chunks of unequal size);
    `placement` says where the chunks sit (PLACEMENTS).

    Computed as the longest path through the graph of dependencies and stage order, visiting
    ops in a topological order (Kahn's algorithm); raises ValueError if the orders deadlock.
    """
    p, v = len(schedule), chunk_count(schedule)
    duration = durations(schedule, times)

    def op_time(op) -> float:
        return duration[op[0]] * (chunk_scale[op[2]] if chunk_scale else 1.0)

    position = {}  # (kind, micro-batch, chunk, stage) -> (stage, index)
    for stage, ops in enumerate(schedule):
        for index, op in enumerate(ops):
            position[(op[0], op[1], op[2], stage)] = (stage, index)
    waits_on: dict[tuple, list[tuple[tuple, float]]] = {}  # op -> [(earlier op, delay after its end)]
    for stage, ops in enumerate(schedule):
        for index, op in enumerate(ops):
            before = [((stage, index - 1), 0.0)] if index else []
            for dependency in dependencies(op, stage, p, v, placement):
                if dependency not in position:
                    raise ValueError(f"stage {stage}'s {op} needs {dependency[0]} of micro-batch {dependency[1]} "
                                     f"(chunk {dependency[2]}) on stage {dependency[3]}, which no stage runs")
                before.append((position[dependency], p2p_time if dependency[3] != stage else 0.0))
            waits_on[(stage, index)] = before
    followers: dict[tuple, list[tuple]] = {node: [] for node in waits_on}
    for node, before in waits_on.items():
        for earlier, _ in before:
            followers[earlier].append(node)
    missing = {node: len(before) for node, before in waits_on.items()}
    ready = deque(node for node, count in missing.items() if count == 0)
    start = [[0.0] * len(ops) for ops in schedule]
    end = [[0.0] * len(ops) for ops in schedule]
    visited = 0
    while ready:
        stage, index = ready.popleft()
        visited += 1
        start[stage][index] = max((end[s][i] + delay for (s, i), delay in waits_on[(stage, index)]), default=0.0)
        end[stage][index] = start[stage][index] + op_time(schedule[stage][index])
        for follower in followers[(stage, index)]:
            missing[follower] -= 1
            if missing[follower] == 0:
                ready.append(follower)
    if visited < len(waits_on):
        stuck = sorted(node for node, count in missing.items() if count)
        raise ValueError(f"the schedule deadlocks: stage {stuck[0][0]} waits forever at op {stuck[0][1]} "
                         f"({schedule[stuck[0][0]][stuck[0][1]]})")
    makespan = max((e for ends in end for e in ends), default=0.0)
    busy = sum(op_time(op) for ops in schedule for op in ops)
    idle = p * makespan - busy
    return Timeline(schedule, start, end, makespan, idle / (p * makespan) if makespan else 0.0,
                    idle / busy if busy else 0.0, [max_in_flight(ops) for ops in schedule])


def releases_activations(op, split: bool) -> bool:
    """Whether `op` is the last op that needs its micro-batch's activations on its stage."""
    return op[0] == (WEIGHT if split else BACKWARD)


def max_in_flight(ops: list, split: bool | None = None) -> int:
    """Most (micro-batch, chunk) activation sets one stage holds at once: a forward's starts it
    holding them, the last backward op (W when the backward is split) ends it. Ops of a stage do
    not overlap, so this depends on the order alone, not on the times."""
    split = any(op[0] == WEIGHT for op in ops) if split is None else split
    held = peak = 0
    for op in ops:
        if op[0] == FORWARD:
            held += 1
            peak = max(peak, held)
        elif releases_activations(op, split):
            held -= 1
    return peak


def in_flight_over_time(timeline: Timeline, stage: int) -> tuple[list[float], list[int]]:
    """Activation sets held by `stage` as a step function: (times, count from each time on)."""
    split = is_split(timeline.schedule)
    changes = []
    for op, start, end in zip(timeline.schedule[stage], timeline.start[stage], timeline.end[stage]):
        if op[0] == FORWARD:
            changes.append((start, 1))
        elif releases_activations(op, split):
            changes.append((end, -1))
    times, counts, held = [0.0], [0], 0
    for time, change in sorted(changes):
        held += change
        if time == times[-1]:
            counts[-1] = held
        else:
            times.append(time)
            counts.append(held)
    return times, counts


def simulate_named(name: str, p: int, m: int, v: int = 1, times: dict | None = None, p2p_time: float = 0.0) -> Timeline:
    """Simulate the schedule called `name` for one model: `times` (default UNIT_TIMES) are a whole
    stage's op times, and an interleaved stage's v chunks each take 1/v of them."""
    chunks = v if name == "interleaved 1F1B" else 1
    per_chunk = {kind: t / chunks for kind, t in (times or UNIT_TIMES).items()}
    return simulate(make_schedule(name, p, m, chunks), per_chunk, p2p_time)


def timeline_json(name: str, p: int, m: int, v: int = 1, times: dict | None = None, p2p_time: float = 0.0) -> str:
    """A schedule's timeline as JSON, for a browser explorer to compare with:

        {"schedule": "1F1B", "p": 4, "m": 8, "v": 1, "times": {"F": 1, "B": 1, "W": 1}, "p2p_time": 0,
         "makespan": 33.0, "bubble_fraction": 0.2727..., "bubble_over_ideal": 0.375,
         "peak_in_flight": [4, 3, 2, 1],
         "ops": [{"stage": 0, "kind": "F", "micro_batch": 0, "chunk": 0, "start": 0.0, "end": 1.0}, ...]}

    `times` are a whole stage's op times, UNIT_TIMES by default (a whole backward, B + W, costs
    twice a forward), as in `simulate_named`: an interleaved schedule's ops take times/v. Ops
    are listed stage by stage, each stage's in the order it runs them."""
    times = dict(times or UNIT_TIMES)
    timeline = simulate_named(name, p, m, v, times, p2p_time)
    ops = [{"stage": stage, "kind": op[0], "micro_batch": op[1], "chunk": op[2], "start": start, "end": end}
           for stage, ops_ in enumerate(timeline.schedule)
           for op, start, end in zip(ops_, timeline.start[stage], timeline.end[stage])]
    return json.dumps({"schedule": name, "p": p, "m": m, "v": v, "times": times, "p2p_time": p2p_time,
                       "makespan": timeline.makespan, "bubble_fraction": timeline.bubble_fraction,
                       "bubble_over_ideal": timeline.bubble_over_ideal, "peak_in_flight": timeline.peak_in_flight,
                       "ops": ops})


# --- closed forms -----------------------------------------------------------------------------

def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle time as a fraction of total time: (p-1)/(v·m + p-1). With equal stages, GPipe and
    1F1B (v = 1) and interleaved 1F1B (v chunks, m a multiple of p) all take (v·m + p-1) chunk
    forward-and-backward times, of which every stage is busy for v·m."""
    return (p - 1) / (v * m + p - 1)


def bubble_over_ideal(p: int, m: int, v: int = 1) -> float:
    """Idle time relative to the ideal (busy) time: (p-1)/(v·m), Megatron-LM's "bubble time
    fraction" (Narayanan et al. 2021, sections 2.2.1 and 2.2.2)."""
    return (p - 1) / (v * m)


def makespan(name: str, p: int, m: int, times: dict, v: int = 1) -> float:
    """Closed-form time of one step with no communication time: (v·m + p-1)(t_F + t_B + t_W)
    for GPipe, 1F1B and interleaved 1F1B; for ZB-H1 m(t_F + t_B + t_W) + (p-1)(t_F + t_B - t_W),
    which holds when m >= p and t_W <= min(t_F, t_B) (checked against `simulate`)."""
    t_f, t_b, t_w = times[FORWARD], times[BACKWARD], times.get(WEIGHT, 0.0)
    if name == "ZB-H1":
        if m < p or t_w > min(t_f, t_b):
            raise ValueError("ZB-H1's closed form holds for m >= p and t_W <= min(t_F, t_B)")
        return m * (t_f + t_b + t_w) + (p - 1) * (t_f + t_b - t_w)
    chunks = v if name == "interleaved 1F1B" else 1
    return (chunks * m + p - 1) * (t_f + t_b + t_w)


def peak_in_flight(name: str, p: int, m: int, stage: int = 0, v: int = 1) -> int:
    """Most micro-batches (times chunks, when interleaved) whose activations `stage` holds at once:
    GPipe m; 1F1B min(p - stage, m); ZB-H1 min(p, m) on every stage; interleaved
    min((v-1)·p + 2(p - stage - 1) + 1, v·m) chunk activation sets (each 1/v of a stage's)."""
    if name == "GPipe":
        return m
    if name == "1F1B":
        return min(p - stage, m)
    if name == "ZB-H1":
        return min(p, m)
    if name == "interleaved 1F1B":
        return min((v - 1) * p + 2 * (p - stage - 1) + 1, v * m)
    raise ValueError(f"unknown schedule {name!r}")


def boundary_messages_per_step(p: int, m: int, v: int = 1) -> int:
    """Point-to-point messages per training step over all stage boundaries: each micro-batch
    crosses each of the p·v - 1 boundaries between consecutive virtual stages twice, its
    activation forward and its gradient backward."""
    return 2 * m * (p * v - 1)


def boundary_bytes_per_step(m: int, micro_batch: int, sequence: int, hidden: int, bytes_per_value: int = 2) -> int:
    """Bytes crossing one stage boundary (both directions) per step: per micro-batch, an
    activation of b·s·h values forward and its gradient, of the same size, backward."""
    return 2 * m * micro_batch * sequence * hidden * bytes_per_value


def message_count(schedule: Schedule, placement: str = "interleaved") -> int:
    """Point-to-point messages a schedule implies: its dependencies between ops of different
    stages (an activation forward or a gradient backward). Interleaving multiplies them by
    (p·v - 1)/(p - 1), not by v: a micro-batch crosses p·v - 1 boundaries instead of p - 1."""
    p, v = len(schedule), chunk_count(schedule)
    return sum(dependency[3] != stage for stage, ops in enumerate(schedule) for op in ops
               for dependency in dependencies(op, stage, p, v, placement))


def micro_batches_per_step(global_batch: int, micro_batch: int, data_parallel: int) -> int:
    """m = B / (b · DP): the global batch B (sequences per optimizer step) is shared by the DP
    replicas, and each replica's pipeline cuts its share into micro-batches of b. At a fixed
    global batch, more data parallelism means fewer micro-batches, hence a larger bubble."""
    if global_batch % (micro_batch * data_parallel):
        raise ValueError(f"the global batch {global_batch} is not a multiple of b·DP = {micro_batch * data_parallel}")
    return global_batch // (micro_batch * data_parallel)


def boundary_communication_to_compute_ratio(layers_per_stage: int, seq: int, hidden: int, bytes_per_value: int,
                                            link_bytes_per_s: float, flops_per_s: float, mlp_ratio: int = 4) -> float:
    """Per micro-batch on one stage, forward and backward: the time to send its boundary
    messages (an activation of b·s·h values out, its gradient back) at a per-direction
    bandwidth, over the time of the stage's L/p layers at a FLOP rate. The tokens cancel:
    2·h·e·F / (B · (L/p) · ((24 + 12r)h² + 12sh)): tensor parallelism's ratio
    (dtp.tp.tensor_parallel.communication_to_compute_ratio) divided by 4(t-1)·(L/p), since a
    stage sends two messages per micro-batch where a TP layer sends 8(t-1)/t of one per GPU
    and computes only 1/t of the layer."""
    from dtp.tp.tensor_parallel import layer_training_flops

    tokens = 1  # both times grow with the tokens
    communication = 2 * tokens * hidden * bytes_per_value / link_bytes_per_s
    compute = layers_per_stage * layer_training_flops(tokens, seq, hidden, mlp_ratio) / flops_per_s
    return communication / compute


# --- real pipelines on gloo -------------------------------------------------------------------

def pipeline_stages(p: int, seed: int = 0, d_in: int = 6, width: int = 8, d_out: int = 3) -> list:
    """A small MLP cut into p stages, identically initialised for a seed: stage s is
    Linear -> Tanh -> Linear, and every boundary between stages carries `width` features.
    `torch.nn.Sequential(*stages)` is the whole model, for single-process training."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    stages = [nn.Sequential(nn.Linear(d_in if s == 0 else width, width), nn.Tanh(),
                            nn.Linear(width, d_out if s == p - 1 else width)) for s in range(p)]
    torch.random.set_rng_state(generator_state)
    return stages


class SleepingStage(nn.Module):
    """A stage whose compute is sleeping: forward sleeps `forward_s`, backward `backward_s`
    (0: no sleep). Its map is the identity (a weight matrix equal to I, so there is a gradient),
    and column 0 of every micro-batch holds the micro-batch's number, so each op it runs is
    logged as (kind, micro-batch, start, end) with perf_counter times, comparable across
    processes. Given a `timeline` (dtp.common.timeline.Timeline), each op is also put into it as
    {"op": "F" or "B", "micro_batch": k} when it starts: one ordered record of what the rank
    computed and communicated (the grader's logical clock replays it)."""

    def __init__(self, width: int, forward_s: float, backward_s: float, timeline=None):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(width))
        self.forward_s, self.backward_s = forward_s, backward_s
        self.timeline = timeline
        self.log: list[tuple] = []

    def _ran(self, kind: str, micro_batch: int) -> None:
        if self.timeline is not None:
            self.timeline.computed(kind, micro_batch=micro_batch)

    def forward(self, x):
        start = time.perf_counter()
        micro_batch = int(x[0, 0].item())
        self._ran(FORWARD, micro_batch)
        y = x @ self.weight
        if self.forward_s:
            time.sleep(self.forward_s)
        self.log.append((FORWARD, micro_batch, start, time.perf_counter()))

        def backward(grad):  # runs first in this stage's backward
            began = time.perf_counter()
            self._ran(BACKWARD, micro_batch)
            if self.backward_s:
                time.sleep(self.backward_s)
            self.log.append((BACKWARD, micro_batch, began, time.perf_counter()))

        y.register_hook(backward)
        return y


def tagged_batch(m: int, micro_batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch of m micro-batches whose column 0 holds each row's micro-batch number (what
    a SleepingStage logs), and random targets."""
    batch = torch.randn(m * micro_batch, width)
    batch[:, 0] = torch.arange(m).repeat_interleave(micro_batch).float()
    return batch, torch.randn(m * micro_batch, width)


def _sleeping_rank(rank, world_size, step, m, forward_s, backward_s, width, micro_batch):
    stage = SleepingStage(width, forward_s, backward_s)
    batch, targets = tagged_batch(m, micro_batch, width)
    warm = torch.ones(1, requires_grad=True)
    (warm * 2).backward(torch.ones(1))  # the autograd engine's first-call costs, before timing
    dist.barrier()  # every rank ready: the timeline measures the pipeline, not process start-up
    step(stage, batch, targets, m, (micro_batch, width))
    return stage.log


def run_sleeping_pipeline(step, p: int, m: int, forward_s: float, backward_s: float, *, width: int = 4,
                          micro_batch: int = 1, **world_options) -> list:
    """Run a pipeline step function `step(stage, batch, targets, m, boundary_shape)` (exercise 4's
    signature) on p gloo ranks whose stages sleep instead of computing; returns each rank's log
    of (kind, micro-batch, start, end) in wall-clock seconds. For the page and the benchmark
    only: the times depend on how busy the machine is (the grader judges a pipeline on a
    logical clock instead, grader/checks/pp/measured_bubble.py)."""
    from dtp.common.world import run_world

    return run_world(_sleeping_rank, p, (step, m, forward_s, backward_s, width, micro_batch), **world_options)


def idle_fraction(busy: list) -> float:
    """Measured bubble: busy[s] lists stage s's (start, end) intervals of work; the idle share of
    p × (last end - first start)."""
    intervals = [interval for stage in busy for interval in stage]
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    return 1 - sum(end - start for start, end in intervals) / (len(busy) * span)


def measure_sleeping_pipeline(step, p: int, m: int, forward_s: float, backward_s: float, *,
                              retry_above: float = 0.03, attempts: int = 3, **world_options) -> list:
    """Runs of `run_sleeping_pipeline`: one, and another (up to `attempts` in all) while the last
    one idled more than `retry_above` over 1F1B's (p-1)/(m+p-1). Other processes on the machine
    only ever add idle time (a stage that waits for a core starts late), so the least idle run
    is the one that measures the pipeline itself. Returns every run's logs. Wall-clock, so
    machine-dependent: for the page and the benchmark, never for a verdict."""
    runs = []
    for _ in range(attempts):
        runs.append(run_sleeping_pipeline(step, p, m, forward_s, backward_s, **world_options))
        # The idle share, as idle_fraction computes it; not a call to idle_fraction, which the
        # grader disables while it checks a learner's own version of it.
        ops = [(start, end) for log in runs[-1] for _, _, start, end in log]
        span = max(end for _, end in ops) - min(start for start, _ in ops)
        if 1 - sum(end - start for start, end in ops) / (p * span) <= bubble_fraction(p, m) + retry_above:
            break
    return runs
