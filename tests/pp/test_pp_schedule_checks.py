"""Exercise 1 of the pipeline chapter: the schedule checks reject plausible wrong orders with
feedback that names the mistake, and accept correct orders written differently from the course's."""
import numpy as np
import pytest

from conftest import assert_fails, graded
from grader.checks import pp
from grader.compare import CheckFailed


# --- exercise 1: schedules ---

GPIPE_WRONG = {
    "backward-before-forward": ("[[('B', k, 0) for k in range(m)] + [('F', k, 0) for k in range(m)] for _ in range(p)]",
                                "before its F"),
    "forgets-the-last-micro-batch": ("[[('F', k, 0) for k in range(m)] + [('B', k, 0) for k in range(m - 1)] "
                                     "for _ in range(p)]", "never runs B of micro-batch"),
    "one-f-one-b-instead": ("__import__('dtp.pp.schedules').pp.schedules.Op and [[tuple(op) for op in ops] for ops in "
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
    """The page's claim, the closed form for t_W <= min(t_F, t_B) (tests/pp/test_pp_pipeline.py
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
