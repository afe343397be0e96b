"""Exercise 3 of the overlap chapter: collective matmul. The sequence-parallel input's pieces go
around the ring while each rank multiplies the piece it already has by its column piece of the
weight; recorded per rank as one ordered list of sends, receives, waits and products."""
from __future__ import annotations

import numpy as np

from dtp.overlap.runs import collective_matmul_oracle, collective_matmul_rank

from ...compare import CheckFailed, expect, expect_close
from ...registry import exercise
from ..references import refuses_library
from ..common import WorldsCheck, run_worlds
from .order import products_between, unexpected_ops, wait_of

FP32 = 4


class RingJudge:
    def __init__(self, t, rows, hidden, columns, seed, per_rank):
        self.t, self.rows, self.hidden, self.columns, self.per_rank = t, rows, hidden, columns, per_rank
        self.oracle = collective_matmul_oracle(t, rows, hidden, columns, seed)
        self.where = f"with t = {t} ranks"

    def judge(self) -> None:
        for rank, outcome in enumerate(self.per_rank):
            self.pattern(rank, outcome["events"])
        for rank, outcome in enumerate(self.per_rank):
            self.overlapped(rank, outcome["events"])
        for rank, outcome in enumerate(self.per_rank):
            self.output(rank, outcome["out"])

    def pattern(self, rank, events) -> None:
        t, where = self.t, f"{self.where}: rank {rank}"
        other = unexpected_ops(events, {"send", "recv"})
        expect(not other, f"{where} called {', '.join(other)}; collective matmul replaces the all-gather by t - 1 "
                          "ring steps of send/recv (isend/irecv or batch_isend_irecv)")
        sends = [e for e in events if e["op"] == "send"]
        receives = [e for e in events if e["op"] == "recv"]
        expect(len(sends) == t - 1 and len(receives) == t - 1,
               f"{where} sent {len(sends)} and received {len(receives)} messages; a ring of t = {t} ranks passes "
               f"each piece on t - 1 = {t - 1} times: one send and one receive per step")
        to = {e.get("peer") for e in sends}
        come = {e.get("peer") for e in receives}
        expect((to, come) in (({(rank + 1) % t}, {(rank - 1) % t}), ({(rank - 1) % t}, {(rank + 1) % t})),
               f"{where} sent to ranks {sorted(p for p in to if p is not None)} and received from "
               f"{sorted(p for p in come if p is not None)}; in a ring each rank sends to one neighbour and receives "
               "from the other, every step")
        chunk = self.rows * self.hidden * FP32
        expect(all(e["bytes"] == chunk for e in sends + receives),
               f"{where} passed messages of {sorted({e['bytes'] for e in sends + receives})} bytes; each step passes "
               f"one piece of the input, {self.rows} x {self.hidden} fp32 values ({chunk} bytes)")
        products = [e for e in events if e["op"] == "compute"]
        whole = [e for e in products if e.get("rows") == self.rows * t]
        expect(not whole, f"{where} multiplied all {self.rows * t} rows of the gathered input at once; collective "
                          f"matmul multiplies each piece of {self.rows} rows as soon as it is there, t = {t} products")
        expect(len(products) == t and all(e.get("rows") == self.rows for e in products),
               f"{where} ran {len(products)} matrix products (rows {[e.get('rows') for e in products]}); it should "
               f"run t = {t}, one per piece of {self.rows} rows")

    def overlapped(self, rank, events) -> None:
        for index, event in enumerate(events):
            if event["op"] not in ("send", "recv"):
                continue
            waited = wait_of(events, index)
            what = "send" if event["op"] == "send" else "receive"
            if waited is None:
                raise CheckFailed(f"{self.where}: rank {rank} never waited on a {what}; wait on every handle of the "
                                  "step before the next one uses the buffer")
            if not products_between(events, index, waited):
                raise CheckFailed(
                    f"{self.where}: rank {rank} waited on a {what} with no matrix product between its issue and its "
                    "wait: the transfer ran while the rank sat idle. Issue the step's send and receive first, multiply "
                    "the piece you already hold, then wait (a blocking dist.send or dist.recv waits at once)")

    def output(self, rank, out) -> None:
        wanted = self.oracle[rank]
        what = f"{self.where}: rank {rank}'s output"
        out = np.asarray(out) if not isinstance(out, np.ndarray) else out
        if out.shape == wanted.shape and not np.allclose(out, wanted, rtol=1e-4, atol=1e-4):
            blocks = [out[i * self.rows:(i + 1) * self.rows] for i in range(self.t)]
            places = [[j for j in range(self.t) if np.allclose(block, wanted[j * self.rows:(j + 1) * self.rows],
                                                                rtol=1e-4, atol=1e-4)] for block in blocks]
            if all(len(p) == 1 for p in places) and sorted(p[0] for p in places) == list(range(self.t)):
                raise CheckFailed(
                    f"{what} has every piece's product, in the wrong rows: rows of piece {places[0][0]} sit where "
                    f"piece 0 belongs, and so on ({[p[0] for p in places]}). At step k rank r holds the piece that "
                    "started on rank (r - k) mod t (or (r + k) mod t if you send the other way): write its product "
                    "in that piece's rows")
        expect_close(out, wanted, what + " (X @ W_r)", rtol=1e-4, atol=1e-4)


@exercise("overlap.collective_matmul", points=4)
@refuses_library("dtp.overlap.runs")
class CollectiveMatmul(WorldsCheck):
    """Verifies: on t = 2 and t = 4 gloo ranks (random shapes), the output equals the plain
    all-gather then GEMM X @ W_r on every rank; each rank sends t - 1 pieces to one neighbour
    and receives t - 1 from the other, one input piece per message, with a matrix product
    between every send's or receive's issue and its wait (the transfer ran under a GEMM), and
    runs exactly t products, each of one piece's rows. Pieces in the wrong rows are named.
    Fakes: an all-gather, or one product of the whole gathered input, shows in the recorded
    operations; blocking send/recv show as a wait right after the issue; extra dummy products
    to fill the gaps change the count of t products."""

    reads = ("collective_matmul",)
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)
    timeout_s = 40
    summary = ("outputs equal the all-gather then GEMM for t = 2 and 4; t - 1 ring steps, each transfer issued before "
               "the product of the piece already held and waited on after it")

    def prepare(self, rng):
        return [(t, int(rng.integers(2, 6)), int(rng.integers(3, 9)), int(rng.integers(2, 6)),
                 int(rng.integers(1 << 20))) for t in (2, 4)]

    def collect(self, student, worlds):
        return run_worlds(collective_matmul_rank, [(t, (student.collective_matmul, rows, hidden, columns, seed))
                                                    for t, rows, hidden, columns, seed in worlds])

    def judge_world(self, world, per_rank) -> None:
        RingJudge(*world, per_rank).judge()
