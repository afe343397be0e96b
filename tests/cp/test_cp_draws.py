"""The context-parallel checks' draws: no right answer refused by float rounding, and every named
slip refused on every draw (the slip's data computed here, judged by the check's own judge)."""
import math

import numpy as np
import pytest

from conftest import assert_every_slip_refused, numbers_slips_refused, refused_with
from grader.checks.cp.harness import attention, contiguous, full_tensors, zigzag
from grader.checks.cp.ring import oracle
from grader.checks.cp.slips import backward_without_rowsum, ring_forward_slips, zigzag_slips
from grader.compare import CheckFailed
from grader.registry import find_exercise

DRAWS = range(100)


def prepared(exercise_id: str, seed: int):
    return find_exercise(exercise_id).check.prepare(np.random.default_rng(seed))


def tokens_to_hide_in_another_order(flops, bandwidth, hidden, kv_hidden, dtype_bytes):
    # the transfer's seconds per token over the compute's: algebraically the solution's kv·bytes·F / (2·h·B),
    # rounded differently (one above the integer 22500 on 257 of the 23,232 questions the check could draw)
    return math.ceil((kv_hidden * dtype_bytes / bandwidth) / (2 * hidden / flops))


def test_tokens_to_hide_computed_in_another_order_is_right_on_every_draw():
    """Where kv·bytes·F / (2·h·B) is an integer (22500), this order gave 22501 and was refused: 257 of
    the 23,232 questions the check could draw. They are no longer drawn."""
    check = find_exercise("cp.interview").check
    for seed in range(300):
        questions = prepared("cp.interview", seed)
        answers = {name: [check.expected(name, *args) for args in cases] for name, cases in questions.items()}
        answers["interview_tokens_to_hide"] = [tokens_to_hide_in_another_order(*args)
                                               for args in questions["interview_tokens_to_hide"]]
        check.judge(questions, answers)


def test_an_integer_answer_one_off_says_so():
    check = find_exercise("cp.interview").check
    questions = {"interview_tokens_to_hide": [(989e12, 50e9, 16384, 1024, 2)]}
    with pytest.raises(CheckFailed) as failure:
        check.judge(questions, {"interview_tokens_to_hide": [1238]})
    assert "is 1238, expected 1237 (yours is 1 more than the answer)" in str(failure.value)


# --- every named slip refused, and named, on every one of 100 draws ---

@pytest.mark.parametrize("exercise_id", ["cp.costs", "cp.interview"])
def test_every_formula_slip_is_refused_on_every_draw(exercise_id):
    assert_every_slip_refused(exercise_id, numbers_slips_refused(exercise_id, len(DRAWS)))


def online_softmax_as_written(q, blocks, causal, *, rescale_sum=True, rescale_out=True, own_block_max=False,
                              strict=False, subtract_max=True):
    """An online softmax as a learner writes it, reading the blocks as they arrive; the options are
    the slips (written here apart from the check's own table)."""
    tokens = q.shape[0]
    m, total, out, start = np.full(tokens, -np.inf), np.zeros(tokens), np.zeros((tokens, q.shape[1])), 0
    for k_block, v_block in blocks:
        scores = q @ k_block.T / math.sqrt(q.shape[1])
        if causal:
            keys, queries = np.arange(start, start + len(k_block))[None, :], np.arange(tokens)[:, None]
            scores = np.where(keys < queries if strict else keys <= queries, scores, -np.inf)
        block_max = scores.max(axis=1)
        new = block_max if own_block_max else np.maximum(m, block_max)
        shift = np.where(np.isfinite(new), new, 0.0) if subtract_max else np.zeros(tokens)
        with np.errstate(over="ignore", invalid="ignore"):
            scale = np.ones(tokens) if own_block_max or not subtract_max else \
                np.exp(np.where(np.isfinite(m), m - shift, -np.inf))
            weights = np.exp(scores - shift[:, None])
            total = total * (scale if rescale_sum else 1.0) + weights.sum(axis=1)
            out = out * (scale[:, None] if rescale_out else 1.0) + weights @ v_block
        m, start = np.maximum(m, block_max), start + len(k_block)
    with np.errstate(divide="ignore", invalid="ignore"):
        return out / total[:, None]


def kept_copies(q, blocks, causal):
    """Every block copied, then one softmax over all of them: right, but its memory grows."""
    copies = [(k_block.copy(), v_block.copy()) for k_block, v_block in blocks]
    return online_softmax_as_written(q, copies, causal)


class Student:
    def __init__(self, function):
        self.online_softmax_attention = function


SOFTMAX_SLIPS = {
    "sums exponentials taken against different maxima": dict(own_block_max=True),
    "rescales the running sum but not the running output": dict(rescale_out=False),
    "rescales the running output but not the running sum": dict(rescale_sum=False),
    "masks each query's own key": dict(strict=True),
    "overflow": dict(subtract_max=False),
}


def test_every_online_softmax_slip_is_refused_on_every_draw():
    check = find_exercise("cp.online_softmax").check
    counts = dict.fromkeys([*SOFTMAX_SLIPS, "keeps the blocks it has read", "stores the blocks (reads overwritten buffers)"], 0)
    for seed in DRAWS:
        cases = prepared("cp.online_softmax", seed)
        check.judge(cases, check.collect(Student(online_softmax_as_written), cases))  # the right answer passes
        for feedback, options in SOFTMAX_SLIPS.items():
            answers = check.collect(Student(lambda q, blocks, causal: online_softmax_as_written(q, blocks, causal, **options)),
                                    cases)
            counts[feedback] += refused_with(lambda: check.judge(cases, answers), feedback)
        answers = check.collect(Student(kept_copies), cases)
        counts["keeps the blocks it has read"] += refused_with(lambda: check.judge(cases, answers), "keeps the blocks it has read")
        answers = check.collect(Student(lambda q, blocks, causal: online_softmax_as_written(q, list(blocks), causal)), cases)
        counts["stores the blocks (reads overwritten buffers)"] += refused_with(lambda: check.judge(cases, answers),
                                                                                "differs from the reference")
    assert_every_slip_refused("cp.online_softmax", counts)


def judged_ring_outputs(exercise_id, world, outputs) -> None:
    find_exercise(exercise_id).check.judge_outputs(world, outputs)


def test_every_ring_forward_slip_is_refused_on_every_draw():
    mechanism = "(mechanism) keeps used blocks / receives all before computing: a world of c = 4"
    counts = {mechanism: 0}
    for seed in DRAWS:
        worlds = prepared("cp.ring_forward", seed)
        refusals = {}
        for world in worlds:
            c, heads, seq, d, causal, world_seed = world
            judged_ring_outputs("cp.ring_forward", world, [oracle(world_seed, heads, seq, d, causal)[:, rows]
                                                           for rows in contiguous(seq, c)])
            for variant, (feedback, outputs) in enumerate(ring_forward_slips(*slip_args(world))):
                refusals[variant, feedback] = refusals.get((variant, feedback), False) or refused_with(
                    lambda: judged_ring_outputs("cp.ring_forward", world, outputs), feedback)
        for key, refused in refusals.items():  # two variants share one feedback: each counted
            counts[key] = counts.get(key, 0) + refused
        # judged from the recorded operations and memory, which every draw's worlds expose
        counts[mechanism] += any(world[0] >= 4 for world in worlds)
    assert_every_slip_refused("cp.ring_forward", counts)


def slip_args(world):
    c, heads, seq, d, causal, seed = world
    return seed, heads, seq, d, c, causal


def test_every_ring_backward_slip_is_refused_on_every_draw():
    check = find_exercise("cp.ring_backward").check
    feedback = "subtracts each query's rowsum(dO ⊙ O)"
    refused = 0
    for seed in DRAWS:
        worlds = prepared("cp.ring_backward", seed)
        outcomes = []
        for world in worlds:
            c, heads, seq, d, causal, world_seed = world
            right = autograd_gradients(world_seed, heads, seq, d, causal)
            check.judge_gradients(world, [tuple(g[:, rows] for g in right) for rows in contiguous(seq, c)])
            without = backward_without_rowsum(world_seed, heads, seq, d, c, causal)
            outcomes.append(refused_with(lambda: check.judge_gradients(
                world, [(dq, dk, right[2][:, rows]) for (dq, dk), rows in zip(without, contiguous(seq, c))]), feedback))
        refused += any(outcomes)
    assert_every_slip_refused("cp.ring_backward", {feedback: refused})


def autograd_gradients(seed, heads, seq, d, causal):
    q, k, v, dout = (x.double().requires_grad_() for x in full_tensors(seed, heads, seq, d, count=4))
    attention(q, k, v, causal)[0].backward(dout.detach())
    return q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


def test_every_zigzag_slip_is_refused_on_every_draw():
    counts = {"has its two chunks swapped": 0, "second chunk taken as chunk 2c - 2 - r": 0}
    for seed in DRAWS:
        worlds = prepared("cp.zigzag", seed)
        for feedback in counts:
            refusals = []
            for world in worlds:
                c, heads, seq, d, world_seed = world
                wanted, rows = oracle(world_seed, heads, seq, d, True), zigzag(seq, c)
                judged_ring_outputs("cp.zigzag", world, [wanted[:, r] for r in rows])
                if feedback == "has its two chunks swapped":
                    outputs = [wanted[:, r[len(r) // 2:] + r[:len(r) // 2]] for r in rows]
                else:
                    outputs = zigzag_slips(world_seed, heads, seq, d, c)[0][1]
                refusals.append(refused_with(lambda: judged_ring_outputs("cp.zigzag", world, outputs), feedback))
            counts[feedback] += any(refusals)
    assert_every_slip_refused("cp.zigzag", counts)


def test_every_ulysses_slip_is_refused_on_every_draw():
    feedback, refused = "without the causal mask", 0
    for seed in DRAWS:
        refusals = []
        for world in prepared("cp.ulysses", seed):
            c, heads, seq, d, causal, world_seed = world
            rows = contiguous(seq, c)
            judged_ring_outputs("cp.ulysses", world, [oracle(world_seed, heads, seq, d, causal)[:, r] for r in rows])
            outputs = [oracle(world_seed, heads, seq, d, False)[:, r] for r in rows]
            refusals.append(refused_with(lambda: judged_ring_outputs("cp.ulysses", world, outputs), feedback))
        refused += any(refusals)
    assert_every_slip_refused("cp.ulysses", {feedback: refused})
