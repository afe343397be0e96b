"""Exercise 1: the four schedule generators, judged against the grader's own event simulation
(a priority queue of op completions and message arrivals, independent of `dtp.pp.schedules.simulate`,
which is a longest-path computation; tests/pp/test_pp_pipeline.py holds both to the closed forms)."""
from __future__ import annotations

import heapq
from collections import Counter

import numpy as np

from dtp.pp import schedules as pipeline

from ...compare import CheckFailed, expect
from ...registry import Check, exercise
from ..common import describe_call

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
    name = ""  # the schedule's name in dtp.pp.schedules.SCHEDULES
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
    Fakes: a table of schedules cannot cover the random (p, m); dtp.pp.schedules's generator trips.
    """

    function, name = "gpipe_schedule", "GPipe"
    references = ("dtp.pp.schedules.gpipe_schedule",)
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
    Fakes: random (p, m); dtp.pp.schedules's generator trips.
    """

    function, name = "one_f_one_b_schedule", "1F1B"
    references = ("dtp.pp.schedules.one_f_one_b_schedule",)
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
    times, for p from 1 to 4, v = 2 and 3, m = p, 2p and 3p in every grading. Fakes: random
    cases; a breadth-first order (each chunk for all m micro-batches before the next chunk, with
    the warm-up it needs) holds more than the bound whenever m >= 2p, drawn every time;
    dtp.pp.schedules's generator trips.
    """

    function, name = "interleaved_schedule", "interleaved 1F1B"
    references = ("dtp.pp.schedules.interleaved_schedule",)
    summary = ("complete and deadlock-free over p·v virtual stages; bounded activations, (v+1)·p - 1 chunks at most, "
               "and a step of (v·m + p-1)(t_F+t_B): the bubble shrinks v times")

    def cases(self, rng):
        # m = p, 2p and 3p in every grading: a breadth-first order (all m micro-batches through a
        # chunk before the next chunk) is Megatron-LM's order when m = p, and holds too much from m = 2p on
        cases = [(1, int(rng.integers(1, 4)), 2)]
        for rounds in (1, 2, 3, int(rng.integers(1, 4))):
            p = int(rng.integers(2, 5))
            cases.append((p, p * rounds, int(rng.integers(2, 4))))
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
    than min(p, m) micro-batches until their W (1F1B's peak), and, for m >= p, the time
    m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W) with t_F = t_B = t_W (the paper's assumption: a third
    of 1F1B's bubble) and with random times t_W <= min(t_F, t_B), where the closed form holds.
    p from 2 to 6, m below and above p. Fakes: random cases; dtp.pp.schedules's generator trips.
    """

    function, name, split = "zb_h1_schedule", "ZB-H1", True
    references = ("dtp.pp.schedules.zb_h1_schedule",)
    summary = ("B and W split, at most min(p, m) micro-batches held on any stage (1F1B's peak), and the step takes "
               "m(t_F+t_B+t_W) + (p-1)(t_F+t_B-t_W) for equal and for random op times with t_W <= min(t_F, t_B): "
               "with equal times a third of 1F1B's bubble")

    def cases(self, rng):
        cases = []
        for _ in range(5):
            p = int(rng.integers(2, 7))
            cases.append((p, int(rng.integers(p, 3 * p + 1))))
        p = int(rng.integers(3, 7))
        return cases + [(p, int(rng.integers(1, p)))]

    def prepare(self, rng):
        # The closed form holds for t_W <= min(t_F, t_B) (verified with the simulator on random
        # times, tests/pp/test_pp_pipeline.py): the first case takes the paper's T_F = T_B = T_W, the
        # others random times in that range, t_W at most and sometimes exactly the smaller one.
        drawn = []
        for index, case in enumerate(self.cases(rng)):
            t_f, t_b = (float(t) for t in rng.uniform(0.5, 2.0, 2))
            if index == 0:
                t_f = t_b = t_w = t_f
            else:
                t_w = min(t_f, t_b) * (1.0 if index == 1 else float(rng.uniform(0.1, 1.0)))
            drawn.append((case, {"F": t_f, "B": t_b, "W": t_w}))
        return drawn

    def timing(self, times, p, m):
        return times if m >= p else None

    def check_property(self, schedule, call, p, m, v):
        for stage, ops in enumerate(schedule):
            held, bound = _peak(ops, split=True), min(p, m)
            expect(held <= bound, f"{call}: stage {stage} holds {held} micro-batches' activations at once (until their "
                                  f"W); ZB-H1 keeps every stage at 1F1B's peak, min(p, m) = {bound}: delay at most s "
                                  "weight gradients on stage s, after 1F1B's p-s-1 warm-up forwards")
