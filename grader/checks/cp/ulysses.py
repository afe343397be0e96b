"""Exercise 5 of the context-parallel chapter: Ulysses, sequence shards turned into head shards
by an all-to-all and back."""
from __future__ import annotations

from dtp.cp.context_parallel import alltoall_input_bytes, ulysses_bytes_per_layer

from ...compare import expect
from ...registry import exercise
from ..references import refuses_library
from ..common import WorldsCheck, run_worlds
from .harness import contiguous, forward_rank
from .ring import FP32, judge_rank_outputs, oracle
from .ring_pattern import unexpected_ops


@exercise("cp.ulysses", points=3)
@refuses_library("dtp.cp.context_parallel")
class Ulysses(WorldsCheck):
    """Verifies: on c = 2 and c = 4 gloo ranks (heads a random multiple of c, one world causal and
    the other not, which drawn), every rank's output equals single-process attention on its
    tokens; the rank used all-to-alls only, and the bytes their inputs add up to equal
    (tokens/c)·(2h + 2h)·4, Q, K, V in and the output back, of which (c-1)/c leave the rank: dtp's
    ulysses_bytes_per_layer. Attention run without the causal mask is named.
    Fakes: an all-gather of Q, K and V (or send/recv) shows in the recorded operations; sending more
    than Q, K, V and the output, or fewer, changes the bytes."""

    reads = ("ulysses_attention",)
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    timeout_s = 40
    summary = ("outputs equal single-process attention for c = 2 and 4; all-to-all bytes equal "
               "(tokens/c)(2h + 2h_kv)·4 per rank, (c-1)/c of it sent")

    def prepare(self, rng):
        causal = bool(rng.integers(2))  # one world causal, the other not: every grading has both
        return [(c, c * int(rng.integers(1, 3)), c * int(rng.integers(1, 5)), int(rng.integers(2, 7)),
                 causal == (c == 2), int(rng.integers(1 << 20))) for c in (2, 4)]

    def collect(self, student, worlds):
        return run_worlds(forward_rank, [(c, (student.ulysses_attention, seed, heads, seq, d, causal, "contiguous"))
                                         for c, heads, seq, d, causal, seed in worlds])

    def judge_world(self, world, per_rank) -> None:
        c, heads, seq, d, causal, seed = world
        where = f"with c = {c} ranks and {heads} heads{' (causal)' if causal else ''}"
        wanted_bytes = alltoall_input_bytes(seq, heads * d, heads * d, c, FP32)
        for rank, outcome in enumerate(per_rank):
            events = outcome["events"]
            other = unexpected_ops(events, {"all_to_all"})
            expect(not other, f"{where}: rank {rank} called {', '.join(other)}; Ulysses moves Q, K, V and the "
                              "output with all-to-alls only (dist.all_to_all or all_to_all_single)")
            recorded = sum(e["bytes"] for e in events if e["op"] == "all_to_all")
            leaving = ulysses_bytes_per_layer(seq, heads * d, heads * d, c, FP32)
            expect(recorded == wanted_bytes,
                   f"{where}: rank {rank}'s all-to-alls took {recorded} bytes of input; Q, K and V of its "
                   f"{seq // c} tokens in and its output back are {int(wanted_bytes)} bytes of fp32 "
                   f"((c-1)/c of it, {int(leaving)} bytes, leaves the rank)")
        self.judge_outputs(world, [outcome["result"] for outcome in per_rank])

    @staticmethod
    def judge_outputs(world, results) -> None:
        c, heads, seq, d, causal, seed = world
        where = f"with c = {c} ranks and {heads} heads{' (causal)' if causal else ''}"
        rows = contiguous(seq, c)
        slips = [("is attention without the causal mask: after the first all-to-all each rank runs attention of its "
                  "h/c heads over the whole sequence, and it must pass `causal` on to it",
                  [oracle(seed, heads, seq, d, False)[:, rows[rank]] for rank in range(c)])] if causal else []
        judge_rank_outputs(results, rows, oracle(seed, heads, seq, d, causal), slips, where)
