"""The ring all-reduce exercises: over simulated ranks in numpy, and with send/recv on gloo.
The learner's messages are replayed (grader/dataflow.py): every byte must be explained by the
ring, sent to a neighbour, and the result must be the sum the grader drew."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dtp.common.traffic import CommunicationLog
from dtp.dp.simulated import SimulatedNetwork

from ...compare import CheckFailed, expect, expect_close
from ...dataflow import check_ring_dataflow, check_ring_neighbours
from ...registry import Check, exercise
from ..common import completed_worlds, events_as_data, raise_world_failure, run_worlds


@dataclass
class RingRun:
    """One all-reduce the learner's ring performed, as the judge sees it."""
    what: str  # "world 3, 62 float32 elements"
    inputs: list[np.ndarray]  # rank -> its input, drawn by the grader
    results: list  # rank -> what the learner's code left or returned
    logs: list[list[tuple]]  # rank -> ("send", peer, payload) and ("recv", peer), in order
    itemsize: int
    rtol: float
    atol: float


def _check_ring_messages(run: RingRun) -> None:
    """Each rank sends 2(n-1) messages of one chunk each: S/n elements, at most ceil(S/n) when S
    is not divisible by n (chunks from tensor_split or torch.chunk both qualify). In all, every
    chunk travels n-1 hops per phase: 2(n-1)·S."""
    n, length = len(run.inputs), run.inputs[0].size
    largest = -(-length // n)
    sends = [[np.size(entry[2]) for entry in log if entry[0] == "send"] for log in run.logs]
    for rank, sent in enumerate(sends):
        if sent and max(sent) > largest:
            raise CheckFailed(f"{run.what}: rank {rank} sent a message of {max(sent)} elements; every message of a "
                              f"ring all-reduce is one chunk of S/n, here at most {largest} elements")
        if len(sent) != 2 * (n - 1):
            raise CheckFailed(f"{run.what}: rank {rank} sent {len(sent)} messages; a ring all-reduce sends 2(n-1) = "
                              f"{2 * (n - 1)}, one chunk per step of the reduce-scatter and of the all-gather")
    total = sum(map(sum, sends)) * run.itemsize
    expect(total == 2 * (n - 1) * length * run.itemsize,
           f"{run.what}: the ranks sent {total} bytes in all; a ring all-reduce sends 2(n-1)·S = "
           f"{2 * (n - 1) * length * run.itemsize} (each chunk travels n-1 hops in each phase)")


def _check_ring_result(run: RingRun) -> None:
    n = len(run.inputs)
    expect(isinstance(run.results, (list, tuple)) and len(run.results) == n,
           f"{run.what}: there should be one result per rank, {n} in all")
    expected = np.sum(run.inputs, axis=0)
    for rank, result in enumerate(run.results):
        try:
            expect_close(result, expected, f"rank {rank}'s result ({run.what})", rtol=run.rtol, atol=run.atol)
        except CheckFailed as failed:
            raise CheckFailed(str(failed) + _diagnose_partial_reduction(result, expected, n)) from None


def judge_rings(runs: list[RingRun]) -> None:
    """Each property over every run before the next, so that the feedback names the most
    basic mistake: results, then where messages went, then their sizes, then where data came from."""
    for run in runs:
        _check_ring_result(run)
    for run in runs:
        check_ring_neighbours(run.logs, run.what)
    for run in runs:
        _check_ring_messages(run)
    for run in runs:
        check_ring_dataflow(run.inputs, run.logs, rtol=run.rtol, atol=run.atol, what=run.what)


# --- 1. ring all-reduce over simulated ranks --------------------------------------------------

@exercise("dp.ring_allreduce_numpy", points=2)
class RingAllReduceNumpy(Check):
    """Verifies: every rank's result equals the sum at float64 precision, for n = 2, 3, 4 and 7
    and lengths divisible and not by n; every message went through the course's
    SimulatedNetwork, which counts bytes; each rank sent 2(n-1) chunk-sized messages to its
    neighbours; every message and result is explained by data that travelled the ring.
    Fakes: np.sum plus dummy messages (the replay finds results holding data no message
    carried); self-reported byte counts (the network counts); float32 sums (float64 tolerance).
    """

    reads = ("ring_all_reduce_numpy",)
    timeout_s = 30

    def prepare(self, rng):
        cases = []
        for n in (2, 3, 4, 7):
            for length in (n * int(rng.integers(3, 9)), n * int(rng.integers(3, 9)) + int(rng.integers(1, n))):
                cases.append([rng.standard_normal(length) for _ in range(n)])
        return cases

    def collect(self, student, cases):
        outcomes = []
        for arrays in cases:
            network = SimulatedNetwork(len(arrays))
            results = student.ring_all_reduce_numpy([a.copy() for a in arrays], network)
            messages = [(m.step, m.source, m.destination, m.payload) for m in network.messages]
            outcomes.append({"results": results, "messages": messages})
        return outcomes

    def judge(self, cases, outcomes) -> str:
        judge_rings([RingRun(f"n={len(arrays)}, {arrays[0].size} float64 elements", arrays, outcome["results"],
                             _step_logs(outcome["messages"], len(arrays)), 8, rtol=1e-10, atol=1e-12)
                     for arrays, outcome in zip(cases, outcomes)])
        return ("every rank's result equals the sum (float64) for n = 2, 3, 4 and 7; each rank sent 2(n-1) "
                "chunks to its neighbour, 2(n-1)/n·S bytes, and every byte is explained by the ring's messages")


def _diagnose_partial_reduction(result, expected: np.ndarray, n: int) -> str:
    if not isinstance(result, np.ndarray) or result.shape != expected.shape:
        return ""
    reduced = np.isclose(result, expected).mean()
    if 0 < reduced <= 1.5 / n:
        return (f" Only {reduced:.0%} of the entries hold the full sum, about one chunk in {n}: "
                "that is the state after the reduce-scatter; did you forget the all-gather phase?")
    return ""


def _step_logs(messages: list[tuple], n: int) -> list[list[tuple]]:
    """Per-rank logs of a synchronous network: in each step a rank sends, then receives
    everything addressed to it in that step."""
    logs: list[list[tuple]] = [[] for _ in range(n)]
    for step in sorted({m[0] for m in messages}):
        in_step = [m for m in messages if m[0] == step]
        for _, source, destination, payload in in_step:
            logs[source].append(("send", destination, payload))
        for _, source, destination, _ in in_step:
            logs[destination].append(("recv", source))
    return logs


# --- 2. ring all-reduce on gloo ---------------------------------------------------------------

def _ring_on_rank(rank, world_size, ring, inputs_by_size):
    outcomes = []
    for inputs in inputs_by_size:
        tensor = torch.from_numpy(inputs[rank].copy())
        with CommunicationLog(payloads=True) as log:
            ring(tensor)
        outcomes.append({"result": tensor.numpy(), "events": events_as_data(log, payloads=True)})
    return outcomes


@exercise("dp.ring_allreduce_gloo", points=2)
class RingAllReduceGloo(Check):
    """Verifies: the tensor is summed in place on every rank, for worlds of 2, 3 and 4 processes
    and sizes divisible and not by n; only send/recv was used, each rank sent 2(n-1) chunks to a
    neighbour, 2(n-1)·S bytes in all; the replayed messages explain every rank's result.
    Fakes: dist.all_gather or all_reduce plus a local sum (recorded on the process group);
    a star through rank 0 or recursive halving-doubling (non-neighbour sends, n = 3 and 4);
    dummy sends beside a side channel such as the store or a file (the replay).
    """

    reads = ("ring_all_reduce",)
    timeout_s = 40
    runs_world = True
    preimport = ()  # its ranks use no optimizer and no module that imports torch._dynamo (measured)

    def prepare(self, rng):
        worlds = []
        for n in (2, 3, 4):
            # n + 2 elements: chunking that yields fewer than n chunks (torch.chunk(6, 4) gives 3) shows up.
            sizes = [n * int(rng.integers(20, 60)), n * int(rng.integers(20, 60)) + int(rng.integers(1, n)), n + 2]
            worlds.append((n, [[rng.standard_normal(size).astype(np.float32) for _ in range(n)] for size in sizes]))
        return worlds

    def collect(self, student, worlds):
        return run_worlds(_ring_on_rank, [(n, (student.ring_all_reduce, inputs)) for n, inputs in worlds])

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        runs = []
        for (n, inputs_by_size), per_rank in zip(worlds, done):
            for index, inputs in enumerate(inputs_by_size):
                what = f"world {n}, {inputs[0].size} float32 elements"
                for rank in range(n):
                    other = sorted({e["op"] for e in per_rank[rank][index]["events"]} - {"send", "recv", "wait"})
                    expect(not other, f"{what}: rank {rank} called {', '.join(other)}; build the ring from "
                                      "point-to-point send/recv (isend/irecv) only")
                    expect(not np.array_equal(per_rank[rank][index]["result"], inputs[rank]),
                           f"{what}: rank {rank}'s tensor is unchanged after ring_all_reduce: sum into `tensor` in "
                           "place, like dist.all_reduce (write into views of it, e.g. chunks from "
                           "tensor.tensor_split(n), with add_ and copy_)")
                logs = [[("send", e["peer"], np.concatenate([np.ravel(p) for p in e["payload"]]))
                         if e["op"] == "send" else ("recv", e["peer"])
                         for e in per_rank[rank][index]["events"] if e["op"] in ("send", "recv")] for rank in range(n)]
                runs.append(RingRun(what, inputs, [per_rank[rank][index]["result"] for rank in range(n)], logs, 4,
                                    rtol=1e-5, atol=1e-5))
        judge_rings(runs)
        raise_world_failure(failure)
        return ("equal to the sum on every rank, in place, for 2, 3 and 4 processes and sizes not divisible by n; "
                "only send/recv to ring neighbours, 2(n-1)/n·S bytes per rank, every byte explained by the ring")


