"""Every check of the pipeline chapter rejects plausible wrong answers with feedback that names
the mistake, and accepts correct answers written differently from the course's."""
import numpy as np
import pytest

from conftest import grade
from dtp import pipeline
from grader.checks import pp
from grader.compare import CheckFailed


def graded(tmp_notebook, exercise, replacements):
    return grade(tmp_notebook("pp", replacements), exercise)[exercise]


def assert_fails(result, *feedback):
    assert result.status == "failed", result
    assert any(text in result.feedback for text in feedback), result.feedback


# --- exercise 1: schedules ---

GPIPE_WRONG = {
    "backward-before-forward": ("[[('B', k, 0) for k in range(m)] + [('F', k, 0) for k in range(m)] for _ in range(p)]",
                                "before its F"),
    "forgets-the-last-micro-batch": ("[[('F', k, 0) for k in range(m)] + [('B', k, 0) for k in range(m - 1)] "
                                     "for _ in range(p)]", "never runs B of micro-batch"),
    "one-f-one-b-instead": ("__import__('dtp.pipeline').pipeline.Op and [[tuple(op) for op in ops] for ops in "
                            "_course_1f1b(p, m)]", "before its last forward"),
    "stages-disagree-on-the-order": ("[[('F', k if s % 2 == 0 else m - 1 - k, 0) for k in range(m)] + "
                                     "[('B', k, 0) for k in range(m)] for s in range(p)]", "slower than GPipe must be"),
    "one-list-for-all-stages": ("[('F', k, 0) for k in range(m)] + [('B', k, 0) for k in range(m)]",
                                "one list of ops per stage"),
    "strings-for-ops": ("[[f'F{k}' for k in range(m)] + [f'B{k}' for k in range(m)] for _ in range(p)]",
                        "an op is a tuple"),
}
COURSE_1F1B = '''
def _course_1f1b(p, m):
    out = []
    for s in range(p):
        w = min(p - s - 1, m)
        ops = [('F', k, 0) for k in range(w)]
        for k in range(w, m):
            ops += [('F', k, 0), ('B', k - w, 0)]
        out.append(ops + [('B', k, 0) for k in range(m - w, m)])
    return out
'''


def gpipe(body: str) -> str:
    return COURSE_1F1B + f"\ndef gpipe_schedule(p, m):\n    return {body}\n"


@pytest.mark.parametrize("body, feedback", GPIPE_WRONG.values(), ids=GPIPE_WRONG.keys())
def test_gpipe_schedule_rejects(tmp_notebook, body, feedback):
    assert_fails(graded(tmp_notebook, "pp.gpipe_schedule", {"gpipe_schedule": gpipe(body)}), feedback)


@pytest.mark.parametrize("body", [
    "[[('F', k, 0) for k in range(m)] + [('B', k, 0) for k in reversed(range(m))] for _ in range(p)]",
    "[[['F', k] for k in range(m)] + [['B', k] for k in range(m)] for _ in range(p)]",
], ids=["backwards-newest-first", "two-element-lists"])
def test_gpipe_schedule_accepts(tmp_notebook, body):
    result = graded(tmp_notebook, "pp.gpipe_schedule", {"gpipe_schedule": gpipe(body)})
    assert result.status == "passed", result


ONE_F_ONE_B_TEMPLATE = '''
def one_f_one_b_schedule(p, m):
    schedule = []
    for s in range(p):
        warm_up = {WARM_UP}
        ops = [("F", k, 0) for k in range(warm_up)]
        for k in range(warm_up, m):
            ops += [("F", k, 0), ("B", {STEADY_B}, 0)]
        ops += [("B", k, 0) for k in {COOL_DOWN}]
        schedule.append({FINISH})
    return schedule
'''
ONE_F_ONE_B_RIGHT = dict(WARM_UP="min(p - s - 1, m)", STEADY_B="k - warm_up", COOL_DOWN="range(m - warm_up, m)",
                         FINISH="ops")


def one_f_one_b(**changes) -> str:
    return ONE_F_ONE_B_TEMPLATE.format(**{**ONE_F_ONE_B_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
    (dict(WARM_UP="m"), "holds the activations of"),  # GPipe's order: every forward first
    (dict(WARM_UP="min(p - s, m)", STEADY_B="k - warm_up", COOL_DOWN="range(m - warm_up, m)"), "holds the activations"),
    (dict(WARM_UP="0"), "slower than 1F1B must be"),  # no warm-up: each stage waits for every backward
    (dict(WARM_UP="p - s - 1"), "micro-batches are numbered 0.."),  # m < p: forwards of micro-batches that do not exist
    (dict(COOL_DOWN="reversed(range(m - warm_up, m))"), "slower than 1F1B must be"),
], ids=["gpipe-order", "one-warm-up-too-many", "no-warm-up", "warm-up-not-capped-by-m", "cool-down-newest-first"])
def test_one_f_one_b_schedule_rejects(tmp_notebook, changes, feedback):
    result = graded(tmp_notebook, "pp.one_f_one_b_schedule", {"one_f_one_b_schedule": one_f_one_b(**changes)})
    assert_fails(result, feedback)


@pytest.mark.parametrize("source", [
    one_f_one_b(FINISH="[(kind, m - 1 - k, chunk) for kind, k, chunk in ops]"),  # micro-batches numbered backwards
    one_f_one_b(FINISH="[(kind, k) for kind, k, _ in ops]"),  # (kind, micro_batch) pairs
], ids=["micro-batches-numbered-backwards", "pairs"])
def test_one_f_one_b_schedule_accepts(tmp_notebook, source):
    result = graded(tmp_notebook, "pp.one_f_one_b_schedule", {"one_f_one_b_schedule": source})
    assert result.status == "passed", result


INTERLEAVED_TEMPLATE = '''
def interleaved_schedule(p, m, v):
    def nth(kind, k):
        round_, within = divmod(k, p * v)
        chunk = within // p
        return (kind, round_ * p + within % p, {CHUNK})
    schedule = []
    for s in range(p):
        warm_up = {WARM_UP}
        ops = [nth("F", k) for k in range(warm_up)]
        for k in range(warm_up, m * v):
            ops += [nth("F", k), nth("B", k - warm_up)]
        schedule.append(ops + [nth("B", k) for k in range(m * v - warm_up, m * v)])
    return schedule
'''
INTERLEAVED_RIGHT = dict(CHUNK='chunk if kind == "F" else v - 1 - chunk', WARM_UP="min((v - 1) * p + 2 * (p - s - 1), m * v)")


def interleaved(**changes) -> str:
    return INTERLEAVED_TEMPLATE.format(**{**INTERLEAVED_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
    (dict(CHUNK="chunk"), "deadlocks"),  # backwards through the chunks in forward order
    (dict(CHUNK="0"), "runs F of micro-batch"),  # chunks forgotten: the same ops twice
    # the (v-1)·p forwards of the other chunks forgotten in the warm-up
    (dict(WARM_UP="min(2 * (p - s - 1), m * v)"), ("deadlocks", "before its F")),
    (dict(WARM_UP="m * v"), ("holds", "chunk activations")),  # all forwards first
], ids=["backward-chunks-in-forward-order", "chunks-forgotten", "other-chunks-forgotten-in-warm-up", "all-forwards-first"])
def test_interleaved_schedule_rejects(tmp_notebook, changes, feedback):
    result = graded(tmp_notebook, "pp.interleaved_schedule", {"interleaved_schedule": interleaved(**changes)})
    assert_fails(result, *(feedback if isinstance(feedback, tuple) else (feedback,)))


# Breadth-first (looped) order: all m micro-batches through a chunk before the next chunk, with the
# (v-1)·m + 2(p-s-1) warm-up forwards it then needs. Megatron-LM's order when m = p.
BREADTH_FIRST = dict(CHUNK='(k // m) % v if kind == "F" else v - 1 - (k // m) % v',
                     WARM_UP="min((v - 1) * m + 2 * (p - s - 1), m * v)")


def breadth_first_schedule(p, m, v):
    namespace = {}
    exec(interleaved(**BREADTH_FIRST).replace("round_ * p + within % p", "k % m"), namespace)
    return namespace["interleaved_schedule"](p, m, v)


def test_interleaved_schedule_rejects_a_breadth_first_order(tmp_notebook):
    source = interleaved(**BREADTH_FIRST).replace("round_ * p + within % p", "k % m")
    assert_fails(graded(tmp_notebook, "pp.interleaved_schedule", {"interleaved_schedule": source}),
                 "chunk activations at once")


def test_every_interleaved_draw_separates_the_breadth_first_order():
    check = pp.schedules.InterleavedSchedule()
    for seed in range(300):
        cases = check.prepare(np.random.default_rng(seed))
        refused = 0
        for case in cases:
            try:
                check.judge([case], [breadth_first_schedule(*case[0])])
            except CheckFailed:
                refused += 1
        assert refused >= 2, (seed, cases)  # m = 2p and m = 3p at least


@pytest.mark.parametrize("warm_up", [
    "m * v if m == p else min((v - 1) * p + 2 * (p - s - 1), m * v)",  # Megatron-LM's all warm-up when m = p
    "min((v - 1) * p + (p - s - 1), m * v)",  # enough when messages take no time (see the book)
], ids=["all-warm-up-when-m-equals-p", "shorter-warm-up"])
def test_interleaved_schedule_accepts(tmp_notebook, warm_up):
    result = graded(tmp_notebook, "pp.interleaved_schedule", {"interleaved_schedule": interleaved(WARM_UP=warm_up)})
    assert result.status == "passed", result


ZB_TEMPLATE = '''
from collections import deque

def zb_h1_schedule(p, m):
    schedule = []
    for s in range(p):
        warm_up = min(p - s - 1, m)
        ops, pending = [("F", k, 0) for k in range(warm_up)], deque()
        for k in range(warm_up, m):
            ops += [("F", k, 0), ("B", k - warm_up, 0)]
            pending.append(k - warm_up)
            if len(pending) > {KEPT}:
                ops.append(("W", pending.popleft(), 0))
        for k in range(m - warm_up, m):
            pending.append(k)
            ops += [("B", k, 0)] + {COOL_DOWN_W}
        schedule.append({FINISH})
    return schedule
'''
ZB_RIGHT = dict(KEPT="s", COOL_DOWN_W='[("W", pending.popleft(), 0)]', FINISH='ops + [("W", k, 0) for k in pending]')


def zb(**changes) -> str:
    return ZB_TEMPLATE.format(**{**ZB_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
    (dict(KEPT="0"), ("slower than ZB-H1 must be",)),  # each W right after its B: 1F1B with a split backward
    (dict(KEPT="m", COOL_DOWN_W="[]"), ("holds", "slower than ZB-H1")),  # every W at the very end
    (dict(FINISH='[op for op in ops if op[0] != "W"]'), ("never runs W of micro-batch",)),
    (dict(FINISH='[("W", k, 0) for k in range(m)] + [op for op in ops if op[0] != "W"]'), ("before its",)),
], ids=["no-delay", "all-weight-gradients-last", "no-split", "w-before-b"])
def test_zb_h1_schedule_rejects(tmp_notebook, changes, feedback):
    result = graded(tmp_notebook, "pp.zb_h1_schedule", {"zb_h1_schedule": zb(**changes)})
    assert_fails(result, *feedback)


@pytest.mark.parametrize("source", [
    zb(FINISH='ops + [("W", k, 0) for k in reversed(pending)]'),
    zb(FINISH='[(kind, m - 1 - k, c) for kind, k, c in ops + [("W", k, 0) for k in pending]]'),
], ids=["pending-weight-gradients-newest-first", "micro-batches-numbered-backwards"])
def test_zb_h1_schedule_accepts(tmp_notebook, source):
    result = graded(tmp_notebook, "pp.zb_h1_schedule", {"zb_h1_schedule": source})
    assert result.status == "passed", result


def test_zb_h1_timing_is_checked_with_unequal_times_in_the_closed_forms_range():
    """The page's claim, the closed form for t_W <= min(t_F, t_B) (tests/test_pp_pipeline.py
    simulates it), is what every grading checks: equal times, t_W = min(t_F, t_B), and below.
    (No plausible wrong order was found that is as fast as ZB-H1 only at equal times: the W
    delays 0, s-1, min(s, 1), and B's before W's in the cool-down are slower at equal times too.)"""
    check = pp.schedules.ZeroBubbleH1Schedule()
    for seed in range(200):
        timed = [(case, times) for case, times in check.prepare(np.random.default_rng(seed)) if case[1] >= case[0]]
        assert all(times["W"] <= min(times["F"], times["B"]) for _, times in timed)
        assert any(times["F"] == times["B"] == times["W"] for _, times in timed)
        assert any(times["F"] != times["B"] and times["W"] < min(times["F"], times["B"]) for _, times in timed)


def test_zb_h1_accepts_weight_gradients_newest_first():
    """Any order of the pending W's keeps ZB-H1's time, at any times in the closed form's range."""
    source = zb(COOL_DOWN_W='[("W", pending.pop(), 0)]')
    namespace = {}
    exec(source, namespace)
    check = pp.schedules.ZeroBubbleH1Schedule()
    for seed in range(20):
        cases = check.prepare(np.random.default_rng(seed))
        check.judge(cases, [namespace["zb_h1_schedule"](*case) for case, _ in cases])


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


# --- exercise 4: the real pipeline ---

STEP_TEMPLATE = '''
def one_f_one_b_step(stage, batch, targets, n_micro_batches, boundary_shape):
    rank, p, m = dist.get_rank(), dist.get_world_size(), n_micro_batches
    first, last = rank == 0, rank == p - 1
    inputs, labels = batch.tensor_split(m), targets.tensor_split(m)
    held, sending, loss = deque(), [], 0.0
    def forward(k):
        nonlocal loss
        if first:
            x = inputs[k]
        else:
            x = torch.empty(boundary_shape)
            dist.recv(x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = nn.functional.mse_loss(y, labels[k]){SCALE}
            loss += y.item()
        else:
            sending.append(dist.isend(y.detach(), rank + 1))
        held.append((x, y))
    def backward():
        x, y = held.{POP}()
        if last:
            y.backward()
        else:
            gradient = torch.empty(boundary_shape)
            dist.recv(gradient, rank + 1)
            y.backward(gradient)
        if not first:
            sending.append(dist.isend(x.grad, rank - 1))
    warm_up = {WARM_UP}
    for k in range(warm_up):
        forward(k)
    for k in range(warm_up, m):
        forward(k)
        backward()
    for _ in range(warm_up):
        backward()
    for request in sending:
        request.wait()
    {END}
    return {RESULT}
'''
STEP_RIGHT = dict(SCALE=" / m", POP="popleft", WARM_UP="min(p - rank - 1, m)", END="", RESULT="loss if last else None")


def step(**changes) -> str:
    return STEP_TEMPLATE.format(**{**STEP_RIGHT, **changes})


STEP_WHOLE_BATCH = '''
def one_f_one_b_step(stage, batch, targets, n_micro_batches, boundary_shape):
    # No micro-batches: the whole batch goes through each stage in one message.
    rank, p = dist.get_rank(), dist.get_world_size()
    shape = (batch.shape[0], boundary_shape[1])
    x = batch if rank == 0 else torch.empty(shape)
    if rank:
        dist.recv(x, rank - 1)
        x.requires_grad_()
    y = stage(x)
    if rank == p - 1:
        loss = nn.functional.mse_loss(y, targets)
        loss.backward()
    else:
        dist.send(y.detach(), rank + 1)
        gradient = torch.empty(shape)
        dist.recv(gradient, rank + 1)
        y.backward(gradient)
    if rank:
        dist.send(x.grad, rank - 1)
    return loss.item() if rank == p - 1 else None
'''


@pytest.mark.parametrize("source, feedback", [
    (step(WARM_UP="m"), "under 1F1B stage s holds at most"),  # GPipe: every forward first
    (step(WARM_UP="0"), "never had more than 1 micro-batches in flight"),  # each micro-batch through and back alone
    (step(POP="pop"), "not the gradient of any micro-batch"),  # newest first: the wrong micro-batch's backward
    (step(SCALE=""), "times too large"),
    (step(END="dist.all_reduce(torch.zeros(1))"), "called all_reduce"),
    (step(RESULT="None"), "the last rank returned None"),
    (STEP_WHOLE_BATCH, "messages to rank"),
], ids=["gpipe-order", "no-pipelining", "lifo-queue", "loss-not-divided-by-m", "collective", "no-loss",
        "whole-batch"])
def test_pipeline_rejects(tmp_notebook, source, feedback):
    assert_fails(graded(tmp_notebook, "pp.pipeline_1f1b", {"one_f_one_b_step": source}), feedback)


STEP_BATCHED_P2P = '''
def one_f_one_b_step(stage, batch, targets, n_micro_batches, boundary_shape):
    # Receives posted ahead with batch_isend_irecv; a list as the queue; the loss as a tensor.
    rank, p, m = dist.get_rank(), dist.get_world_size(), n_micro_batches
    first, last = rank == 0, rank == p - 1
    inputs, labels = batch.tensor_split(m), targets.tensor_split(m)
    held, pending, total = [], [], torch.zeros(())

    def exchange(ops):
        if ops:
            pending.extend(dist.batch_isend_irecv(ops))

    def forward(k):
        nonlocal total
        if first:
            x = inputs[k]
        else:
            x = torch.empty(boundary_shape)
            for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, x, rank - 1)]):
                request.wait()
            x.requires_grad_()
        y = stage(x)
        if last:
            y = nn.functional.mse_loss(y, labels[k]) / m
            total = total + y.detach()
        else:
            exchange([dist.P2POp(dist.isend, y.detach().clone(), rank + 1)])
        held.append((x, y))

    def backward():
        x, y = held.pop(0)
        if last:
            y.backward()
        else:
            gradient = torch.empty(boundary_shape)
            for request in dist.batch_isend_irecv([dist.P2POp(dist.irecv, gradient, rank + 1)]):
                request.wait()
            y.backward(gradient)
        if not first:
            exchange([dist.P2POp(dist.isend, x.grad.clone(), rank - 1)])

    warm_up = min(p - rank - 1, m)
    for k in range(m):
        forward(k)
        if k >= warm_up:
            backward()
    while held:
        backward()
    for request in pending:
        request.wait()
    return total if last else None
'''


def test_pipeline_accepts_batched_p2p_and_a_tensor_loss(tmp_notebook):
    result = graded(tmp_notebook, "pp.pipeline_1f1b", {"one_f_one_b_step": STEP_BATCHED_P2P})
    assert result.status == "passed", result


# --- exercise 5: the measured bubble (the judge on rank sequences made to order; tests/test_pp_load.py runs it) ---

def rank_sequences(schedule, early=()) -> list:
    """What each rank of exercise 4's solution records for a schedule of F and B: a blocking
    receive (recv + wait) right before each op that needs a message, an isend right after each op
    whose result another stage needs, and a wait on every send at the end. For (rank, i) in
    `early`, op i's receive comes before op i - 1 instead (a wait its previous op does not need)."""
    p = len(schedule)
    sequences = []
    for rank, ops in enumerate(schedule):
        events, sends = [], []

        def receive(kind):
            peer = rank - 1 if kind == "F" else rank + 1
            if 0 <= peer < p:
                events.extend([{"op": "recv", "peer": peer, "tag": 0}, {"op": "wait", "of": len(events)}])

        for index, (kind, micro_batch, _) in enumerate(ops):
            if (rank, index + 1) in early:
                receive(ops[index + 1][0])
            if (rank, index) not in early:
                receive(kind)
            events.append({"op": kind, "micro_batch": micro_batch})
            peer = rank + 1 if kind == "F" else rank - 1
            if 0 <= peer < p:
                sends.append(len(events))
                events.append({"op": "send", "peer": peer, "tag": 0})
        sequences.append(events + [{"op": "wait", "of": index} for index in sends])
    return sequences


BUBBLE_WORLDS = [(2, 5), (3, 2), (4, 9)]
SYNTHETIC = [[(0.0, 3.0), (5.0, 8.0)], [(2.0, 10.0)]]


def replayed_idle(sequences) -> float:
    return pipeline.idle_fraction([[(s, e) for s, e, _ in rank] for rank in pp.measured_bubble.replay(sequences)["intervals"]])


def judge_bubble(runs, measured=None, synthetic=None):
    """The measured-bubble judge on one run per world; `measured` gives the learner's answer."""
    inputs = {"worlds": [(len(run), sum(e["op"] == "F" for e in run[0])) for run in runs], "synthetic": SYNTHETIC}
    answers = [(measured or replayed_idle)(run) for run in runs]
    return pp.measured_bubble.MeasuredBubble().judge(inputs, {
        "runs": runs, "measured": answers, "synthetic": pipeline.idle_fraction(SYNTHETIC) if synthetic is None else synthetic})


def course_runs(schedule=pipeline.one_f_one_b_schedule):
    return [rank_sequences(schedule(p, m)) for p, m in BUBBLE_WORLDS]


def test_replay_of_1f1b_idles_exactly_the_bubble_fraction():
    for p in range(1, 6):
        for m in range(1, 10):
            assert replayed_idle(rank_sequences(pipeline.one_f_one_b_schedule(p, m))) == pytest.approx(
                pipeline.bubble_fraction(p, m), rel=1e-12, abs=1e-12)


def test_measured_bubble_judge_accepts_the_course_step():
    assert "idles exactly (p-1)/(m+p-1)" in judge_bubble(course_runs())


def test_measured_bubble_judge_rejects_a_gpipe_order():
    with pytest.raises(CheckFailed, match="under 1F1B stage s holds at most"):
        judge_bubble(course_runs(pipeline.gpipe_schedule))


def test_measured_bubble_rejects_a_gpipe_order_step(tmp_notebook):
    assert_fails(graded(tmp_notebook, "pp.measured_bubble", {"one_f_one_b_step": step(WARM_UP="m")}),
                 "under 1F1B stage s holds at most")


def test_measured_bubble_judge_rejects_a_gradient_received_before_the_forward():
    runs = course_runs()
    # p = 4, rank 1 (two warm-up forwards): F0 F1 F2 B0 F3 B1 ...; B1's gradient received before F3
    runs[2] = rank_sequences(pipeline.one_f_one_b_schedule(4, 9), early={(1, 5)})
    with pytest.raises(CheckFailed, match="your pipeline idles .*; 1F1B's bubble is .*Rank 1 sat idle .* gradient "
                                          "message 2 from rank 2, before its next forward, which does not need it"):
        judge_bubble(runs)


def test_measured_bubble_judge_rejects_an_op_run_before_its_message_was_waited_on():
    runs = course_runs()
    runs[0][1] = [e for e in runs[0][1] if not (e["op"] == "wait" and runs[0][1][e["of"]]["op"] == "recv")]
    with pytest.raises(CheckFailed, match="before it had waited for the activation"):
        judge_bubble(runs)


def test_measured_bubble_judge_rejects_a_wrong_measurement():
    def idle_over_busy(run):
        bubble = replayed_idle(run)
        return bubble / (1 - bubble)
    with pytest.raises(CheckFailed, match="idle time over busy time"):
        judge_bubble(course_runs(), measured=idle_over_busy)
    with pytest.raises(CheckFailed, match="random intervals"):
        judge_bubble(course_runs(), synthetic=0.25)


def test_measured_bubble_without_exercise_4_is_missing_and_names_it(tmp_notebook):
    stub = ("def one_f_one_b_step(stage, batch, targets, n_micro_batches, boundary_shape):\n"
            "    raise NotImplementedError('write your solution here')\n")
    result = graded(tmp_notebook, "pp.measured_bubble", {"one_f_one_b_step": stub})
    assert result.status == "missing", result
    assert "one_f_one_b_step from exercise 4" in result.feedback


# --- interview ---

INTERVIEW_RIGHT = dict(bubble="(p - 1) / (m + p - 1)", peak="min(p, m)", messages="2 * m",
                       gib="2 * m * micro_batch * sequence * hidden * bytes_per_value / 2**30")


def interview(**changes) -> str:
    answers = {**INTERVIEW_RIGHT, **changes}
    return (f"def interview_bubble_fraction(p, m):\n    return {answers['bubble']}\n\n"
            f"def interview_peak_micro_batches(p, m):\n    return {answers['peak']}\n\n"
            f"def interview_boundary_messages(p, m):\n    return {answers['messages']}\n\n"
            "def interview_boundary_gib(m, micro_batch, sequence, hidden, bytes_per_value):\n"
            f"    return {answers['gib']}\n")


@pytest.mark.parametrize("changes, feedback", [
    (dict(bubble="(p - 1) / (m + p - 2)"), "the source notes' slip"),
    (dict(bubble="(p - 1) / m"), "relative to the ideal time"),
    (dict(bubble="7 / 71"), "interview_bubble_fraction("),  # the page's number: right only for the question asked
    (dict(peak="m"), "that is GPipe's m"),
    (dict(peak="p"), "never more than the m there are"),
    (dict(messages="1"), "does not send once per step"),
    (dict(messages="m"), "counts one direction"),
    (dict(messages="2 * m * (p - 1)"), "counts every boundary"),
    (dict(messages="128"), "interview_boundary_messages("),
    (dict(gib="m * micro_batch * sequence * hidden * bytes_per_value / 2**30"), "counts one direction"),
    (dict(gib="micro_batch * sequence * hidden * bytes_per_value / 2**30"), "as if the pipeline sent once per step"),
    (dict(gib="2 * m * micro_batch * sequence * hidden * bytes_per_value / 1e9"), "that is in GB"),
    (dict(gib="8.0"), "interview_boundary_gib("),
], ids=["7-over-70", "over-ideal", "copied-bubble", "gpipe-memory", "p-without-min", "once-per-step",
        "one-direction", "every-boundary", "copied-messages", "one-direction-gib", "one-activation", "gb",
        "copied-gib"])
def test_interview_rejects(tmp_notebook, changes, feedback):
    assert_fails(graded(tmp_notebook, "pp.interview", {"interview_bubble_fraction": interview(**changes)}), feedback)


def test_interview_refuses_the_course_functions(tmp_notebook):
    source = interview(bubble="__import__('dtp.pipeline').pipeline.bubble_fraction(p, m)")
    result = graded(tmp_notebook, "pp.interview", {"interview_bubble_fraction": source})
    assert result.status == "failed" and "course's reference" in result.feedback, result


def test_interview_asks_the_question_the_notebook_states():
    questions = pp.interview.Interview().prepare(np.random.default_rng(0))
    assert questions["interview_bubble_fraction"][0] == (8, 64)
    assert questions["interview_boundary_gib"][0] == (64, 1, 4096, 8192, 2)


def test_every_check_is_registered_with_its_points():
    from grader.registry import chapter_exercises
    points = {exercise.id: exercise.points for exercise in chapter_exercises("pp")}
    assert points == {"pp.gpipe_schedule": 1, "pp.one_f_one_b_schedule": 2, "pp.interleaved_schedule": 2,
                      "pp.zb_h1_schedule": 2, "pp.simulator": 3, "pp.closed_forms": 2, "pp.pipeline_1f1b": 4,
                      "pp.measured_bubble": 2, "pp.interview": 2}
    assert np.isclose(7 / 71, pipeline.bubble_fraction(8, 64))
