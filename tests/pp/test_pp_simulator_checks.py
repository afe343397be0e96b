"""Exercises 2 and 3 of the pipeline chapter: the simulator and closed-form checks reject
plausible wrong answers with feedback that names the mistake, and accept correct answers written
differently from the course's."""
import numpy as np
import pytest

from conftest import assert_fails, graded
from grader.checks.pp.closed_forms import ClosedForms
from grader.checks.pp.simulator import Simulator


# --- exercise 2: the simulator ---

SIMULATOR_TEMPLATE = '''
def simulate_pipeline(schedule, times, p2p_time=0.0):
    p = len(schedule)
    v = 1 + max(op[2] for ops in schedule for op in ops)
    split = any(op[0] == "W" for ops in schedule for op in ops)
    duration = {{"F": times["F"], "B": {B_TIME}, "W": times["W"]}}
    def needs(kind, mb, virtual):
        if kind == "F":
            return [("F", mb, virtual - 1)] if virtual > 0 else []
        if kind == "B":
            return [("F", mb, virtual)] + ([("B", mb, virtual + 1)] if virtual < p * v - 1 else [])
        return [("B", mb, virtual)]
    ended, start, end = {{}}, [[None] * len(o) for o in schedule], [[None] * len(o) for o in schedule]
    nxt, free = [0] * p, [0.0] * p
    progress = True
    while {LOOP}:
        progress = False
        for s in range(p):
            while nxt[s] < len(schedule[s]):
                kind, mb, chunk = schedule[s][nxt[s]]
                deps = needs(kind, mb, chunk * p + s)
                if not all(d in ended for d in deps):
                    break
                i = nxt[s]
                start[s][i] = max([{FREE}] + [ended[d] + ({HOP}) for d in deps])
                end[s][i] = free[s] = start[s][i] + duration[kind]
                ended[(kind, mb, chunk * p + s)] = end[s][i]
                nxt[s] += 1
                progress = True
    {DEADLOCK}
    makespan = max(max(e) for e in end if e)
    busy = sum(duration[op[0]] for ops in schedule for op in ops)
    peaks = []
    for ops in schedule:
        held = peak = 0
        for kind, _, _ in ops:
            if kind == "F":
                held += 1
                peak = max(peak, held)
            elif kind == ({RELEASE}):
                held -= 1
        peaks.append(peak)
    return {{"start": start, "end": end, "makespan": makespan, "bubble_fraction": {BUBBLE}, "peak_in_flight": peaks}}
'''
SIMULATOR_RIGHT = dict(
    B_TIME='times["B"] if split else times["B"] + times["W"]', LOOP="progress", FREE="free[s]",
    HOP="p2p_time if d[2] % p != s else 0.0", RELEASE='"W" if split else "B"', BUBBLE="1 - busy / (p * makespan)",
    DEADLOCK='if any(nxt[s] < len(schedule[s]) for s in range(p)):\n        raise ValueError("deadlock")')


def simulator(**changes) -> str:
    return SIMULATOR_TEMPLATE.format(**{**SIMULATOR_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
    (dict(B_TIME='times["B"]'), "B is the whole backward"),
    (dict(HOP="p2p_time"), "p2p_time is the time of a message between two stages"),
    (dict(FREE="0.0"), "It starts at the latest of"),  # a stage running several ops at once
    (dict(RELEASE='"B"'), "held until its W"),
    (dict(BUBBLE="(p * makespan - busy) / busy"), "idle time over busy time"),
    (dict(DEADLOCK="end = [[0.0 if e is None else e for e in row] for row in end]"),
     "returned a result, but no stage can ever finish"),
    (dict(LOOP="any(nxt[s] < len(schedule[s]) for s in range(p))", DEADLOCK="pass"), "still running after 2 s"),
], ids=["full-backward-without-w", "p2p-on-local-results", "stage-runs-ops-at-once", "peak-until-b",
        "bubble-over-busy", "deadlock-returns", "deadlock-loops"])
def test_simulator_rejects(tmp_notebook, changes, feedback):
    assert_fails(graded(tmp_notebook, "pp.simulator", {"simulate_pipeline": simulator(**changes)}), feedback)


SIMULATOR_TEXTBOOK = '''
def simulate_pipeline(schedule, times, p2p_time=0.0):
    # Knows only the 1F1B closed form: right for the textbook schedule, wrong for any other order.
    p, m = len(schedule), sum(op[0] == "F" for op in schedule[0])
    t = times["F"] + times["B"] + times["W"]
    makespan = (m + p - 1) * t
    return {"start": [[0.0] * len(ops) for ops in schedule], "end": [[t] * len(ops) for ops in schedule],
            "makespan": makespan, "bubble_fraction": (p - 1) / (m + p - 1),
            "peak_in_flight": [min(p - s, m) for s in range(p)]}
'''

SIMULATOR_PRIORITY_QUEUE = '''
import heapq

def simulate_pipeline(schedule, times, p2p_time=0.0):
    """An event queue: (time, event); ops start when their stage is idle and their inputs have arrived."""
    p = len(schedule)
    v = 1 + max(c for ops in schedule for _, _, c in ops)
    split = any(k == "W" for ops in schedule for k, _, _ in ops)
    dur = {"F": times["F"], "B": times["B"] + (0 if split else times["W"]), "W": times["W"]}
    arrived = [set() for _ in range(p)]
    idle, position = [True] * p, [0] * p
    start = [[0.0] * len(ops) for ops in schedule]
    end = [[0.0] * len(ops) for ops in schedule]
    queue, counter = [], 0
    def deps(kind, mb, vs):
        return {"F": [("F", mb, vs - 1)] if vs else [],
                "B": [("F", mb, vs)] + ([("B", mb, vs + 1)] if vs + 1 < p * v else []),
                "W": [("B", mb, vs)]}[kind]
    def launch(s, now):
        nonlocal counter
        if idle[s] and position[s] < len(schedule[s]):
            kind, mb, c = schedule[s][position[s]]
            if all(d in arrived[s] for d in deps(kind, mb, c * p + s)):
                i = position[s]
                start[s][i], end[s][i], idle[s] = now, now + dur[kind], False
                heapq.heappush(queue, (end[s][i], counter, s, (kind, mb, c * p + s)))
                counter += 1
    for s in range(p):
        launch(s, 0.0)
    while queue:
        now, _, s, result = heapq.heappop(queue)
        if s >= 0:  # an op ended: its stage is idle, its result travels
            idle[s], position[s] = True, position[s] + 1
            for other in range(p):
                heapq.heappush(queue, (now + (p2p_time if other != s else 0), counter, -1 - other, result))
                counter += 1
            launch(s, now)
        else:
            arrived[-1 - s].add(result)
            launch(-1 - s, now)
    if any(position[s] < len(schedule[s]) for s in range(p)):
        raise ValueError("deadlock")
    makespan = max(e for ends in end for e in ends)
    busy = sum(dur[k] for ops in schedule for k, _, _ in ops)
    def peak(ops):
        held, best = 0, 0
        for k, _, _ in ops:
            held += (k == "F") - (k == ("W" if split else "B"))
            best = max(best, held)
        return best
    return dict(start=start, end=end, makespan=makespan, bubble_fraction=(p * makespan - busy) / (p * makespan),
                peak_in_flight=[peak(ops) for ops in schedule])
'''

SIMULATOR_RECURSIVE = '''
import functools

def simulate_pipeline(schedule, times, p2p_time=0.0):
    """Longest path, by memoised recursion: an op starts at the latest end among what it waits for."""
    p = len(schedule)
    v = 1 + max(c for ops in schedule for _, _, c in ops)
    split = any(k == "W" for ops in schedule for k, _, _ in ops)
    dur = {"F": times["F"], "B": times["B"] + (0 if split else times["W"]), "W": times["W"]}
    where = {(k, mb, c * p + s): (s, i) for s, ops in enumerate(schedule) for i, (k, mb, c) in enumerate(ops)}
    visiting = set()

    @functools.lru_cache(maxsize=None)
    def finish(s, i):
        if (s, i) in visiting:
            raise ValueError("the schedule deadlocks")
        visiting.add((s, i))
        kind, mb, c = schedule[s][i]
        vs = c * p + s
        waits = {"F": [("F", mb, vs - 1)] if vs else [],
                 "B": [("F", mb, vs)] + ([("B", mb, vs + 1)] if vs + 1 < p * v else []),
                 "W": [("B", mb, vs)]}[kind]
        begin = finish(s, i - 1) if i else 0.0
        for need in waits:
            other = where[need]
            begin = max(begin, finish(*other) + (p2p_time if other[0] != s else 0.0))
        visiting.discard((s, i))
        return begin + dur[kind]

    end = [[finish(s, i) for i in range(len(ops))] for s, ops in enumerate(schedule)]
    start = [[e - dur[op[0]] for e, op in zip(ends, ops)] for ends, ops in zip(end, schedule)]
    makespan = max(max(ends) for ends in end)
    busy = sum(dur[k] for ops in schedule for k, _, _ in ops)
    peaks = []
    for ops in schedule:
        held = [0]
        for k, _, _ in ops:
            held.append(held[-1] + (k == "F") - (k == ("W" if split else "B")))
        peaks.append(max(held))
    return {"start": start, "end": end, "makespan": makespan, "bubble_fraction": 1 - busy / p / makespan,
            "peak_in_flight": peaks}
'''


def test_simulator_that_knows_only_the_textbook_fails(tmp_notebook):
    assert_fails(graded(tmp_notebook, "pp.simulator", {"simulate_pipeline": SIMULATOR_TEXTBOOK}),
                 "in your timeline and at")


@pytest.mark.parametrize("source", [SIMULATOR_PRIORITY_QUEUE, SIMULATOR_RECURSIVE], ids=["priority-queue", "recursive"])
def test_simulator_accepts(tmp_notebook, source):
    result = graded(tmp_notebook, "pp.simulator", {"simulate_pipeline": source})
    assert result.status == "passed", result


# --- exercise 3: closed forms ---

CLOSED_FORMS_TEMPLATE = '''
def bubble_fraction(p, m, v=1):
    return {FRACTION}


def bubble_over_ideal(p, m, v=1):
    return {RATIO}


def peak_in_flight(schedule, p, m, stage, v=1):
    if schedule == "GPipe":
        return m
    if schedule == "ZB-H1":
        return {ZB_PEAK}
    if schedule == "interleaved 1F1B":
        return {INTERLEAVED_PEAK}
    return {PEAK}
'''
CLOSED_FORMS_RIGHT = dict(FRACTION="(p - 1) / (v * m + p - 1)", RATIO="(p - 1) / (v * m)", PEAK="min(p - stage, m)",
                          ZB_PEAK="min(p, m)", INTERLEAVED_PEAK="min((v - 1) * p + 2 * (p - stage - 1) + 1, v * m)")


def closed_forms(**changes) -> str:
    return CLOSED_FORMS_TEMPLATE.format(**{**CLOSED_FORMS_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
    (dict(FRACTION="(p - 1) / (v * m)"), "relative to the ideal time (Megatron-LM's ratio)"),
    (dict(FRACTION="(p - 1) / (v * m + p - 2)"), "the source notes' slip"),
    (dict(RATIO="(p - 1) / (v * m + p - 1)"), "share of the whole step"),
    (dict(FRACTION="(p - 1) / (m + p - 1)"), "ignores the v chunks"),
    (dict(PEAK="m"), "that is GPipe's peak"),
    (dict(PEAK="p - stage"), "never more than the m micro-batches"),
    (dict(PEAK="min(p, m)"), "holds for the first stage"),
    (dict(ZB_PEAK="min(p - stage, m)"), "that is 1F1B's peak; ZB-H1 also keeps up to s weight gradients"),
    (dict(INTERLEAVED_PEAK="min((v - 1) * p + 2 * (p - stage - 1), v * m)"), "that is the warm-up alone"),
    (dict(INTERLEAVED_PEAK="min((v + 1) * p - 1, v * m)"), "that holds for stage 0"),
    (dict(INTERLEAVED_PEAK="min(p - stage, m)"), "that ignores the chunks"),
], ids=["fraction-is-megatrons-ratio", "7-over-70", "ratio-is-the-fraction", "v-forgotten", "1f1b-holds-m",
        "min-with-m-forgotten", "stage-forgotten", "zb-h1-peak-is-1f1bs", "interleaved-warm-up-alone",
        "interleaved-stage-forgotten", "interleaved-chunks-ignored"])
def test_closed_forms_reject(tmp_notebook, changes, feedback):
    result = graded(tmp_notebook, "pp.closed_forms", {"bubble_fraction": closed_forms(**changes)})
    # With m < p, min(p, m) is m: forgetting the stage looks like GPipe's peak, and the feedback says so.
    assert_fails(result, feedback, *(["that is GPipe's peak"] if feedback == "holds for the first stage" else []))


def test_closed_forms_accept_exact_fractions(tmp_notebook):
    """fractions.Fraction results are numbers (exact rationals), compared by value."""
    source = "from fractions import Fraction\n" + closed_forms(FRACTION="Fraction(p - 1, v * m + p - 1)",
                                                              RATIO="Fraction(p - 1, v * m)")
    result = graded(tmp_notebook, "pp.closed_forms", {"bubble_fraction": source})
    assert result.status == "passed", result


def test_closed_forms_accept_equivalent_forms(tmp_notebook):
    source = closed_forms(FRACTION="1 - v * m / (v * m + p - 1)", RATIO="(p - 1) / m / v",
                          PEAK="max(0, min(p - stage, m))")
    assert graded(tmp_notebook, "pp.closed_forms", {"bubble_fraction": source}).status == "passed"


def test_closed_forms_draw_an_interleaved_and_a_plain_bubble_in_every_grading():
    """An answer that forgets v must meet a v > 1 case every time (it once passed 1 grading in 64)."""
    for seed in range(300):
        drawn = {v > 1 for (_, _, v), *_ in ClosedForms().prepare(np.random.default_rng(seed))["bubbles"]}
        assert drawn == {True, False}, seed


def test_simulator_draws_a_message_time_for_1f1b_in_every_grading():
    """An answer that charges p2p_time for a stage's own result must meet a case where it binds every
    time: 1F1B's last stage runs B right after the F it needs (with free draws it passed 1 grading in 100)."""
    for seed in range(300):
        cases = Simulator().prepare(np.random.default_rng(seed))["cases"]
        assert all(case["p2p"] > 0 for case in cases if case["label"] == "1F1B"), seed
