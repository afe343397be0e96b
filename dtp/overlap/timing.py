"""Running one rank's program on gloo and timing it, for the overlap page (never for a verdict).

A program is the list of steps `dtp.overlap.model.schedule_time` simulates, with each
collective named by what it moves instead of how long it takes:

    ("compute", seconds)                  a sleep: it leaves the CPU to gloo, so it measures the
                                          zero-contention ceiling (a GPU's kernels compete)
    ("issue", name, op, numel)            start a collective: "all_reduce", "all_gather" (numel
                                          per rank in), "all_to_all", "exchange" (a ring step:
                                          send numel to rank + 1, receive numel from rank - 1)
    ("wait", name)                        wait for it

`one_link()` gives the collectives a gloo group with ONE worker thread, so that they run one
after another in the order issued, as NCCL runs one stream's collectives and as the model
assumes (gloo's default group has two threads and runs two collectives at once). Every timing
starts all ranks at one instant (a CLOCK_MONOTONIC deadline, which every process on the machine
shares), so that no rank's late start is counted as communication, and ends when the slowest
rank ends; it is repeated and the median kept. `fit_alpha_beta` fits t = alpha + beta·bytes to
one collective's exposed times at several sizes, on the same world.
"""
from __future__ import annotations

import statistics
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

REPEATS = 9  # the median of this many runs, after a warm-up
START_AHEAD_S = 0.005  # rank 0 sets the common start this far ahead: every rank is waiting by then
FIT_PAUSE_S = 0.002  # the compute before each collective the fit times, as the programs have one
OPS = ("all_reduce", "all_gather", "all_to_all", "exchange")
_links_made = 0  # each one_link() of a process gets its own keys in the world's store


def one_link(timeout_s: float = 60.0):
    """A gloo backend over the same ranks with one worker thread: collectives in issue order.
    Every rank must call it, the same number of times."""
    global _links_made
    _links_made += 1
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_default_device()]
    options._threads = 1
    options._timeout = timedelta(seconds=timeout_s)
    store = dist.PrefixStore(f"overlap-one-link-{_links_made}/", dist.distributed_c10d._get_default_store())
    return dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(), options)


def buffers(program) -> dict:
    """(input, output) tensors for every collective of a program, allocated once, outside the timing."""
    issues = [step for step in program if step[0] == "issue"]
    unknown = sorted({step[2] for step in issues} - set(OPS))
    if unknown:
        raise ValueError(f"unknown collective {unknown[0]!r}: use one of {', '.join(OPS)}")
    world = dist.get_world_size()
    made = {}
    for _, name, op, numel in issues:
        out = numel * world if op == "all_gather" else numel
        made[name] = (torch.ones(numel), torch.empty(out) if op != "all_reduce" else None)
    return made


def _start(link, op, tensors) -> list:
    source, target = tensors
    if op == "all_reduce":
        return [link.allreduce([source])]
    if op == "all_gather":
        return [link._allgather_base(target, source)]
    if op == "all_to_all":
        return [link.alltoall_base(target, source, [], [])]
    rank, world = link.rank(), link.size()
    return [link.send([source], (rank + 1) % world, 0), link.recv([target], (rank - 1) % world, 0)]


def run_program(program, link, tensors) -> None:
    """Run the program's steps in order on this rank; collectives on `link`."""
    handles = {}
    for step in program:
        if step[0] == "compute":
            time.sleep(step[1])
        elif step[0] == "issue":
            handles[step[1]] = _start(link, step[2], tensors[step[1]])
        else:
            for handle in handles.pop(step[1]):
                handle.wait()


def compute_only(program) -> list:
    """The program's computation alone: what the step would take with free communication."""
    return [step for step in program if step[0] == "compute"]


def synchronized_time(function) -> float:
    """One run of `function` on every rank from a common start; the slowest rank's duration."""
    start = torch.tensor([time.monotonic() + START_AHEAD_S], dtype=torch.float64)
    dist.broadcast(start, 0)
    time.sleep(max(0.0, float(start) - time.monotonic()))
    function()
    took = torch.tensor([time.monotonic() - float(start)], dtype=torch.float64)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
    return float(took)


def median_time(function, repeats: int = REPEATS) -> float:
    synchronized_time(function)  # warm-up: gloo sets up its buffers on a size's first use
    return statistics.median(synchronized_time(function) for _ in range(repeats))


def exposed_time(program, link, repeats: int = REPEATS) -> float:
    """The median, over paired runs, of the program's time minus its computation's alone (a
    sleep overshoots by the same on both): what the communication added to the step."""
    tensors = buffers(program)
    alone = compute_only(program)
    synchronized_time(lambda: run_program(program, link, tensors))
    differences = []
    for _ in range(repeats):
        step = synchronized_time(lambda: run_program(program, link, tensors))
        differences.append(step - synchronized_time(lambda: run_program(alone, link, {})))
    return statistics.median(differences)


def fit_alpha_beta(link, op: str, sizes) -> dict:
    """alpha (s) and beta (s per byte of the rank's input) of one collective on this world: at
    each size (numel per rank), the exposed time of one collective issued after a short compute
    and waited on at once (`exposed_time`: the ranks start together, the compute's own time is
    subtracted), as the programs issue theirs; a least-squares line through them."""
    numel = list(sizes)
    times = [exposed_time([("compute", FIT_PAUSE_S), ("issue", "x", op, n), ("wait", "x")], link) for n in numel]
    fit = alpha_beta_from_times(numel, times)
    fit.update(op=op, numel=numel, times=times)
    return fit


def alpha_beta_from_times(numel, times) -> dict:
    """The least-squares line t = alpha + beta·4n through one collective's times at sizes n
    (float32 numel per rank); alpha is never below 0 (the line through 0 then)."""
    nbytes, observed = np.array(numel, dtype=float) * 4, np.array(times, dtype=float)
    beta, alpha = np.polyfit(nbytes, observed, 1)
    if alpha < 0:
        alpha, beta = 0.0, float(np.dot(nbytes, observed) / np.dot(nbytes, nbytes))
    return {"alpha": float(alpha), "beta": float(beta)}


def bandwidth_time(fit: dict, numel: int) -> float:
    """The fitted bandwidth part, beta·bytes, of one collective of `numel` float32 per rank."""
    return fit["beta"] * numel * 4
