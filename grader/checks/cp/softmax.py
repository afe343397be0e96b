"""Exercise 1 of the context-parallel chapter: attention in numpy with the online softmax, the
keys and values arriving one block at a time, as they will around a ring."""
from __future__ import annotations

import math
import tracemalloc

import numpy as np

from dtp.cp.context_parallel import attention_numpy

from ...compare import CheckFailed, expect, expect_close
from ...registry import Check, exercise
from ..references import refuses_library

TOLERANCE = dict(rtol=1e-6, atol=1e-8)
FLOAT64 = 8
# Of the K/V bytes that arrived between the third block and the last, the most the function may
# have kept: copies of every block keep all of them (1), of K or V alone half.
KEPT_SHARE_LIMIT = 0.25


class ArrivingBlocks:
    """The (K, V) blocks in key order, handed out one at a time through one pair of buffers that
    the next block overwrites, as a ring's receive buffer is: a function that stores the blocks and
    computes at the end reads the last block c times. With `measure`, the bytes Python and numpy
    hold (tracemalloc) are recorded each time the function asks for the next block: what it kept
    of the blocks it has read."""

    def __init__(self, k, v, sizes, measure=False):
        self.k, self.v, self.sizes, self.measure = k, v, sizes, measure
        self.held = np.zeros(len(sizes), dtype=np.int64)  # filled in place: recording allocates nothing
        self.asked = 0

    def __iter__(self):
        width = max(self.sizes)
        k_buffer, v_buffer = np.empty((width, self.k.shape[1])), np.empty((width, self.v.shape[1]))
        start = 0
        for index, size in enumerate(self.sizes):
            if self.measure:
                self.held[index] = tracemalloc.get_traced_memory()[0]
            self.asked = index + 1
            k_buffer[:size], v_buffer[:size] = self.k[start:start + size], self.v[start:start + size]
            start += size
            yield k_buffer[:size], v_buffer[:size]


def online_variant(q, k, v, sizes, causal, *, rescale_sum=True, rescale_out=True, block_max=False, strict=False,
                   subtract_max=True):
    """The online softmax as a learner may write it: with `rescale_sum` / `rescale_out` False the
    running sum / output is not multiplied by exp(m - m') when a block raises the maximum;
    `block_max` takes each block's exponentials against the block's own maximum and adds them
    without any rescale; `strict` masks a query's own position too (keys k < q); without
    `subtract_max` the exponentials are taken of the scores themselves. A query with no visible key
    gets nan."""
    with np.errstate(all="ignore"):  # the slips overflow, and divide 0 by 0, as the learner's code did
        tokens = q.shape[0]
        running_max, total = np.full(tokens, -np.inf), np.zeros(tokens)
        out, start = np.zeros((tokens, v.shape[1])), 0
        for size in sizes:
            scores = q @ k[start:start + size].T / math.sqrt(q.shape[1])
            if causal:
                keys, queries = np.arange(start, start + size)[None, :], np.arange(tokens)[:, None]
                scores = np.where(keys < queries if strict else keys <= queries, scores, -np.inf)
            new_max = scores.max(axis=1) if block_max else np.maximum(running_max, scores.max(axis=1))
            shift = np.where(np.isfinite(new_max) & subtract_max, new_max, 0.0)
            rescale = np.ones(tokens) if block_max or not subtract_max else \
                np.exp(np.where(np.isfinite(running_max), running_max - shift, 0.0))
            weights = np.exp(scores - shift[:, None])
            total = total * (rescale if rescale_sum else 1.0) + weights.sum(axis=1)
            out = out * (rescale[:, None] if rescale_out else 1.0) + weights @ v[start:start + size]
            running_max = np.maximum(running_max, new_max)
            start += size
        return out / total[:, None]


SLIPS = {  # feedback -> the online_variant options that give it
    "sums exponentials taken against different maxima: when a block raises a query's maximum from m to m', multiply "
    "its running sum and output by exp(m - m') before adding the block": dict(block_max=True),
    "rescales the running sum but not the running output: when a block raises a query's maximum from m to m', both "
    "the sum and the output were summed against m, so multiply both by exp(m - m')": dict(rescale_out=False),
    "rescales the running output but not the running sum: when a block raises a query's maximum from m to m', both "
    "the sum and the output were summed against m, so multiply both by exp(m - m')": dict(rescale_sum=False),
    "takes the exponentials of the scores themselves: scores of this size overflow exp (or underflow it to 0, "
    "losing the weights' precision); subtract the running maximum before exponentiating": dict(subtract_max=False),
}
STRICT_MASK = ("masks each query's own key: causal attention lets the query at position i see keys at positions "
               "<= i (mask keys after it, k > i), so query 0 sees key 0 and no query is left without a key")


def _sizes(rng, tokens: int) -> list[int]:
    cuts = np.sort(rng.choice(np.arange(1, tokens), size=int(rng.integers(1, min(6, tokens))), replace=False))
    return [int(s) for s in np.diff(np.concatenate([[0], cuts, [tokens]]))]


def _some_maximum_rises(q, k, sizes, causal) -> bool:
    """Whether a block after the first raises some query's running maximum (where a rescale
    that is left out shows)."""
    scores = q @ k.T
    if causal:
        scores = np.where(np.tril(np.ones(scores.shape, dtype=bool)), scores, -np.inf)
    first = scores[:, :sizes[0]].max(axis=1)
    return bool(np.any(scores[:, sizes[0]:].max(axis=1, initial=-np.inf) > first))


@exercise("cp.online_softmax", points=3)
@refuses_library("dtp.cp.context_parallel")
class OnlineSoftmax(Check):
    """Verifies: `online_softmax_attention(q, blocks, causal)` equals softmax attention (float64
    reference) for random token counts, head sizes and uneven block sizes, causal and not (query 0
    of a causal case sees key 0 only, and queries before a block see none of its keys), with scores
    of order 10^3 to 10^4, where np.exp overflows, and a block after the first raising some query's
    maximum in every case; the blocks arrive through one reused buffer pair, so the function must
    fold each block into its running maximum, sum and output before reading the next; and on a
    fourth case of 32 to 48 equal blocks, the memory Python and numpy hold (tracemalloc) when it
    asks for the last block exceeds what it held at the third by less than a quarter of the K/V
    bytes that arrived in between. Exponentials summed without rescaling, the sum or the output
    alone rescaled, and a causal mask that hides a query's own key are named.
    Fakes: storing the blocks reads overwritten buffers; copies of them (or of per-block results)
    grow the memory with the number of blocks; a naive exponential overflows to inf or nan;
    dtp.cp.context_parallel (its plain attention too) trips."""

    reads = ("online_softmax_attention",)
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for causal in (False, True, bool(rng.integers(2))):
            while True:
                tokens, d = int(rng.integers(3, 41)), int(rng.integers(2, 9))
                sizes = _sizes(rng, tokens)
                q, k, v = rng.normal(size=(tokens, d)), rng.normal(size=(tokens, d)), rng.normal(size=(tokens, d))
                if _some_maximum_rises(q, k, sizes, causal):
                    break
            cases.append({"q": q * float(rng.uniform(300, 3000)), "k": k, "v": v, "sizes": sizes, "causal": causal,
                          "measure": False})
        size, count, d = int(rng.integers(2, 5)), int(rng.integers(32, 49)), int(rng.integers(4, 9))
        tokens = size * count
        cases.append({"q": rng.normal(size=(tokens, d)) * float(rng.uniform(300, 3000)), "k": rng.normal(size=(tokens, d)),
                      "v": rng.normal(size=(tokens, d)), "sizes": [size] * count, "causal": False, "measure": True})
        return cases

    def collect(self, student, cases):
        answers = []
        for case in cases:
            blocks = ArrivingBlocks(case["k"], case["v"], case["sizes"], case["measure"])
            started = case["measure"] and not tracemalloc.is_tracing()
            if started:
                tracemalloc.start()
            try:
                out = student.online_softmax_attention(case["q"].copy(), blocks, case["causal"])
            finally:
                if started:
                    tracemalloc.stop()
            answers.append({"out": out, "held": blocks.held[:blocks.asked].tolist()})
        return answers

    def judge(self, cases, answers) -> str:
        expect(isinstance(answers, list) and len(answers) == len(cases), "the grader's calls did not all return")
        for case, answer in zip(cases, answers):
            judge_output(case, answer["out"])
        for case, answer in zip(cases, answers):
            if case["measure"]:
                judge_memory(case, answer["held"])
        return ("equal to softmax attention, causal and not, for uneven blocks and scores that overflow a naive exp; "
                "memory that does not grow with the number of blocks")


def describe(case) -> str:
    sizes = case["sizes"]
    blocks = f"{len(sizes)} blocks of {sizes[0]}" if len(set(sizes)) == 1 and len(sizes) > 3 else f"blocks of {sizes}"
    return f"attention of {case['q'].shape[0]} tokens in {blocks}{' (causal)' if case['causal'] else ''}"


def judge_output(case, answer) -> None:
    q, k, v, sizes, causal = case["q"], case["k"], case["v"], case["sizes"], case["causal"]
    what = describe(case)
    out = np.asarray(answer, dtype=np.float64) if np.ndim(answer) == 2 else answer
    wanted = attention_numpy(q, k, v, causal)
    if isinstance(out, np.ndarray) and out.shape == wanted.shape and not np.allclose(out, wanted, **TOLERANCE):
        if causal and np.allclose(out[1:], online_variant(q, k, v, sizes, causal, strict=True)[1:], **TOLERANCE):
            raise CheckFailed(f"{what} {STRICT_MASK}")
        if not np.all(np.isfinite(out)):
            raise CheckFailed(f"{what} contains inf or nan{_where_not_finite(case, out)}")
        for feedback, options in SLIPS.items():
            if np.allclose(out, online_variant(q, k, v, sizes, causal, **options), **TOLERANCE):
                raise CheckFailed(f"{what} {feedback}")
    expect_close(out, wanted, what, check_dtype=False, **TOLERANCE)


def _where_not_finite(case, out) -> str:
    """Why the rows that are not finite are: scores where exp overflows (the rows a naive
    exponential leaves not finite), or a block whose keys are all masked for those queries (its
    maximum is -inf: every row before the last block's start can have one)."""
    q, k, v, sizes, causal = case["q"], case["k"], case["v"], case["sizes"], case["causal"]
    rows = np.nonzero(~np.all(np.isfinite(out), axis=1))[0]
    naive = np.nonzero(~np.all(np.isfinite(online_variant(q, k, v, sizes, causal, subtract_max=False)), axis=1))[0]
    if causal and len(rows) and not np.array_equal(rows, naive) and rows.max() < sum(sizes[:-1]):
        return (f" for queries {rows[:5].tolist()}{'...' if len(rows) > 5 else ''}, each of which has a block whose "
                "keys all come after it: that block's maximum is -inf, and exp(-inf - (-inf)) is nan. A query whose "
                "keys so far are all masked has nothing yet: keep its maximum at -inf, and subtract 0 instead of it")
    largest = np.abs(q @ k.T).max() / math.sqrt(q.shape[1])
    return (f": scores reach {largest:.3g}, where exp overflows (and far below, where it underflows to 0); subtract "
            "the running maximum before exponentiating")


def judge_memory(case, held) -> None:
    sizes, d = case["sizes"], case["k"].shape[1]
    expect(isinstance(held, list) and len(held) == len(sizes),
           f"{describe(case)}: the function read {len(held) if isinstance(held, list) else 0} of the {len(sizes)} "
           "blocks; read every block, in order")
    arrived = (len(sizes) - 3) * 2 * sizes[0] * d * FLOAT64
    grown = held[-1] - held[2]
    if grown > KEPT_SHARE_LIMIT * arrived:
        raise CheckFailed(
            f"{describe(case)}: when it asked for the last block the function held {grown} bytes more than when it "
            f"asked for the third, while the K and V of the blocks in between are {arrived} bytes: it keeps the "
            "blocks it has read (or copies of them, or a result per block). The online softmax "
            "exists so that memory does not grow with the number of blocks: fold each block into the running "
            "maximum, sum and output, and let it go")
