"""Exercise 1 of the context-parallel chapter: attention in numpy with the online softmax, the
keys and values arriving one block at a time, as they will around a ring."""
from __future__ import annotations

import math

import numpy as np

from dtp.cp.context_parallel import attention_numpy

from ...compare import CheckFailed, expect_close
from ...registry import Check, exercise
from ..references import refuses_library


class ArrivingBlocks:
    """The (K, V) blocks in key order, handed out one at a time through one pair of buffers that
    the next block overwrites, as a ring's receive buffer is: a function that stores the blocks and
    computes at the end reads the last block c times."""

    def __init__(self, k, v, sizes):
        self.k, self.v, self.sizes = k, v, sizes

    def __iter__(self):
        width = max(self.sizes)
        k_buffer, v_buffer = np.empty((width, self.k.shape[1])), np.empty((width, self.v.shape[1]))
        start = 0
        for size in self.sizes:
            k_buffer[:size], v_buffer[:size] = self.k[start:start + size], self.v[start:start + size]
            start += size
            yield k_buffer[:size], v_buffer[:size]


def without_rescale(q, k, v, sizes, causal):
    """The slip: each block's exponentials taken against that block's own maximum, and added to
    the running sums without rescaling what was summed against earlier maxima."""
    total, acc, start = np.zeros(q.shape[0]), np.zeros((q.shape[0], v.shape[1])), 0
    for size in sizes:
        scores = q @ k[start:start + size].T / math.sqrt(q.shape[1])
        if causal:
            keys = np.arange(start, start + size)
            scores = np.where(keys[None, :] <= np.arange(q.shape[0])[:, None], scores, -np.inf)
        block_max = scores.max(axis=1, keepdims=True)
        weights = np.exp(scores - np.where(np.isfinite(block_max), block_max, 0.0))
        total, acc = total + weights.sum(axis=1), acc + weights @ v[start:start + size]
        start += size
    return acc / total[:, None]


@exercise("cp.online_softmax", points=3)
@refuses_library("dtp.cp.context_parallel")
class OnlineSoftmax(Check):
    """Verifies: `online_softmax_attention(q, blocks, causal)` equals softmax attention (float64
    reference) for random token counts, head sizes and uneven block sizes, causal and not, with
    scores of order 10^3 to 10^4, where np.exp overflows; the blocks arrive through one reused
    buffer pair, so the function must fold each block into its running maximum, sum and output
    before reading the next. Exponentials summed without rescaling to the running maximum are
    named.
    Fakes: storing the blocks and computing at the end reads overwritten buffers (copies of them
    are not detected); a naive exponential overflows to inf or nan."""

    reads = ("online_softmax_attention",)
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for causal in (False, True, bool(rng.integers(2))):
            tokens, d = int(rng.integers(3, 41)), int(rng.integers(2, 9))
            cuts = np.sort(rng.choice(np.arange(1, tokens), size=int(rng.integers(1, min(6, tokens))), replace=False))
            sizes = np.diff(np.concatenate([[0], cuts, [tokens]])).tolist()
            q, k, v = rng.normal(size=(tokens, d)), rng.normal(size=(tokens, d)), rng.normal(size=(tokens, d))
            cases.append((q * float(rng.uniform(300, 3000)), k, v, [int(s) for s in sizes], causal))
        return cases

    def collect(self, student, cases):
        return [student.online_softmax_attention(q.copy(), ArrivingBlocks(k, v, sizes), causal)
                for q, k, v, sizes, causal in cases]

    def judge(self, cases, answers) -> str:
        for (q, k, v, sizes, causal), answer in zip(cases, answers):
            what = f"attention of {q.shape[0]} tokens in blocks of {sizes}{' (causal)' if causal else ''}"
            out = np.asarray(answer, dtype=np.float64) if np.ndim(answer) == 2 else answer
            wanted = attention_numpy(q, k, v, causal)
            if isinstance(out, np.ndarray) and out.shape == wanted.shape:
                if not np.all(np.isfinite(out)):
                    largest = np.abs(q @ k.T).max() / math.sqrt(q.shape[1])
                    raise CheckFailed(f"{what} contains inf or nan: scores reach {largest:.3g}, "
                                      "where exp overflows, and a causal block can have every key masked (its own "
                                      "maximum is -inf): subtract the running maximum before exponentiating")
                if not np.allclose(out, wanted, rtol=1e-6, atol=1e-8) and np.allclose(
                        out, without_rescale(q, k, v, sizes, causal), rtol=1e-6, atol=1e-8):
                    raise CheckFailed(f"{what} sums exponentials taken against different maxima: when a block raises "
                                      "a query's maximum from m to m', multiply its running sum and output by "
                                      "exp(m - m') before adding the block")
            expect_close(out, wanted, what, rtol=1e-6, atol=1e-8, check_dtype=False)
        return "equal to softmax attention, causal and not, for uneven blocks and scores that overflow a naive exp"
