"""Exercise 6 of the context-parallel chapter: bytes per layer and memory per rank as formulas,
and interview questions answered as functions of the question's numbers."""
from __future__ import annotations

import math

from dtp.cp import context_parallel as cp

from ...registry import exercise
from ..references import refuses_library
from ..common import InterviewQuestions, clear_of_integers

GIB = 2 ** 30


def _bytes_case(rng):
    c = int(rng.choice([2, 3, 4, 8, 16, 32]))
    return (c * int(rng.integers(1, 4097)), 128 * int(rng.integers(1, 65)), c, int(rng.choice([2, 4])))


@exercise("cp.costs", points=3)
@refuses_library("dtp.cp.context_parallel")
class Costs(InterviewQuestions):
    """Verifies: four formulas as functions of their numbers, on Llama 3 405B's and on random ones:
    bytes one rank sends per layer's forward for ring attention, for an all-gather of K and V, for
    Ulysses, and activation bytes per GPU with context parallelism (the memory chapter's sbh·34/t
    with s/c). Forgetting V, a c-th step, the (c-1)/c, Ulysses' second all-to-all, and not
    dividing by c are named.
    Fakes: numbers copied from the page answer only the case asked; dtp.cp.context_parallel trips."""

    reads = ("ring_bytes_per_layer", "allgather_kv_bytes_per_layer", "ulysses_bytes_per_layer",
             "activation_bytes_per_rank")
    asked = {"ring_bytes_per_layer": (131072, 1024, 16, 2),
             "allgather_kv_bytes_per_layer": (131072, 1024, 16, 2),
             "ulysses_bytes_per_layer": (131072, 16384, 1024, 16, 2),
             "activation_bytes_per_rank": (131072, 1, 16384, 128, 8, 8, 16)}
    rel = 1e-9
    summary = "ring, all-gather and Ulysses bytes per layer and activation memory per rank are right for any numbers"

    def drawn(self, name, rng):
        tokens, kv_hidden, c, size = _bytes_case(rng)
        if name == "ulysses_bytes_per_layer":
            return tokens, kv_hidden * int(rng.integers(1, 17)), kv_hidden, c, size
        if name == "activation_bytes_per_rank":
            heads = int(rng.choice([8, 16, 32, 64, 128]))
            return (c * int(rng.integers(64, 4097)), int(rng.integers(1, 5)), heads * int(rng.choice([64, 128])), heads,
                    int(rng.integers(1, 33)), int(rng.choice([1, 2, 4, 8])), c)
        return tokens, kv_hidden, c, size

    def expected(self, name, *args):
        return getattr(cp, name)(*args)

    def slips(self, name, *args):
        if name == "ulysses_bytes_per_layer":
            tokens, hidden, kv_hidden, c, size = args
            return {"that leaves out the second all-to-all, which brings the output back to the rank's tokens":
                        (c - 1) / c * tokens / c * (hidden + 2 * kv_hidden) * size,
                    "that is the whole shard; (c-1)/c of it leaves the rank, the rest stays":
                        tokens / c * (2 * hidden + 2 * kv_hidden) * size}
        if name == "activation_bytes_per_rank":
            seq, batch, hidden, heads, layers, t, c = args
            return {"that does not divide by c: every saved activation is per token, and a rank keeps s/c tokens":
                        cp.activation_bytes_per_rank(seq, batch, hidden, heads, layers, t, 1)}
        tokens, kv_hidden, c, size = args
        whole = 2 * tokens * kv_hidden * size
        if name == "ring_bytes_per_layer":
            return {"that counts K only; V goes around too": cp.ring_bytes_per_layer(tokens, kv_hidden, c, size) / 2,
                    "that is c steps; a rank's own block never needs sending to itself: c - 1 steps": whole}
        return {"that counts K only; V is gathered too": whole * (c - 1) / c / 2,
                "that is the whole K and V; a rank sends only its own block, to each of the c - 1 others": whole}


def _ulysses_degree(heads, kv_heads, t):
    return kv_heads // t  # KV heads per TP rank: Ulysses splits them again, c at a time


def _hiding_quotient(flops, bandwidth, hidden, kv_hidden, dtype_bytes):
    # a step's block: 4·b²·h FLOPs (QK^T and PV) against 2·b·h_kv·bytes on the wire
    return kv_hidden * dtype_bytes * flops / (2 * hidden * bandwidth)


def _tokens_to_hide(*args):
    return math.ceil(_hiding_quotient(*args))


@exercise("cp.interview", points=2)
@refuses_library("dtp.cp.context_parallel")
class Interview(InterviewQuestions):
    """Verifies: three interview answers as functions of the question's numbers: activation GiB
    per GPU of a pipeline stage with CP, the largest Ulysses degree under grouped-query attention
    and TP, and the fewest tokens per rank for which a ring step's compute hides its K/V transfer
    (drawn where the quotient it rounds up is clear of an integer: there any order of the
    arithmetic rounds up to the same answer).
    Fakes: a number copied from the page answers the asked question only; dtp trips."""

    reads = ("interview_activation_gib", "interview_ulysses_degree", "interview_tokens_to_hide")
    asked = {"interview_activation_gib": (131072, 1, 16384, 128, 8, 8, 16),
             "interview_ulysses_degree": (128, 8, 8),
             "interview_tokens_to_hide": (989e12, 50e9, 16384, 1024, 2)}
    rel = 1e-9
    summary = "all three interview answers are right for the questions asked and for random numbers"

    def drawn(self, name, rng):
        if name == "interview_activation_gib":
            c = int(rng.choice([1, 2, 4, 8, 16]))
            heads = int(rng.choice([16, 32, 64, 128]))
            return (c * 1024 * int(rng.integers(1, 129)), int(rng.integers(1, 3)), heads * 128, heads,
                    int(rng.integers(1, 17)), int(rng.choice([1, 2, 4, 8])), c)
        if name == "interview_ulysses_degree":
            t = int(rng.choice([1, 2, 4, 8]))
            kv_heads = t * int(rng.choice([1, 2, 4, 8]))
            return kv_heads * int(rng.choice([1, 2, 4, 8, 16])), kv_heads, t
        while True:  # where the quotient is an integer, the ceiling of another order of the arithmetic is one off
            question = (float(rng.choice([312e12, 989e12, 2250e12])), float(rng.choice([25e9, 50e9, 100e9, 400e9])),
                        128 * int(rng.integers(8, 129)), 128 * int(rng.integers(1, 9)), int(rng.choice([2, 4])))
            if clear_of_integers(_hiding_quotient(*question)) and clear_of_integers(2 * _hiding_quotient(*question)):
                return question

    def expected(self, name, *args):
        if name == "interview_activation_gib":
            return cp.activation_bytes_per_rank(*args) / GIB
        if name == "interview_ulysses_degree":
            return _ulysses_degree(*args)
        return _tokens_to_hide(*args)

    def slips(self, name, *args):
        if name == "interview_activation_gib":
            return {"that is without CP: divide the tokens by c": cp.activation_bytes_per_rank(*args[:-1], 1) / GIB,
                    "that is in GB (10^9 bytes); the question asks GiB": cp.activation_bytes_per_rank(*args) / 1e9}
        if name == "interview_ulysses_degree":
            heads, kv_heads, t = args
            return {"that splits the query heads; under grouped-query attention K and V have only the KV heads, "
                    "and TP has already split them t ways": heads // t,
                    "that forgets TP: its t ranks already split the KV heads": kv_heads}
        flops, bandwidth, hidden, kv_hidden, size = args
        return {"that counts a step's compute as 2b²h FLOPs; QK^T and PV are two products of 2b²h each":
                    math.ceil(kv_hidden * size * flops / (hidden * bandwidth)),
                "that sends K and V of all heads; under grouped-query attention only the KV heads travel":
                    _tokens_to_hide(flops, bandwidth, hidden, hidden, size)}
