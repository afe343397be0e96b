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
assumes (gloo's default group has two threads and runs two collectives at once). `own_core(rank)`
gives each rank a core of its own and gloo's TCP event loops the next core, and the timed rounds
run the rank's own thread at a real-time priority where allowed (`compute_first`): the rank
computes (sleeps) and issues on time, and its link is not held up by threads sharing that core. Every timing
starts all ranks at one instant (a CLOCK_MONOTONIC deadline, which every process on the machine
shares), so that no rank's late start is counted as communication, and ends when the slowest
rank ends; programs are run in rounds (each once per round) and the median kept. A fit of
t = alpha + beta·bytes for each collective is measured in the same rounds as the programs it
predicts (`fit_programs`, `fit_from`).
"""
from __future__ import annotations

import contextlib
import os
import random
import statistics
import threading
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

# The median of this many runs, after a warm-up: one collective's time moves by about a fifth from
# round to round here (the page's middle-half columns), and with 9 a row's ratio moved 0.6-1.7
# between builds where it was a difference of two times
REPEATS = 25
FIRST_ESTIMATE_ROUNDS = 5  # rounds of the fit that sizes a computation before the measurement
START_AHEAD_S = 0.005  # rank 0 sets the common start this far ahead: every rank is waiting by then
FIT_PAUSE_S = 0.005  # the compute before each collective the fit times, as the programs have one
LAUNCH_COUNT = 16  # tiny collectives whose cost to the rank's thread is averaged
FIT_COUNT = 3  # collectives of one size a fit program exposes one after another (a first one costs more)
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
    link = dist.ProcessGroupGloo(store, dist.get_rank(), dist.get_world_size(), options)
    place_threads()  # the new device's event loop, started on this rank's core
    return link


EVENT_LOOP_THREAD = "gloo_tcp_loop"  # the name gloo's TCP transport gives its event-loop thread
_placement: tuple[int, int] | None = None  # (the rank's core, its event loops' core), once own_core ran


def own_core(rank: int, event_loops_elsewhere: bool = True) -> None:
    """Keep this rank's threads (its own, gloo's workers) on one core, rank modulo the cores this
    process may use, as each rank of a GPU world has a device of its own; and gloo's TCP event
    loops on the next core (`place_threads`; `event_loops_elsewhere=False`: on the rank's core
    too, to show why not). Left to the scheduler, the ranks' threads migrate between two shared
    cores and one all-reduce's time moves by a quarter from one run to the next, which rows that
    chain many collectives multiply."""
    global _placement
    cores = sorted(os.sched_getaffinity(0))
    own = cores[rank % len(cores)]
    _placement = (own, cores[(rank + 1) % len(cores)] if event_loops_elsewhere else own)
    place_threads()


def place_threads() -> None:
    """Put every thread of this process where `own_core` says; threads started later inherit
    the core of the thread that starts them, so `one_link` calls this again for the event loop
    its new device starts. Why the event loops go elsewhere: gloo's event-loop thread receives
    the bytes and wakes the worker thread waiting for them; on the worker's own core it kept it
    waiting, and an all-reduce of 4 KB to 1 MB took about 3 ms whatever its size, against 0.2 to
    0.9 ms with the loop on the other core (this machine, 2 ranks; the page measures it:
    `measure_event_loop_placement`)."""
    if _placement is None:
        return
    own, loops = _placement
    for thread in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{thread}/comm") as name:
                core = loops if name.read().strip() == EVENT_LOOP_THREAD else own
            os.sched_setaffinity(int(thread), {core})
        except OSError:  # a thread that ended meanwhile
            pass


def realtime_allowed() -> bool:
    """Whether `compute_first` can give a thread a real-time priority here (tried on a thread
    that ends at once)."""
    outcome = []

    def probe():
        with compute_first() as granted:
            outcome.append(granted)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return outcome[0]


@contextlib.contextmanager
def compute_first():
    """While inside, the calling thread (the rank's "compute": its sleeps, issues and waits) runs
    at a real-time priority, so that it goes on the moment it wakes instead of after a gloo
    thread busy on its core (which, in the measured ZeRO-3 forward, held a prefetch's issue for
    up to a millisecond); threads it starts do not inherit it. Only around the timed programs,
    which sleep or wait almost all the time: a real-time thread doing real work would keep
    everything else off its core. Needs the right to (root, or CAP_SYS_NICE); yields whether it
    was granted, and where refused the thread stays as it was."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(1))
        granted = True
    except OSError:
        granted = False
    try:
        yield granted
    finally:
        if granted:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


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


def exposed_times(programs: dict, link, rounds: int = REPEATS) -> dict:
    """The exposed time of each program (a dict of them): the median of `exposed_samples`."""
    return exposed_summary(programs, link, rounds)[0]


def exposed_summary(programs: dict, link, rounds: int = REPEATS) -> tuple[dict, dict]:
    """Per program (a dict of them), the median of `exposed_samples` and the middle half of its
    rounds (first and third quartiles): the spread that a row's median is read against."""
    samples = exposed_samples(programs, link, rounds)
    medians = {key: statistics.median(values) for key, values in samples.items()}
    middles = {key: tuple(statistics.quantiles(values, n=4)[::2]) for key, values in samples.items()}
    return medians, middles


def exposed_samples(programs: dict, link, rounds: int = REPEATS) -> dict:
    """The exposed times of each program (a dict of them), one per round: its time minus its
    computation's alone, run right after it (a sleep overshoots by the same on both). Every round
    runs every program once, so that a change in the machine's state while they run (another
    job, a frequency step) touches all of them alike, and in an order shuffled per round (the
    same on every rank: seeded by the round), so that what one program leaves behind (a socket's
    buffers, the caches) does not always fall on the same next one."""
    prepared = {key: (program, buffers(program), compute_only(program)) for key, program in programs.items()}
    with compute_first():
        return _timed_rounds(prepared, link, rounds)


def _timed_rounds(prepared: dict, link, rounds: int) -> dict:
    for program, tensors, _ in prepared.values():
        synchronized_time(lambda: run_program(program, link, tensors))  # warm-up: gloo sets up a size's buffers
    differences = {key: [] for key in prepared}
    for round_index in range(rounds):
        order = list(prepared)
        random.Random(round_index).shuffle(order)
        for key in order:
            program, tensors, alone = prepared[key]
            step = synchronized_time(lambda: run_program(program, link, tensors))
            differences[key].append(step - synchronized_time(lambda: run_program(alone, link, {})))
    return differences


def fit_programs(op: str, sizes, launch_count: int = LAUNCH_COUNT) -> dict:
    """The programs a fit of `op` times: ("fit", op, n) `FIT_COUNT` collectives of n elements per
    rank, each issued after a short compute and waited on at once, as the programs issue theirs; and
    ("launch", op) `launch_count` collectives of one element, each after a short compute, all
    waited on at the end: there each collective is hidden, and only what it costs the rank's
    own thread (the call that issues it, the one that waits on it, waking while gloo's thread
    works) is left."""
    programs = {("fit", op, n): [step for k in range(FIT_COUNT)
                                 for step in (("compute", FIT_PAUSE_S), ("issue", k, op, n), ("wait", k))]
                for n in sizes}
    launches = [step for k in range(launch_count) for step in (("compute", FIT_PAUSE_S), ("issue", k, op, 1))]
    programs[("launch", op)] = launches + [("wait", k) for k in range(launch_count)]
    return programs


def fit_from(exposed: dict, op: str, sizes, launch_count: int = LAUNCH_COUNT) -> dict:
    """alpha (s), beta (s per byte of a rank's input) and launch (s) of `op` from the exposed
    times of `fit_programs`: a least-squares line through the single collectives' times; alpha
    as fitted includes one launch."""
    numel = sorted(sizes)
    times = [exposed[("fit", op, n)] / FIT_COUNT for n in numel]
    fit = alpha_beta_from_times(numel, times)
    fit.update(op=op, numel=numel, times=times, launch=max(0.0, exposed[("launch", op)]) / launch_count)
    return fit


def fit_alpha_beta(link, op: str, sizes, rounds: int = REPEATS) -> dict:
    """`fit_from` the exposed times of `fit_programs`, measured on their own (a first estimate,
    to size a computation before the rounds that measure everything)."""
    return fit_from(exposed_times(fit_programs(op, sizes), link, rounds), op, sizes)


def alpha_beta_from_times(numel, times) -> dict:
    """The line t = alpha + beta·4n through one collective's times at sizes n (float32 numel per
    rank), fitted on relative residuals (each weighted by 1/t): a collective's time moves by a
    share of itself from round to round, so unweighted least squares let the largest sizes set
    alpha, the intercept that the many small buckets' rows multiply. alpha is never below 0 (the
    line through 0 then, again on relative residuals)."""
    nbytes, observed = np.array(numel, dtype=float) * 4, np.array(times, dtype=float)
    beta, alpha = np.polyfit(nbytes, observed, 1, w=1 / observed)
    if alpha < 0:
        ratio = nbytes / observed  # beta minimising the sum of ((beta·bytes - t) / t)²
        alpha, beta = 0.0, float(ratio.sum() / (ratio**2).sum())
    return {"alpha": float(alpha), "beta": float(beta)}


def bandwidth_time(fit: dict, numel: int) -> float:
    """The fitted bandwidth part, beta·bytes, of one collective of `numel` float32 per rank."""
    return fit["beta"] * numel * 4
