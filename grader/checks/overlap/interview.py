"""The overlap chapter's interview questions: answers as functions of the question's numbers."""
from __future__ import annotations

import math

from dtp.overlap import model as overlap

from ...registry import exercise
from ..references import refuses_library
from ..common import InterviewQuestions


def _ring_allreduce_ms(gigabytes, gb_per_s, n):
    return 2 * (n - 1) / n * gigabytes / gb_per_s * 1e3


def _allgather_ms(gigabytes, gb_per_s, n):
    return (n - 1) / n * gigabytes / gb_per_s * 1e3


@exercise("overlap.interview", points=2)
@refuses_library("dtp.overlap.model")
class Interview(InterviewQuestions):
    """Verifies: three interview answers as functions of the question's numbers (DDP's exposed
    all-reduce in ms for a gradient size, bus bandwidth, GPUs, backward time and buckets;
    ZeRO-3's exposed forward all-gathers in ms with prefetch; the fewest collective-matmul
    chunks that hide the all-gather), on the questions the notebook asks and on random ones.
    Fakes: a number copied from the page answers the asked question only; dtp.overlap.model trips."""

    reads = ("interview_ddp_exposed_ms", "interview_zero3_forward_exposed_ms", "interview_fewest_chunks")
    asked = {"interview_ddp_exposed_ms": (14.0, 100.0, 64, 250.0, 25),
             "interview_zero3_forward_exposed_ms": (80, 1.75, 100.0, 64, 12.0),
             "interview_fewest_chunks": (6.0, 10.0)}
    rel = 1e-9
    summary = "all three interview answers are right for the questions asked and for random numbers"

    def drawn(self, name, rng):
        if name == "interview_ddp_exposed_ms":
            return (float(rng.integers(1, 400)) / 10, float(rng.choice([25.0, 50.0, 100.0, 200.0, 400.0])),
                    int(rng.integers(2, 1025)), float(rng.integers(20, 2000)), int(rng.integers(1, 60)))
        if name == "interview_zero3_forward_exposed_ms":
            return (int(rng.integers(2, 129)), float(rng.integers(1, 400)) / 100,
                    float(rng.choice([25.0, 50.0, 100.0, 200.0, 400.0])), int(rng.integers(2, 1025)),
                    float(rng.integers(1, 400)) / 10)
        while True:  # an all-gather shorter than the GEMM, and G/(G - A) clear of an integer, where
            # ceil() of a rounded quotient and a loop over t could disagree on the boundary
            gemm = float(rng.integers(10, 1000)) / 10
            allgather = float(rng.integers(1, int(gemm * 10))) / 10
            ratio = gemm / (gemm - allgather)
            if abs(ratio - round(ratio)) > 1e-3:
                return allgather, gemm

    def expected(self, name, *args):
        if name == "interview_ddp_exposed_ms":
            gigabytes, bandwidth, n, backward, buckets = args
            return overlap.ddp_exposed(_ring_allreduce_ms(gigabytes, bandwidth, n), backward, buckets)
        if name == "interview_zero3_forward_exposed_ms":
            layers, gigabytes, bandwidth, n, compute = args
            return overlap.fsdp_forward_exposed(layers, _allgather_ms(gigabytes, bandwidth, n), compute)
        allgather, gemm = args
        return next(t for t in range(2, 10**6) if overlap.collective_matmul_exposed(allgather, gemm, t) <= 1e-12)

    def slips(self, name, *args):
        if name == "interview_ddp_exposed_ms":
            gigabytes, bandwidth, n, backward, buckets = args
            c = _ring_allreduce_ms(gigabytes, bandwidth, n)
            return {"that is the whole all-reduce: all but what sticks out of backward is hidden": c,
                    "that is max(0, C - B): the last bucket can only start when backward ends": max(0.0, c - backward),
                    "that takes the all-reduce as (n-1)/n·S/B; a ring all-reduce moves 2(n-1)/n·S":
                        overlap.ddp_exposed(c / 2, backward, buckets)}
        if name == "interview_zero3_forward_exposed_ms":
            layers, gigabytes, bandwidth, n, compute = args
            g = _allgather_ms(gigabytes, bandwidth, n)
            return {"that is without prefetch: every layer waits for its all-gather": layers * g,
                    "that leaves out the first layer's all-gather, which nothing hides":
                        (layers - 1) * max(0.0, g - compute)}
        allgather, gemm = args
        return {"that is G/(G - A) rounded down; the number of chunks must reach it":
                math.floor(gemm / (gemm - allgather))}
