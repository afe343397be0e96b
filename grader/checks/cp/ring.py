"""Exercises 2-4 of the context-parallel chapter: ring attention forward, its backward, and the
zigzag layout, each on gloo worlds whose ranks hold slices of tensors the grader drew."""
from __future__ import annotations

import numpy as np
import torch

from dtp.cp.context_parallel import ring_backward_bytes_per_layer

from ...compare import CheckFailed, expect, expect_close
from ...registry import exercise
from ..references import refuses_library
from ..common import WorldsCheck, run_worlds
from .harness import attention, backward_rank, contiguous, forward_rank, full_tensors, zigzag
from .ring_pattern import (
    RingBlocks,
    check_blocks_not_kept,
    check_not_all_held,
    check_ring_pattern,
    check_score_products,
    score_entries,
    unexpected_ops,
)
from .slips import backward_without_rowsum, ring_forward_slips, zigzag_slips

FP32 = 4
TOLERANCE = dict(rtol=1e-4, atol=1e-4)


def oracle(seed, heads, seq, d, causal):
    q, k, v = (x.double() for x in full_tensors(seed, heads, seq, d))
    return attention(q, k, v, causal)[0].numpy()


def judge_output(out, wanted, what, slips=(), named_only=False):
    """`out` against `wanted`; a wrong output equal to a slip's gets the slip's feedback. With
    `named_only`, only a named slip fails here (the mechanism is judged next, the rest after it)."""
    out = np.asarray(out) if not isinstance(out, torch.Tensor) else out.detach().numpy()
    if out.shape == wanted.shape and not np.allclose(out, wanted, **TOLERANCE):
        for feedback, value in slips:
            if np.allclose(out, value, **TOLERANCE, equal_nan=True):
                raise CheckFailed(f"{what} {feedback}")
    if not named_only:
        expect_close(out, wanted, what, check_dtype=False, **TOLERANCE)


def judge_rank_outputs(results, rows, wanted, slips, where, named_only=False) -> None:
    """Every rank's output (`rows[rank]` of `wanted`), a slip named where one fits: `slips` lists
    (feedback, every rank's output under that slip)."""
    for rank, result in enumerate(results):
        judge_output(result, wanted[:, rows[rank]], f"{where}: rank {rank}'s output",
                     [(feedback, outputs[rank]) for feedback, outputs in slips], named_only)


@exercise("cp.ring_forward", points=4)
@refuses_library("dtp.cp.context_parallel")
class RingForward(WorldsCheck):
    """Verifies: on c = 2 (causal or not, drawn) and c = 4 (causal) gloo ranks with random heads,
    tokens per rank and head size, every rank's output equals single-process attention on its
    tokens; each rank used only send/recv, to one neighbour and from the other, and sent exactly
    the K and V blocks the ring brought it, in order (its own, then each arrived block), c - 1
    steps; no score product spans more than one block's keys; at c = 4 no receive buffer has room
    for more than two blocks' K and V, scores were computed between every two steps' receives,
    and no score product ran while the rank still referenced more than two steps' received K and
    V (followed through every copy, `kept.ReceivedKept`). A causal mask applied only inside the
    rank's own block, or on positions within each block, and blocks labelled with the rank on the
    other side of the ring are named (before the order of receives and scores is judged: such a
    ring computes on the wrong blocks, which that order would otherwise be blamed for).
    Fakes: an all-gather (or any collective) shows in the recorded operations; dummy messages are
    not K/V blocks; receiving into slices of one buffer for all of K and V shows as its size;
    receiving every block before computing shows in the order; computing each block as it
    arrives but keeping the used ones in a list (or copies of them, or the works that received
    them) shows as the received bytes still referenced at the last steps' score products."""

    reads = ("ring_attention",)
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    timeout_s = 60
    summary = ("outputs equal single-process attention for c = 2 and 4 (causal); K and V blocks passed on to one "
               "neighbour in c - 1 steps, scores computed block by block as the blocks arrived, no buffer for all of K and V "
               "and no used block kept")

    def prepare(self, rng):
        return [(c, int(rng.integers(1, 4)), c * int(rng.integers(2, 6)), int(rng.integers(6, 10)),
                 bool(rng.integers(2)) if c == 2 else True, int(rng.integers(1 << 20))) for c in (2, 4)]

    def collect(self, student, worlds):
        return run_worlds(forward_rank, [(c, (student.ring_attention, seed, heads, seq, d, causal, "contiguous"))
                                         for c, heads, seq, d, causal, seed in worlds])

    def judge_world(self, world, per_rank) -> None:
        c, heads, seq, d, causal, seed = world
        where = f"with c = {c} ranks{' (causal)' if causal else ''}"
        blocks = RingBlocks(c, heads, seq, d, seed)
        for rank, outcome in enumerate(per_rank):
            check_ring_pattern(blocks, rank, outcome["events"], where)
            check_score_products(blocks, rank, outcome["events"], where)
        results = [outcome["result"] for outcome in per_rank]
        self.judge_outputs(world, results, named_only=True)  # a named slip first: it explains the order too
        for rank, outcome in enumerate(per_rank):
            check_not_all_held(blocks, rank, outcome["events"], outcome["held"], where,
                               lambda source: causal and source > rank)
            check_blocks_not_kept(blocks, rank, outcome["events"], where)
        self.judge_outputs(world, results)

    @staticmethod
    def judge_outputs(world, results, named_only=False) -> None:
        c, heads, seq, d, causal, seed = world
        judge_rank_outputs(results, contiguous(seq, c), oracle(seed, heads, seq, d, causal),
                      ring_forward_slips(seed, heads, seq, d, c, causal),
                      f"with c = {c} ranks{' (causal)' if causal else ''}", named_only)


@exercise("cp.ring_backward", points=3)
@refuses_library("dtp.cp.context_parallel")
class RingBackward(WorldsCheck):
    """Verifies: on c = 2 (causal) and c = 4 (causal or not) gloo ranks, dQ, dK and dV of every
    rank's blocks equal single-process autograd of attention (the forward's output and
    log-sum-exp given); only send/recv to ring neighbours; the bytes each rank sent equal the
    formula: K and V in c - 1 steps and their gradients in c steps, 2(2c - 1)·blocks of fp32.
    Fakes: collectives show in the recorded operations; sending dK/dV straight to their owner is,
    at c = 4, a message to a rank that is not a neighbour; extra or missing messages change the
    bytes. dQ and dK of dS = P ⊙ dP, the rowsum(dO ⊙ O) term left out, are named."""

    reads = ("ring_attention_backward",)
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    timeout_s = 60
    summary = ("dQ, dK, dV equal single-process autograd for c = 2 and 4; K/V and dK/dV went around the ring, "
               "bytes equal to the formula")

    def prepare(self, rng):
        return [(c, int(rng.integers(1, 4)), c * int(rng.integers(2, 5)), int(rng.integers(3, 8)),
                 True if c == 2 else bool(rng.integers(2)), int(rng.integers(1 << 20))) for c in (2, 4)]

    def collect(self, student, worlds):
        return run_worlds(backward_rank, [(c, (student.ring_attention_backward, seed, heads, seq, d, causal))
                                          for c, heads, seq, d, causal, seed in worlds])

    def judge_world(self, world, per_rank) -> None:
        c, heads, seq, d, causal, seed = world
        where = f"with c = {c} ranks{' (causal)' if causal else ''}"
        for rank, outcome in enumerate(per_rank):
            events = outcome["events"]
            other = unexpected_ops(events, {"send", "recv"})
            expect(not other, f"{where}: rank {rank} called {', '.join(other)}; the backward passes K/V and their "
                              "gradients around the ring with send/recv")
            peers = {e.get("peer") for e in events if e["op"] in ("send", "recv")}
            expect(peers <= {(rank + 1) % c, (rank - 1) % c},
                   f"{where}: rank {rank} exchanged messages with ranks {sorted(peers)}; in a ring each rank "
                   "talks only to its two neighbours (dK/dV reach their owner by going on around the ring)")
            sent = sum(e["bytes"] for e in events if e["op"] == "send")
            wanted = ring_backward_bytes_per_layer(seq, heads * d, c, FP32)
            expect(sent == wanted,
                   f"{where}: rank {rank} sent {sent} bytes; the ring backward sends its K and V on in c - 1 = "
                   f"{c - 1} steps and each block's dK/dV accumulator on in c = {c} steps (the last one brings "
                   f"it home): {int(wanted)} bytes of fp32")
        self.judge_gradients(world, [outcome["result"] for outcome in per_rank])

    @staticmethod
    def judge_gradients(world, results) -> None:
        c, heads, seq, d, causal, seed = world
        where = f"with c = {c} ranks{' (causal)' if causal else ''}"
        q, k, v, dout = (x.double().requires_grad_() for x in full_tensors(seed, heads, seq, d, count=4))
        attention(q, k, v, causal)[0].backward(dout.detach())
        without_rowsum = backward_without_rowsum(seed, heads, seq, d, c, causal)
        for rank, result in enumerate(results):
            rows = contiguous(seq, c)[rank]
            expect(isinstance(result, tuple) and len(result) == 3,
                   f"{where}: rank {rank} returned {type(result).__name__}; return (dq, dk, dv)")
            slip = [("is the gradient of dS = P ⊙ dP: the softmax's backward subtracts each query's rowsum(dO ⊙ O) "
                     "(the same for all its keys): dS = P ⊙ (dP - rowsum(dO ⊙ O)), from the forward's output O",
                     without_rowsum[rank][index]) for index in range(2)]
            for index, (name, got, full) in enumerate(zip(("dQ", "dK", "dV"), result, (q, k, v))):
                judge_output(got, full.grad[:, rows].numpy(), f"{where}: rank {rank}'s {name}",
                             slip[index:index + 1] if index < 2 else ())


@exercise("cp.zigzag", points=3)
@refuses_library("dtp.cp.context_parallel")
class Zigzag(WorldsCheck):
    """Verifies: on c = 3 and c = 4 gloo ranks, each holding chunks r and 2c-1-r of the sequence
    in 2c chunks, every rank's causal attention output equals single-process attention on its
    tokens, in the order it holds them; the ring pattern of exercise 2, used blocks not kept (at
    c = 4); and the score entries
    each rank computed (query x key, from its matrix products) are balanced (the most within 20 %
    of the least) and no more than the 2c + 1 chunk pairs of (s/2c)^2 the zigzag layout needs.
    The output with its two chunks swapped, or with each rank's second chunk one early (chunk
    2c - 2 - r), is named.
    Fakes: computing every block whole under a mask is balanced but costs c blocks per rank, more
    than the formula; the contiguous split's work is unbalanced."""

    reads = ("zigzag_ring_attention",)
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    timeout_s = 60
    summary = ("zigzag outputs equal single-process causal attention for c = 3 and 4, in each rank's token order; "
               "every rank computed the same (2c + 1) chunk pairs of scores")

    def prepare(self, rng):
        # head size above any block's key count, so the score products are the ones with inner size d
        return [(c, int(rng.integers(1, 4)), 2 * c * int(rng.integers(1, 4)), int(rng.integers(7, 11)),
                 int(rng.integers(1 << 20))) for c in (3, 4)]

    def collect(self, student, worlds):
        return run_worlds(forward_rank, [(c, (student.zigzag_ring_attention, seed, heads, seq, d, True, "zigzag"))
                                         for c, heads, seq, d, seed in worlds])

    def judge_world(self, world, per_rank) -> None:
        c, heads, seq, d, seed = world
        where = where_zigzag(c)
        blocks = RingBlocks(c, heads, seq, d, seed, "zigzag")
        for rank, outcome in enumerate(per_rank):
            check_ring_pattern(blocks, rank, outcome["events"], where)
            check_blocks_not_kept(blocks, rank, outcome["events"], where)
        self.judge_outputs(world, [outcome["result"] for outcome in per_rank])
        work = [score_entries(outcome["events"], heads, d) for outcome in per_rank]
        chunk = seq // (2 * c)
        most = (2 * c + 1) * chunk ** 2
        expect(max(work) <= most,
               f"{where}: the ranks computed {[int(w) for w in work]} query x key scores per head; the zigzag "
               f"layout needs {most} on every rank (2c + 1 = {2 * c + 1} chunk pairs of {chunk} x {chunk}): "
               "split each block into its two chunks and skip the pairs whose keys all come after the queries")
        expect(max(work) <= 1.2 * min(work),
               f"{where}: the ranks computed {[int(w) for w in work]} query x key scores per head; the zigzag "
               "layout exists to give every rank the same causal work")

    @staticmethod
    def judge_outputs(world, results) -> None:
        c, heads, seq, d, seed = world
        wanted, rows = oracle(seed, heads, seq, d, True), zigzag(seq, c)
        swapped = [(f"has its two chunks swapped: rank {rank} holds chunk {rank} and then chunk {2 * c - 1 - rank}; "
                    "return the outputs in the order of the rank's tokens",
                    wanted[:, rows[rank][len(rows[rank]) // 2:] + rows[rank][:len(rows[rank]) // 2]]) for rank in range(c)]
        slips = zigzag_slips(seed, heads, seq, d, c)
        for rank, result in enumerate(results):
            judge_output(result, wanted[:, rows[rank]], f"{where_zigzag(c)}: rank {rank}'s output",
                         [swapped[rank]] + [(feedback, outputs[rank]) for feedback, outputs in slips])


def where_zigzag(c) -> str:
    return f"with c = {c} ranks (zigzag, causal)"
