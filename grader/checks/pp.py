"""Checks of the pipeline-parallelism chapter (notebook 04_pipeline_parallel).

Oracles, computed in the grader: a discrete-event simulation of a schedule written here (a
priority queue of op completions and message arrivals, independent of `dtp.pipeline.simulate`,
which is a longest-path computation; tests/test_pp_pipeline.py holds both to the closed forms),
the closed forms of `dtp.pipeline`, and single-process training of the same model on the full
batch. Mechanisms, from what the learner's code did: the order of its ops, the messages its
ranks sent (recorded on the process group) and what they carried, and times taken by grader code.
"""
from __future__ import annotations

import heapq
from collections import Counter

import numpy as np
import torch
from torch import nn

from dtp import pipeline
from dtp.traffic import CommunicationLog

from ..compare import CheckFailed, expect, expect_answer, expect_close
from ..registry import Check, exercise
from .common import FixedAnswers, completed_worlds, describe_call, events_as_data, raise_world_failure, run_worlds

KINDS = ("F", "B", "W")


def describe_op(op, v: int = 1) -> str:
    kind, micro_batch, chunk = op
    return f"{kind} of micro-batch {micro_batch}" + (f" (chunk {chunk})" if v > 1 else "")


# --- the oracle: an event simulation ----------------------------------------------------------

class Deadlock(Exception):
    """No stage can run its next op: each waits for one that comes later on another stage."""


def _needs(op, stage: int, p: int, v: int) -> list[tuple]:
    """(kind, micro-batch, virtual stage) of the results `op` waits for."""
    kind, micro_batch, chunk = op
    virtual = chunk * p + stage
    if kind == "F":
        return [("F", micro_batch, virtual - 1)] if virtual else []
    if kind == "B":
        return [("F", micro_batch, virtual)] + ([("B", micro_batch, virtual + 1)] if virtual < p * v - 1 else [])
    return [("B", micro_batch, virtual)]


def event_simulation(schedule: list, times: dict, p2p_time: float = 0.0) -> dict:
    """Run the schedule as events: when an op ends, its stage becomes free then and its result
    arrives on its own stage at once and on every other stage p2p_time later; a free stage starts
    its next op when the last result it needs has arrived. Returns start/end per op, makespan,
    bubble fraction and ratio, peak in flight per stage; raises Deadlock with who waits for what."""
    p = len(schedule)
    v = 1 + max((op[2] for ops in schedule for op in ops), default=0)
    split = any(op[0] == "W" for ops in schedule for op in ops)
    duration = {"F": times["F"], "B": times["B"] if split else times["B"] + times["W"], "W": times["W"]}
    arrived = [dict() for _ in range(p)]  # stage -> {(kind, micro-batch, virtual stage): arrival time}
    start = [[None] * len(ops) for ops in schedule]
    end = [[None] * len(ops) for ops in schedule]
    next_index, busy = [0] * p, [False] * p
    events: list[tuple] = []  # (time, order, what, stage, result)
    order = 0

    def try_start(stage: int, now: float) -> None:
        nonlocal order
        if busy[stage] or next_index[stage] == len(schedule[stage]):
            return
        op = schedule[stage][next_index[stage]]
        if all(need in arrived[stage] for need in _needs(op, stage, p, v)):
            index = next_index[stage]
            start[stage][index], end[stage][index] = now, now + duration[op[0]]
            busy[stage] = True
            heapq.heappush(events, (end[stage][index], order, "done", stage, (op[0], op[1], op[2] * p + stage)))
            order += 1

    for stage in range(p):
        try_start(stage, 0.0)
    while events:
        now, _, what, stage, result = heapq.heappop(events)
        if what == "done":
            busy[stage] = False
            next_index[stage] += 1
            for other in range(p):
                heapq.heappush(events, (now + (p2p_time if other != stage else 0.0), order, "arrive", other, result))
                order += 1
        else:
            arrived[stage][result] = now
        try_start(stage, now)
    if any(next_index[s] < len(schedule[s]) for s in range(p)):
        waits = []
        for stage in range(p):
            if next_index[stage] < len(schedule[stage]):
                op = schedule[stage][next_index[stage]]
                missing = [need for need in _needs(op, stage, p, v) if need not in arrived[stage]]
                waits.append(f"stage {stage} at {describe_op(op, v)} waits for " + " and ".join(
                    f"{describe_op((kind, micro_batch, virtual // p), v)} on stage {virtual % p}"
                    for kind, micro_batch, virtual in missing))
        raise Deadlock("; ".join(waits))
    makespan = max((e for ends in end for e in ends), default=0.0)
    work = sum(duration[op[0]] for ops in schedule for op in ops)
    return {"start": start, "end": end, "makespan": makespan, "bubble_fraction": 1 - work / (p * makespan),
            "bubble_over_ideal": (p * makespan - work) / work, "peak_in_flight": [_peak(ops, split) for ops in schedule],
            "duration": duration}


def _peak(ops: list, split: bool) -> int:
    held = peak = 0
    for kind, _, _ in ops:
        if kind == "F":
            held += 1
            peak = max(peak, held)
        elif kind == ("W" if split else "B"):
            held -= 1
    return peak


# --- validating a learner's schedule ----------------------------------------------------------

def _as_schedule(result, call: str, p: int, m: int, v: int) -> list[list[tuple]]:
    """The learner's schedule as lists of (kind, micro-batch, chunk); CheckFailed if malformed."""
    expect(isinstance(result, (list, tuple)) and len(result) == p,
           f"{call} should return a list with one list of ops per stage (p = {p}), "
           f"got {len(result) if isinstance(result, (list, tuple)) else type(result).__name__}")
    schedule = []
    for stage, ops in enumerate(result):
        expect(isinstance(ops, (list, tuple)), f"{call}: stage {stage}'s ops should be a list")
        clean = []
        for op in ops:
            ok = isinstance(op, (list, tuple)) and len(op) in (2, 3) and op[0] in KINDS and all(
                isinstance(x, int) and not isinstance(x, bool) for x in op[1:])
            expect(ok, f"{call}: stage {stage} has the op {op!r}; an op is a tuple (kind, micro_batch, chunk) with "
                       "kind 'F', 'B' or 'W' and integer micro_batch and chunk")
            op = (op[0], op[1], op[2] if len(op) == 3 else 0)
            expect(0 <= op[1] < m and 0 <= op[2] < v,
                   f"{call}: stage {stage} has the op {op!r}, but micro-batches are numbered 0..{m - 1}"
                   + (f" and chunks 0..{v - 1}" if v > 1 else " and every chunk is 0 without interleaving"))
            clean.append(op)
        schedule.append(clean)
    return schedule


def _check_complete(schedule, call: str, m: int, v: int, split: bool) -> None:
    wanted = ("F", "B", "W") if split else ("F", "B")
    for stage, ops in enumerate(schedule):
        counts = Counter(ops)
        for op, count in counts.items():
            expect(count == 1, f"{call}: stage {stage} runs {describe_op(op, v)} {count} times; every op runs once")
            expect(op[0] in wanted, f"{call}: stage {stage} runs W ops, but this schedule keeps each backward whole "
                                    "(B computes both gradients): use only F and B")
        for kind in wanted:
            for micro_batch in range(m):
                for chunk in range(v):
                    if (kind, micro_batch, chunk) not in counts:
                        extra = (" (the zero-bubble schedule splits every backward into B, the input gradient, "
                                 "and W, the weight gradient)" if kind == "W" else "")
                        raise CheckFailed(f"{call}: stage {stage} never runs {describe_op((kind, micro_batch, chunk), v)}"
                                          + extra)


def _check_local_order(schedule, call: str, v: int) -> None:
    for stage, ops in enumerate(schedule):
        position = {op: index for index, op in enumerate(ops)}
        for op, index in position.items():
            earlier = {"B": "F", "W": "B"}.get(op[0])
            if earlier and position[(earlier, op[1], op[2])] > index:
                raise CheckFailed(f"{call}: stage {stage} runs {describe_op(op, v)} before its "
                                  f"{earlier}: a micro-batch's {op[0]} needs what its {earlier} computed on this stage")


def validated_timeline(schedule, call: str, m: int, v: int, split: bool) -> dict:
    """Form, completeness, each stage's own order, and that the stages together can run it."""
    _check_complete(schedule, call, m, v, split)
    _check_local_order(schedule, call, v)
    try:
        return event_simulation(schedule, {"F": 1.0, "B": 2.0, "W": 1.0})
    except Deadlock as deadlock:
        raise CheckFailed(f"{call} deadlocks: {deadlock}. Every stage must process micro-batches in an order "
                          "the other stages can feed") from None


class ScheduleCheck(Check):
    """Shared steps of the four schedule generators: draw (p, m[, v]) cases, call the learner's
    generator, validate form, completeness, local order and deadlock-freedom with the event
    simulation, then the schedule's own property (`check_property`) and its time under random op
    times against the closed form (a valid schedule may still idle more than it needs to)."""

    function = ""
    name = ""  # the schedule's name in dtp.pipeline.SCHEDULES
    split = False
    timeout_s = 20
    summary = ""

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.function,)

    def cases(self, rng) -> list[tuple]:
        raise NotImplementedError

    def prepare(self, rng):
        return [(case, {kind: float(rng.uniform(0.5, 2.0)) for kind in KINDS}) for case in self.cases(rng)]

    def collect(self, student, cases):
        generate = getattr(student, self.function)
        return [generate(*case) for case, _ in cases]

    def check_property(self, schedule, call: str, p: int, m: int, v: int) -> None:
        raise NotImplementedError

    def timing(self, times: dict, p: int, m: int) -> dict | None:
        """Op times under which the schedule's closed-form time is checked (None: not checked)."""
        return times

    def judge(self, cases, results) -> str:
        expect(len(results) == len(cases), "the grader's calls did not all return")
        for (case, times), result in zip(cases, results):
            p, m, v = case[0], case[1], case[2] if len(case) > 2 else 1
            call = describe_call(self.function, case, {})
            schedule = _as_schedule(result, call, p, m, v)
            validated_timeline(schedule, call, m, v, self.split)
            self.check_property(schedule, call, p, m, v)
            times = self.timing(times, p, m)
            if times is None:
                continue
            took = event_simulation(schedule, times)["makespan"]
            best = pipeline.makespan(self.name, p, m, times, v)
            if not np.isclose(took, best, rtol=1e-9, atol=1e-9):
                shown = ", ".join(f"t_{k} = {t:.3g}" for k, t in times.items())
                raise CheckFailed(f"{call} is valid but slower than {self.name} must be: with {shown} it takes "
                                  f"{took:.4g}, the schedule's closed form gives {best:.4g}. Some stage waits for "
                                  "work it could have had: run the micro-batches in the same order on every stage, "
                                  "and start each one as soon as its input is there")
        return self.summary


def _p_and_m_cases(rng) -> list[tuple[int, int]]:
    """One stage; m well below p (so that p - s - 1 warm-ups exceed m); m = p; m above p, twice."""
    p = [int(rng.integers(3, 7)) for _ in range(4)]
    return [(1, int(rng.integers(1, 5))), (p[0], int(rng.integers(1, p[0] - 1))), (p[1], p[1]),
            (p[2], int(rng.integers(p[2] + 1, 3 * p[2] + 1))), (p[3], int(rng.integers(p[3] + 1, 3 * p[3] + 1)))]


def _first_backward_before_last_forward(ops) -> tuple | None:
    last_forward = max(index for index, op in enumerate(ops) if op[0] == "F")
    return next((op for op in ops[:last_forward] if op[0] == "B"), None)


@exercise("pp.gpipe_schedule", points=1)
class GPipeSchedule(ScheduleCheck):
    """Verifies: one list per stage holding every F and B once, B after its F, no deadlock, every
    stage runs all its forwards before any backward (so it holds m micro-batches), and the time
    (m+p-1)(t_F+t_B) under random op times, for p from 1 to 6 and m below, at and above p.
    Fakes: a table of schedules cannot cover the random (p, m); dtp.pipeline's generator trips.
    """

    function, name = "gpipe_schedule", "GPipe"
    references = ("dtp.pipeline.gpipe_schedule",)
    summary = ("every stage runs all m forwards, then all m backwards; complete, deadlock-free, and as fast as GPipe "
               "can be, (m+p-1)(t_F+t_B), for random p, m and op times")

    def cases(self, rng):
        return _p_and_m_cases(rng)

    def check_property(self, schedule, call, p, m, v):
        for stage, ops in enumerate(schedule):
            early = _first_backward_before_last_forward(ops)
            if early is not None:
                raise CheckFailed(f"{call}: stage {stage} runs {describe_op(early)} before its last forward; GPipe "
                                  "runs all m forwards, then all m backwards")


@exercise("pp.one_f_one_b_schedule", points=2)
class OneFOneBSchedule(ScheduleCheck):
    """Verifies: complete, B after its F, no deadlock, stage s never holds more than min(p-s, m)
    micro-batches' activations (1F1B's defining bound, which GPipe's order breaks), and the time
    (m+p-1)(t_F+t_B) under random op times, for p from 1 to 6 and m below, at and above p.
    Any order with these properties passes (e.g. micro-batches numbered the other way).
    Fakes: random (p, m); dtp.pipeline's generator trips.
    """

    function, name = "one_f_one_b_schedule", "1F1B"
    references = ("dtp.pipeline.one_f_one_b_schedule",)
    summary = ("complete and deadlock-free; stage s never holds more than min(p-s, m) micro-batches, and the step takes "
               "(m+p-1)(t_F+t_B), for random p, m (below, at and above p) and op times")

    def cases(self, rng):
        return _p_and_m_cases(rng)

    def check_property(self, schedule, call, p, m, v):
        for stage, ops in enumerate(schedule):
            held, bound = _peak(ops, split=False), min(p - stage, m)
            expect(held <= bound, f"{call}: stage {stage} holds the activations of {held} micro-batches at once; "
                                  f"under 1F1B stage s holds at most min(p - s, m) = {bound}: run p - s - 1 warm-up "
                                  "forwards, then alternate one forward and one backward, then the remaining backwards")


@exercise("pp.interleaved_schedule", points=2)
class InterleavedSchedule(ScheduleCheck):
    """Verifies: every F and B of every (micro-batch, chunk) once, B after its F, no deadlock
    (chunk c of stage s is virtual stage c·p + s), no stage holding more than min((v+1)·p - 1, v·m)
    chunk activations at once, and the time (v·m + p-1)(t_F+t_B) of chunk ops under random op
    times, for p from 1 to 4, v = 2 and 3, m a multiple of p. Fakes: random cases; dtp.pipeline's
    generator trips.
    """

    function, name = "interleaved_schedule", "interleaved 1F1B"
    references = ("dtp.pipeline.interleaved_schedule",)
    summary = ("complete and deadlock-free over p·v virtual stages; bounded activations, (v+1)·p - 1 chunks at most, "
               "and a step of (v·m + p-1)(t_F+t_B): the bubble shrinks v times")

    def cases(self, rng):
        cases = [(1, int(rng.integers(1, 4)), 2)]
        for _ in range(4):
            p = int(rng.integers(2, 5))
            cases.append((p, p * int(rng.integers(1, 4)), int(rng.integers(2, 4))))
        return cases

    def check_property(self, schedule, call, p, m, v):
        bound = min((v + 1) * p - 1, v * m)
        for stage, ops in enumerate(schedule):
            held = _peak(ops, split=False)
            expect(held <= bound, f"{call}: stage {stage} holds {held} chunk activations at once; interleaved 1F1B "
                                  f"starts backwards after (v-1)·p + 2(p-s-1) warm-up forwards, so no stage holds more "
                                  f"than (v+1)·p - 1 = {bound}")


@exercise("pp.zb_h1_schedule", points=2)
class ZeroBubbleH1Schedule(ScheduleCheck):
    """Verifies: every F, B and W once, B after F and W after B, no deadlock, no stage holding more
    than min(p, m) micro-batches until their W (1F1B's peak), and, with t_F = t_B = t_W (the
    paper's assumption) and m >= p, the time m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W): a third of
    1F1B's bubble. p from 2 to 6, m below and above p. Fakes: random cases; dtp.pipeline's
    generator trips.
    """

    function, name, split = "zb_h1_schedule", "ZB-H1", True
    references = ("dtp.pipeline.zb_h1_schedule",)
    summary = ("B and W split, at most min(p, m) micro-batches held on any stage (1F1B's peak), and with equal op times "
               "a bubble of (p-1)·t, a third of 1F1B's, for random p and m")

    def cases(self, rng):
        cases = []
        for _ in range(5):
            p = int(rng.integers(2, 7))
            cases.append((p, int(rng.integers(p, 3 * p + 1))))
        p = int(rng.integers(3, 7))
        return cases + [(p, int(rng.integers(1, p)))]

    def timing(self, times, p, m):
        if m < p:
            return None
        return {kind: times["F"] for kind in KINDS}  # the paper's T_F = T_B = T_W

    def check_property(self, schedule, call, p, m, v):
        for stage, ops in enumerate(schedule):
            held, bound = _peak(ops, split=True), min(p, m)
            expect(held <= bound, f"{call}: stage {stage} holds {held} micro-batches' activations at once (until their "
                                  f"W); ZB-H1 keeps every stage at 1F1B's peak, min(p, m) = {bound}: delay at most s "
                                  "weight gradients on stage s, after 1F1B's p-s-1 warm-up forwards")


# --- 2. the timeline simulator ----------------------------------------------------------------

def random_valid_schedule(rng, p: int, m: int, v: int, split: bool) -> list[list[tuple]]:
    """Any order that can run: ops are appended to their stage's list one at a time, each only
    once everything it depends on is already in some list, picking stages and ops at random."""
    kinds = KINDS if split else ("F", "B")
    pending = [[(kind, mb, chunk) for mb in range(m) for chunk in range(v) for kind in kinds] for _ in range(p)]
    placed: set[tuple] = set()  # (kind, micro-batch, virtual stage)
    schedule: list[list[tuple]] = [[] for _ in range(p)]

    def runnable(op, stage):
        return all(need in placed for need in _needs(op, stage, p, v))

    while any(pending):
        choices = [(stage, op) for stage in range(p) for op in pending[stage] if runnable(op, stage)]
        stage, op = choices[int(rng.integers(len(choices)))]
        pending[stage].remove(op)
        schedule[stage].append(op)
        placed.add((op[0], op[1], op[2] * p + stage))
    return schedule


def _deadlocking_schedule(p: int, m: int) -> list[list[tuple]]:
    """Stage 0 runs each micro-batch's F then its B before the next F; stage 1 runs all its
    forwards first: stage 0 waits for a backward that stage 1 runs only after a forward stage 0
    has not sent."""
    gpipe = [("F", k, 0) for k in range(m)] + [("B", k, 0) for k in range(m)]
    return [[op for k in range(m) for op in (("F", k, 0), ("B", k, 0))]] + [list(gpipe) for _ in range(p - 1)]


class _TooSlow(BaseException):
    pass


def _call_with_alarm(function, args, seconds: float):
    """Call `function(*args)` with a time limit (a loop that never ends on a deadlocked
    schedule is reported as such, and the other cases are still judged)."""
    import signal

    def stop(signum, frame):
        raise _TooSlow

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return ("returned", function(*args))
    except _TooSlow:
        return ("too slow", None)
    except Exception as exc:  # noqa: BLE001 - the learner's exception is the answer here
        return ("raised", type(exc).__name__)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _describe_case(case: dict) -> str:
    times = ", ".join(f"{k}={t:.3g}" for k, t in case["times"].items())
    return f"the {case['label']} schedule (p={case['p']}, m={case['m']}" + (
        f", v={case['v']}" if case["v"] > 1 else "") + f"; times {times}; p2p_time={case['p2p']:.3g})"


def _slipped_simulations(schedule, times, p2p) -> dict[str, dict]:
    """Timelines a classic slip produces, to name the slip when a learner's timeline equals one."""
    slips = {}
    split = any(op[0] == "W" for ops in schedule for op in ops)
    if not split and times["W"] > 0:
        slips["in a schedule without W ops, B is the whole backward and takes times['B'] + times['W']"] = \
            event_simulation(schedule, {**times, "W": 0.0}, p2p)
    if p2p > 0:
        everywhere = _simulate_with_local_p2p(schedule, times, p2p)
        if everywhere is not None:
            slips["p2p_time is the time of a message between two stages; a result used on its own stage (B after its "
                  "F, W after its B, the next op of a stage) is there at once"] = everywhere
    return slips


def _simulate_with_local_p2p(schedule, times, p2p):
    """The timeline if every dependency, local ones too, paid p2p_time."""
    p = len(schedule)
    v = 1 + max(op[2] for ops in schedule for op in ops)
    split = any(op[0] == "W" for ops in schedule for op in ops)
    duration = {"F": times["F"], "B": times["B"] if split else times["B"] + times["W"], "W": times["W"]}
    ended, free = {}, [0.0] * p
    start = [[None] * len(ops) for ops in schedule]
    end = [[None] * len(ops) for ops in schedule]
    index = [0] * p
    progress = True
    while progress:
        progress = False
        for stage in range(p):
            while index[stage] < len(schedule[stage]):
                op = schedule[stage][index[stage]]
                needs = _needs(op, stage, p, v)
                if not all(need in ended for need in needs):
                    break
                begin = max([free[stage]] + [ended[need] + p2p for need in needs])
                start[stage][index[stage]], end[stage][index[stage]] = begin, begin + duration[op[0]]
                free[stage] = begin + duration[op[0]]
                ended[(op[0], op[1], op[2] * p + stage)] = free[stage]
                index[stage] += 1
                progress = True
    return {"start": start, "end": end} if all(index[s] == len(schedule[s]) for s in range(p)) else None


def _matches(mine, reference) -> bool:
    try:
        return all(len(a) == len(b) and np.allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float),
                                                   rtol=1e-9, atol=1e-9) for a, b in zip(mine, reference))
    except (TypeError, ValueError):
        return False


def _judge_timeline(case: dict, answer) -> None:
    what = _describe_case(case)
    schedule, times, p2p = case["schedule"], case["times"], case["p2p"]
    expected = event_simulation(schedule, times, p2p)
    expect(isinstance(answer, dict), f"for {what} simulate_pipeline returned a {type(answer).__name__}, not a dict")
    keys = ("start", "end", "makespan", "bubble_fraction", "peak_in_flight")
    missing = [key for key in keys if key not in answer]
    expect(not missing, f"for {what} the result has no {', '.join(map(repr, missing))}; return a dict with the keys "
                        f"{', '.join(keys)}")
    for key in ("start", "end"):
        got = answer[key]
        expect(isinstance(got, (list, tuple)) and len(got) == len(schedule) and all(
            isinstance(row, (list, tuple, np.ndarray)) and len(row) == len(ops) for row, ops in zip(got, schedule)),
            f"for {what}, {key!r} should hold one list per stage with one time per op, in the schedule's order")
    if not (_matches(answer["start"], expected["start"]) and _matches(answer["end"], expected["end"])):
        for slip, timeline in _slipped_simulations(schedule, times, p2p).items():
            if _matches(answer["start"], timeline["start"]) and _matches(answer["end"], timeline["end"]):
                raise CheckFailed(f"for {what} your timeline is off: {slip}")
        for stage, ops in enumerate(schedule):
            for index, op in enumerate(ops):
                for key in ("start", "end"):
                    got, want = answer[key][stage][index], expected[key][stage][index]
                    if not np.isclose(float(got), want, rtol=1e-9, atol=1e-9):
                        raise CheckFailed(f"for {what}: stage {stage}'s op {index}, {describe_op(op, case['v'])}, "
                                          f"{'starts' if key == 'start' else 'ends'} at {float(got):.6g} in your "
                                          f"timeline and at {want:.6g} in the grader's. "
                                          + _why_it_starts(case, expected, stage, index))
    expect_answer(answer["makespan"], expected["makespan"], f"the makespan for {what}", rel=1e-9)
    busy_ratio = expected["bubble_over_ideal"]
    expect_answer(answer["bubble_fraction"], expected["bubble_fraction"], f"the bubble fraction for {what}", rel=1e-9,
                  slips={"that is idle time over busy time; the bubble fraction is idle time over all stage-time, "
                         "p × makespan": busy_ratio})
    peaks = answer["peak_in_flight"]
    expect(isinstance(peaks, (list, tuple)) and len(peaks) == len(schedule),
           f"for {what}, 'peak_in_flight' should hold one number per stage")
    if list(peaks) != expected["peak_in_flight"]:
        split = any(op[0] == "W" for ops in schedule for op in ops)
        if split and list(peaks) == [_peak(ops, False) for ops in schedule]:
            raise CheckFailed(f"for {what} peak_in_flight is {list(peaks)}: with a split backward a micro-batch's "
                              "activations are held until its W (the weight gradient needs them), not only its B")
        raise CheckFailed(f"for {what} peak_in_flight is {list(peaks)}, expected {expected['peak_in_flight']}: a stage "
                          "holds a micro-batch's activations from the start of its F to the end of its last backward op")


def _why_it_starts(case, expected, stage, index) -> str:
    """What the grader's start time of an op is the maximum of."""
    schedule, p, v = case["schedule"], case["p"], case["v"]
    op = schedule[stage][index]
    reasons = [f"stage {stage} is free from {expected['end'][stage][index - 1]:.6g}" if index else
               f"it is stage {stage}'s first op"]
    ends = {(o[0], o[1], o[2] * p + s): expected["end"][s][i] for s, ops in enumerate(schedule) for i, o in enumerate(ops)}
    for need in _needs(op, stage, p, v):
        hop = case["p2p"] if need[2] % p != stage else 0.0
        where = f"on stage {need[2] % p}" + (f", plus p2p_time {hop:.3g}" if hop else ", the same stage")
        reasons.append(f"{describe_op((need[0], need[1], need[2] // p), v)} ends at {ends[need]:.6g} ({where})")
    return "It starts at the latest of: " + "; ".join(reasons) + "."


@exercise("pp.simulator", points=3)
class Simulator(Check):
    """Verifies: start and end of every op, makespan, bubble fraction and peak activations per
    stage against the grader's event simulation, on the course's four schedules and on random
    valid orders (split backward or not, v = 1 and 2, p = 1 to 5) with random op times and P2P
    times; a deadlocking order must raise ValueError (or any exception) within 2 seconds.
    Fakes: a simulator that only knows the textbook schedules fails the random orders;
    dtp.pipeline.simulate trips.
    """

    reads = ("simulate_pipeline",)
    references = ("dtp.pipeline.simulate",)
    timeout_s = 30

    def prepare(self, rng):
        cases = []
        for label in ("GPipe", "1F1B", "interleaved 1F1B", "ZB-H1"):
            p = int(rng.integers(1, 5)) if label != "ZB-H1" else int(rng.integers(2, 5))
            v = int(rng.integers(2, 4)) if label == "interleaved 1F1B" else 1
            m = p * int(rng.integers(1, 4)) if v > 1 else int(rng.integers(1, 9))
            cases.append((label, p, m, v, pipeline.make_schedule(label, p, m, v)))
        for split, v in ((False, 1), (True, 1), (False, 2), (True, 2)):
            p, m = int(rng.integers(2, 6)), int(rng.integers(1, 6))
            cases.append((f"random {'split-backward ' if split else ''}order", p, m, v,
                          random_valid_schedule(rng, p, m, v, split)))
        for _ in range(100):  # one order at least where freeing activations at B, not W, shows in the peak
            if any(any(pipeline.max_in_flight(ops, split=False) != pipeline.max_in_flight(ops, split=True)
                       for ops in schedule)
                   for *_, schedule in cases if any(op[0] == pipeline.WEIGHT for ops in schedule for op in ops)):
                break
            p, m = int(rng.integers(2, 6)), int(rng.integers(2, 6))
            cases.append(("random split-backward order", p, m, 1, random_valid_schedule(rng, p, m, 1, True)))
        drawn = []
        for label, p, m, v, schedule in cases:
            times = {kind: float(rng.uniform(0.2, 2.0)) for kind in KINDS}
            p2p = float(rng.choice([0.0, rng.uniform(0.01, 0.5)]))
            drawn.append({"label": label, "p": p, "m": m, "v": v, "times": times, "p2p": p2p,
                          "schedule": [[tuple(op) for op in ops] for ops in schedule]})
        p, m = int(rng.integers(2, 5)), int(rng.integers(2, 6))
        deadlock = {"label": "deadlocking", "p": p, "m": m, "v": 1, "times": {k: 1.0 for k in KINDS}, "p2p": 0.0,
                    "schedule": _deadlocking_schedule(p, m)}
        return {"cases": drawn, "deadlock": deadlock}

    def collect(self, student, inputs):
        answers = [student.simulate_pipeline([list(ops) for ops in case["schedule"]], dict(case["times"]), case["p2p"])
                   for case in inputs["cases"]]
        deadlock = inputs["deadlock"]
        outcome = _call_with_alarm(student.simulate_pipeline, ([list(ops) for ops in deadlock["schedule"]],
                                                               dict(deadlock["times"]), 0.0), 2.0)
        return {"answers": answers, "deadlock": [outcome[0], outcome[1] if outcome[0] == "raised" else None]}

    def judge(self, inputs, data) -> str:
        answers = data["answers"]
        expect(len(answers) == len(inputs["cases"]), "the grader's calls did not all return")
        for case, answer in zip(inputs["cases"], answers):
            _judge_timeline(case, answer)
        outcome, exception = data["deadlock"]
        what = _describe_case(inputs["deadlock"])
        expect(outcome != "too slow", f"on {what} simulate_pipeline was still running after 2 s: when no stage can "
                                      "start its next op, raise ValueError instead of waiting")
        expect(outcome == "raised", f"on {what} simulate_pipeline returned a result, but no stage can ever finish: "
                                    "stage 0 waits for a backward that stage 1 runs after a forward stage 0 never "
                                    "sends. Raise ValueError when the ops left can never start")
        return ("every op's start and end, the makespan, the bubble fraction and the peak activations match an event "
                "simulation on the four schedules and random valid orders with P2P times; a deadlock raises")


# --- 3. closed forms --------------------------------------------------------------------------

def _simulated(name: str, p: int, m: int, v: int, rng) -> dict:
    """The oracle for a closed form: the event simulation of the course's schedule, op times random."""
    times = {"F": float(rng.uniform(0.5, 2.0)), "B": float(rng.uniform(0.5, 2.0)), "W": 0.0}
    return event_simulation(pipeline.make_schedule(name, p, m, v), times)


@exercise("pp.closed_forms", points=2)
class ClosedForms(Check):
    """Verifies: bubble_fraction(p, m, v) and bubble_over_ideal(p, m, v) equal the idle share of
    total time and the idle-to-busy ratio of event-simulated GPipe, 1F1B and interleaved 1F1B
    steps with random op times (v = 1, and v = 2 or 3 with m a multiple of p);
    peak_in_flight(schedule, p, m, stage) equals the simulated peak of GPipe and 1F1B on every
    stage, m below and above p. Fakes: dtp.pipeline's closed forms trip; inputs are random.
    """

    reads = ("bubble_fraction", "bubble_over_ideal", "peak_in_flight")
    references = ("dtp.pipeline.bubble_fraction", "dtp.pipeline.bubble_over_ideal", "dtp.pipeline.peak_in_flight")
    timeout_s = 15

    def prepare(self, rng):
        bubbles = []
        for _ in range(6):
            p = int(rng.integers(2, 9))
            v = int(rng.choice([1, 1, 2, 3]))
            m = p * int(rng.integers(1, 4)) if v > 1 else int(rng.integers(1, 17))
            name = "interleaved 1F1B" if v > 1 else str(rng.choice(["GPipe", "1F1B"]))
            timeline = _simulated(name, p, m, v, rng)
            bubbles.append(((p, m, v), name, timeline["bubble_fraction"], timeline["bubble_over_ideal"]))
        peaks = []
        for name, fewer in (("GPipe", bool(rng.integers(2))), ("1F1B", True), ("1F1B", False)):
            p = int(rng.integers(3, 9))
            m = int(rng.integers(1, p)) if fewer else int(rng.integers(p, 3 * p))  # m below p, then at or above
            timeline = _simulated(name, p, m, 1, rng)
            for stage in sorted({0, int(rng.integers(1, p)), p - 1}):
                peaks.append(((name, p, m, stage), timeline["peak_in_flight"][stage]))
        return {"bubbles": bubbles, "peaks": peaks}

    def collect(self, student, inputs):
        bubbles = [(student.bubble_fraction(*args) if args[2] > 1 else student.bubble_fraction(args[0], args[1]),
                    student.bubble_over_ideal(*args) if args[2] > 1 else student.bubble_over_ideal(args[0], args[1]))
                   for args, _, _, _ in inputs["bubbles"]]
        peaks = [student.peak_in_flight(*args) for args, _ in inputs["peaks"]]
        return {"bubbles": bubbles, "peaks": peaks}

    def judge(self, inputs, data) -> str:
        for ((p, m, v), name, fraction, ratio), (mine_fraction, mine_ratio) in zip(inputs["bubbles"], data["bubbles"]):
            args = (p, m, v) if v > 1 else (p, m)
            where = f" (simulated {name})"
            expect_answer(mine_fraction, fraction, describe_call("bubble_fraction", args, {}) + where, rel=1e-9, slips={
                "that is (p-1)/(v·m), the bubble relative to the ideal time (Megatron-LM's ratio); bubble_fraction is "
                "the share of the whole step: idle / (idle + busy) = (p-1)/(v·m + p-1)": (p - 1) / (v * m),
                "that ignores the v chunks: interleaving makes each bubble step v times shorter": (p - 1) / (m + p - 1),
                "that is the source notes' slip: the step lasts m + p - 1 slots, not m + p - 2": (p - 1) / (v * m + p - 2)})
            expect_answer(mine_ratio, ratio, describe_call("bubble_over_ideal", args, {}) + where, rel=1e-9, slips={
                "that is the share of the whole step; bubble_over_ideal divides the idle time by the busy (ideal) "
                "time, v·m slots: (p-1)/(v·m)": (p - 1) / (v * m + p - 1),
                "that ignores the v chunks: interleaving makes each bubble step v times shorter": (p - 1) / m})
        for ((name, p, m, stage), peak), mine in zip(inputs["peaks"], data["peaks"]):
            slips = {}
            if name == "1F1B":
                slips = {"that is GPipe's peak: 1F1B starts backwards early, so stage s holds min(p - s, m)": m,
                         "that holds for the first stage; stage s holds min(p - s, m)": min(p, m),
                         "stage s holds at most p - s, but never more than the m micro-batches there are": p - stage}
            expect_answer(mine, peak, describe_call("peak_in_flight", (name, p, m, stage), {}), rel=0, slips=slips)
        return ("bubble fraction (of the whole step) and bubble over ideal time match simulated GPipe, 1F1B and "
                "interleaved steps; peak activations match GPipe (m) and 1F1B on every stage")


# --- 4. a real 1F1B pipeline on gloo ----------------------------------------------------------

WIDTHS = dict(d_in=6, width=8, d_out=3)


def _pipeline_batch(seed: int, m: int, micro_batch: int):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(m * micro_batch, WIDTHS["d_in"], generator=generator),
            torch.randn(m * micro_batch, WIDTHS["d_out"], generator=generator))


def _pipeline_rank(rank, world_size, step, seed, m, micro_batch):
    stage = pipeline.pipeline_stages(world_size, seed, **WIDTHS)[rank]
    order: list[str] = []  # what the stage computed, in order: "F" per forward, "B" per backward

    def forward_hook(module, inputs, output):
        order.append("F")
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: order.append("B"))

    stage.register_forward_hook(forward_hook)
    batch, targets = _pipeline_batch(seed, m, micro_batch)
    with CommunicationLog(payloads=True) as log:
        loss = step(stage, batch, targets, m, (micro_batch, WIDTHS["width"]))
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        loss = loss.item()
    grads = {name: (parameter.grad.clone() if parameter.grad is not None else None)
             for name, parameter in stage.named_parameters()}
    return {"loss": loss, "grads": grads, "order": order, "events": events_as_data(log, payloads=True)}


def single_process_reference(p: int, seed: int, m: int, micro_batch: int) -> dict:
    """The oracle: the whole model on the full batch in one process (mean-squared error over the
    batch); plus, per micro-batch, the activation at every stage boundary and the gradient of the
    step's loss with respect to it (its micro-batch's loss divided by m)."""
    stages = pipeline.pipeline_stages(p, seed, **WIDTHS)
    batch, targets = _pipeline_batch(seed, m, micro_batch)
    loss = nn.functional.mse_loss(nn.Sequential(*stages)(batch), targets)
    loss.backward()
    grads = [{name: parameter.grad.numpy().copy() for name, parameter in stage.named_parameters()} for stage in stages]
    activations = [[None] * m for _ in range(p - 1)]  # boundary s (after stage s) -> micro-batch -> tensor
    gradients = [[None] * m for _ in range(p - 1)]
    for k, (x, y) in enumerate(zip(batch.tensor_split(m), targets.tensor_split(m))):
        boundary = []
        for s, stage in enumerate(stages):
            x = stage(x)
            if s < p - 1:
                x.retain_grad()
                boundary.append(x)
        (nn.functional.mse_loss(x, y) / m).backward()
        for s, tensor in enumerate(boundary):
            activations[s][k], gradients[s][k] = tensor.detach().numpy(), tensor.grad.numpy()
    return {"loss": loss.item(), "grads": grads, "activations": activations, "gradients": gradients}


def _which(payload, candidates) -> int | None:
    for index, candidate in enumerate(candidates):
        if payload.shape == candidate.shape and np.allclose(payload, candidate, rtol=1e-4, atol=1e-6):
            return index
    return None


def _judge_messages(events: list, rank: int, p: int, m: int, micro_batch: int, reference: dict, world: str) -> None:
    other = sorted({e["op"] for e in events} - {"send", "recv", "wait"})
    expect(not other, f"{world}: rank {rank} called {', '.join(other)}; pipeline stages talk to their neighbours with "
                      "point-to-point send/recv (isend/irecv) only")
    sends = [e for e in events if e["op"] == "send"]
    for event in sends:
        expect(event["peer"] in (rank - 1, rank + 1),
               f"{world}: rank {rank} sent to rank {event['peer']}; a stage sends activations to rank {rank + 1} and "
               f"gradients to rank {rank - 1} only")
    size = micro_batch * WIDTHS["width"] * 4
    for direction, peer, what, table in (("forward", rank + 1, "activation", reference["activations"]),
                                         ("backward", rank - 1, "gradient", reference["gradients"])):
        if not 0 <= peer < p:
            continue
        sent = [e for e in sends if e["peer"] == peer]
        expect(len(sent) == m, f"{world}: rank {rank} sent {len(sent)} messages to rank {peer} for m = {m} micro-batches; "
                               f"each micro-batch's {what} crosses every stage boundary in its own message, one per "
                               f"micro-batch in each direction")
        boundary = rank if direction == "forward" else rank - 1
        seen = set()
        for number, event in enumerate(sent, 1):
            payload = np.concatenate([np.ravel(t) for t in event["payload"]]) if event["payload"] else np.zeros(0)
            expect(event["bytes"] == size, f"{world}: rank {rank}'s message {number} to rank {peer} has {event['bytes']} "
                                           f"bytes; one micro-batch's {what} is {micro_batch} × {WIDTHS['width']} float32, "
                                           f"{size} bytes")
            candidates = [np.ravel(t) for t in table[boundary]]
            index = _which(payload, candidates)
            if index is None and what == "gradient" and _which(payload / m, candidates) is not None:
                raise CheckFailed(f"{world}: rank {rank} sent gradients m = {m} times too large: the step's loss is the "
                                  "mean over the whole batch, so divide each micro-batch's loss by m")
            if index is None:
                hint = (" Did rank {r} run backward on the wrong micro-batch's output? 1F1B's backwards come in the "
                        "order of the forwards: keep each micro-batch's tensors in a first-in, first-out queue"
                        if what == "gradient" else " Is the stage's input the right micro-batch?").format(r=rank)
                raise CheckFailed(f"{world}: rank {rank}'s {what} message {number} to rank {peer} is not the {what} of "
                                  f"any micro-batch at that stage boundary.{hint}")
            expect(index not in seen, f"{world}: rank {rank} sent the {what} of micro-batch {index} twice")
            seen.add(index)


def _judge_order(order: list, rank: int, p: int, m: int, world: str) -> None:
    forwards, backwards = order.count("F"), order.count("B")
    expect(forwards == m and backwards == m,
           f"{world}: rank {rank}'s stage ran {forwards} forward and {backwards} backward passes; a pipeline step runs "
           f"each of the m = {m} micro-batches through it once each way (call the stage on one micro-batch at a time)")
    held = peak = 0
    for kind in order:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    bound = min(p - rank, m)
    expect(peak <= bound, f"{world}: rank {rank} held {peak} micro-batches' activations at once; under 1F1B stage s holds "
                          f"at most min(p - s, m) = {bound}: after p - s - 1 warm-up forwards, alternate one forward "
                          "and one backward")
    expect(peak == bound, f"{world}: rank {rank} never had more than {peak} micro-batches in flight, where 1F1B has "
                          f"{bound}: with fewer warm-up forwards (p - s - 1 on stage s) the stages wait for each other "
                          "and the pipeline does not fill")


@exercise("pp.pipeline_1f1b", points=4)
class Pipeline1F1B(Check):
    """Verifies: on 2, 3 and 4 gloo processes with random m (below and above p) and micro-batch
    sizes, the last rank's loss and every stage's gradients equal single-process training on the
    full batch; only send/recv between neighbours, m messages each way across every boundary,
    each carrying one micro-batch's activation (or gradient, with the 1/m of the mean loss) as
    the single-process computation has it; each stage ran m forwards and m backwards with exactly
    1F1B's min(p - s, m) micro-batches in flight at its peak.
    Fakes: GPipe's order (peak m), a stage that waits for each backward before the next forward
    (peak 1), collectives or data sent whole, a backward on the wrong micro-batch (its gradient
    message matches no micro-batch); nothing else reaches a stage's parameters.
    """

    reads = ("one_f_one_b_step",)
    timeout_s = 60
    runs_world = True

    def prepare(self, rng):
        worlds = []
        for p, low, high in ((2, 1, 6), (3, 2, 7), (4, 3, 9)):
            worlds.append((p, int(rng.integers(1 << 20)), int(rng.integers(low, high + 1)), int(rng.integers(1, 4))))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(_pipeline_rank, [(p, (student.one_f_one_b_step, seed, m, micro_batch))
                                           for p, seed, m, micro_batch in worlds])

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        runs = [(p, m, micro_batch, f"p = {p} processes, m = {m} micro-batches of {micro_batch}",
                 single_process_reference(p, seed, m, micro_batch), per_rank)
                for (p, seed, m, micro_batch), per_rank in zip(worlds, done)]
        # Each property over every world before the next, so that the feedback names the most
        # telling mistake: what was sent (and for which micro-batch), the order, then the results.
        for p, m, micro_batch, world, reference, per_rank in runs:
            for rank, outcome in enumerate(per_rank):
                _judge_messages(outcome["events"], rank, p, m, micro_batch, reference, world)
        for p, m, micro_batch, world, reference, per_rank in runs:
            for rank, outcome in enumerate(per_rank):
                _judge_order(outcome["order"], rank, p, m, world)
        for p, m, micro_batch, world, reference, per_rank in runs:
            loss = per_rank[-1]["loss"]
            expect(loss is not None, f"{world}: the last rank returned None; it should return the step's loss, the mean "
                                     "over the full batch")
            expect_answer(loss, reference["loss"], f"{world}: the loss the last rank returned", rel=1e-4, slips={
                f"that is the sum of the micro-batches' mean losses; divide each by m = {m}": reference["loss"] * m})
            for rank, outcome in enumerate(per_rank):
                grads = outcome["grads"]
                for name, expected in reference["grads"][rank].items():
                    expect(grads.get(name) is not None, f"{world}: rank {rank}'s parameter {name} has no gradient")
                    expect_close(grads[name], expected, f"{world}: rank {rank}'s gradient of {name}", rtol=1e-4, atol=1e-6)
        raise_world_failure(failure)
        return ("loss and every gradient equal single-process training on the full batch for p = 2, 3 and 4; one message "
                "per micro-batch each way across each boundary, and exactly 1F1B's activations in flight")


# --- 5. the bubble of the real pipeline, measured ---------------------------------------------

SLEEP_P = 4
SLEEP_MS = (4, 8, 16)  # micro-batch counts
FORWARD_S, BACKWARD_S = 0.05, 0.1  # each op sleeps this long; see tests/test_pp_load.py for why
BUBBLE_TOLERANCE = 0.03


def _busy_intervals(log: list) -> list[tuple[float, float]]:
    return [(start, end) for _, _, start, end in log]


def _judge_sleeping_run(logs: list, m: int) -> float:
    """The measured bubble of one run, after checking that its timeline is one a pipeline could
    have: every op once, each at least its sleep long, none overlapping on a stage, and each
    after the op it depends on on the neighbouring stage (times are the grader's own)."""
    p = len(logs)
    world = f"p = {p}, m = {m}"
    when = [{(kind, micro_batch): (start, end) for kind, micro_batch, start, end in log} for log in logs]
    for rank, log in enumerate(logs):
        ran = sorted((kind, micro_batch) for kind, micro_batch, _, _ in log)
        expect(ran == sorted((kind, k) for kind in "FB" for k in range(m)),
               f"{world}: rank {rank}'s stage did not run each micro-batch forward and backward exactly once")
        for kind, micro_batch, start, end in log:
            least = FORWARD_S if kind == "F" else BACKWARD_S
            expect(end - start >= least * 0.999, f"{world}: a {kind} op took {end - start:.4f} s, shorter than its "
                                                 f"{least} s sleep: the timeline is not one the stages produced")
        ordered = sorted(log, key=lambda op: op[2])
        expect(all(a[3] <= b[2] + 1e-6 for a, b in zip(ordered, ordered[1:])),
               f"{world}: rank {rank}'s ops overlap in time")
    for rank in range(p - 1):
        for k in range(m):
            expect(when[rank + 1][("F", k)][0] >= when[rank][("F", k)][1] - 1e-6 and
                   when[rank][("B", k)][0] >= when[rank + 1][("B", k)][1] - 1e-6,
                   f"{world}: micro-batch {k} reached a stage before the stage it comes from had finished it")
    return pipeline.idle_fraction([_busy_intervals(log) for log in logs])


@exercise("pp.measured_bubble", points=2)
class MeasuredBubble(Check):
    """Verifies: the learner's 1F1B step, run on 4 gloo processes whose stages sleep 50 ms per
    forward and 100 ms per backward (timed by grader code), idles within 3 percentage points of
    (p-1)/(m+p-1) for m = 4, 8 and 16 (a run more than 3 points over is repeated, up to 3 runs,
    and the least idle one counts: load from other processes only adds idle time); and
    measured_bubble returns the idle share of every run's intervals and of random intervals.
    Fakes: every run's timeline must be one the stages could produce (every op once, at least its
    sleep long, after what it depends on); a pipeline that serialises its stages idles
    3(m-1)/(4m) or more in every run; dtp.pipeline.idle_fraction trips.
    """

    reads = ("one_f_one_b_step", "measured_bubble")
    references = ("dtp.pipeline.idle_fraction",)
    timeout_s = 60
    runs_world = True

    def prepare(self, rng):
        stages = int(rng.integers(2, 6))
        synthetic = []
        for _ in range(stages):
            edges = np.sort(rng.uniform(0.0, 10.0, 2 * int(rng.integers(1, 5))))
            synthetic.append([(float(a), float(b)) for a, b in zip(edges[::2], edges[1::2])])
        return {"synthetic": synthetic}

    def collect(self, student, inputs):
        from .common import world_options

        runs = []
        for m in SLEEP_MS:
            attempts = pipeline.measure_sleeping_pipeline(student.one_f_one_b_step, SLEEP_P, m, FORWARD_S, BACKWARD_S,
                                                          retry_above=BUBBLE_TOLERANCE, **world_options())
            runs.append([{"logs": logs, "measured": student.measured_bubble([_busy_intervals(log) for log in logs])}
                         for logs in attempts])
        return {"runs": runs, "synthetic": student.measured_bubble([list(stage) for stage in inputs["synthetic"]])}

    def judge(self, inputs, data) -> str:
        expect_answer(data["synthetic"], pipeline.idle_fraction(inputs["synthetic"]),
                      "measured_bubble on the grader's random intervals", rel=1e-9)
        for m, attempts in zip(SLEEP_MS, data["runs"]):
            bubbles = []
            for run in attempts:
                bubble = _judge_sleeping_run(run["logs"], m)
                expect_answer(run["measured"], bubble, f"measured_bubble of the run with m = {m}", rel=1e-9, slips={
                    "that is idle time over busy time; the bubble is the idle share of p × (last end - first start)":
                        bubble / (1 - bubble)})
                bubbles.append(bubble)
            bubble = min(bubbles)  # load on the machine only adds idle time: the least idle run is the pipeline's
            expected = pipeline.bubble_fraction(SLEEP_P, m)
            if abs(bubble - expected) > BUBBLE_TOLERANCE:
                raise CheckFailed(f"with p = {SLEEP_P} and m = {m} your pipeline idled {bubble:.1%} of the time; 1F1B's "
                                  f"bubble is (p-1)/(m+p-1) = {expected:.1%} (tolerance {BUBBLE_TOLERANCE:.0%}). "
                                  + ("A stage waited for messages longer than the schedule makes it: send each "
                                     "activation and gradient as soon as it is computed (isend), and receive only "
                                     "what the next op needs" if bubble > expected else
                                     "Less idle time than the schedule allows: are the stages' sleeps all there?"))
        return ("with 4 sleeping stages your pipeline idles within 3 points of (p-1)/(m+p-1) for m = 4, 8 and 16, and "
                "measured_bubble computes the idle share right")


# --- 6. interview questions -------------------------------------------------------------------

INTERVIEW = dict(p=8, m=64, micro_batch=1, sequence=4096, hidden=8192, bytes_per_value=2)


@exercise("pp.interview", points=2)
class Interview(FixedAnswers):
    """Verifies: four answers about a pipeline of p = 8 stages and m = 64 micro-batches: the bubble
    as a share of the step, the micro-batches stage 0 holds under 1F1B, the messages and the GiB
    that cross one stage boundary per step. Fakes: fixed questions, so a copied number passes;
    worth two points for that reason."""

    reads = ("interview_bubble_fraction", "interview_peak_micro_batches", "interview_boundary_messages",
             "interview_boundary_gib")

    def judge(self, inputs, answers) -> str:
        q = INTERVIEW
        p, m = q["p"], q["m"]
        activation = q["micro_batch"] * q["sequence"] * q["hidden"] * q["bytes_per_value"]
        expect_answer(answers[0], pipeline.bubble_fraction(p, m), "interview_bubble_fraction", rel=1e-6, slips={
            "that is 7/70, the source notes' slip: the step lasts m + p - 1 = 71 slots": (p - 1) / (m + p - 2),
            "that is (p-1)/m, relative to the ideal time; the question asks for the share of the whole step":
                (p - 1) / m})
        expect_answer(answers[1], pipeline.peak_in_flight("1F1B", p, m, 0), "interview_peak_micro_batches", rel=1e-9,
                      slips={"that is GPipe's m; under 1F1B more micro-batches do not mean more activations": m})
        expect_answer(answers[2], 2 * m, "interview_boundary_messages", rel=1e-9, slips={
            "a pipeline does not send once per step: every micro-batch crosses every boundary": 1,
            "that counts one direction; each micro-batch's gradient comes back across the boundary too": m,
            "that counts every boundary; the question asks about one": pipeline.boundary_messages_per_step(p, m)})
        gib = pipeline.boundary_bytes_per_step(m, q["micro_batch"], q["sequence"], q["hidden"], q["bytes_per_value"]) / 2**30
        expect_answer(answers[3], gib, "interview_boundary_gib", rel=1e-6, slips={
            "that is one activation, as if the pipeline sent once per step": activation / 2**30,
            "that counts one direction; the gradients come back too": gib / 2,
            "that is in GB (10^9 bytes); the question asks for GiB (2^30)": gib * 2**30 / 1e9})
        return "all four interview answers are right"
