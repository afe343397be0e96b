"""Exercise 2: the learner's timeline simulator, against the grader's event simulation on the
course's schedules, random valid orders and a deadlocking order."""
from __future__ import annotations

import numpy as np

from dtp.pp import schedules as pipeline

from ...compare import CheckFailed, expect, expect_answer
from ...registry import Check, exercise
from .schedules import KINDS, _needs, _peak, describe_op, event_simulation

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
                              "activations count as held until its W (the weight gradient still needs some of them, each "
                              "linear layer's input), not only until its B")
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
    dtp.pp.schedules.simulate trips.
    """

    reads = ("simulate_pipeline",)
    references = ("dtp.pp.schedules.simulate",)
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
            # 1F1B always with a message time: its last stage runs B right after F of the same
            # micro-batch, so an answer that charges p2p_time for a stage's own result shows every grading
            # (with free draws of zero it passed about 1 grading in 100).
            p2p = float(rng.uniform(0.01, 0.5) if label == "1F1B" else rng.choice([0.0, rng.uniform(0.01, 0.5)]))
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
