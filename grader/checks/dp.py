"""Checks of the data-parallelism chapter (notebook 02_data_parallel).

Oracles, computed in the grader: the sum of the inputs the grader drew, single-process training
on the full batch from rank 0's initial weights, DDP's bucketing rule and the closed forms of
`dtp.costs`. Mechanisms, from what the learner's code sent: the ring's messages replayed
(grader/dataflow.py), the collectives and waits recorded on the process group.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dtp import costs
from dtp.models import regression_batch, state_as_numpy, tiny_mlp
from dtp.simulated import SimulatedNetwork
from dtp.traffic import CommunicationLog

from ..compare import CheckFailed, expect, expect_answer, expect_close
from ..dataflow import check_ring_dataflow, check_ring_neighbours
from ..registry import Check, exercise
from .common import FixedAnswers, FormulaCheck, completed_worlds, events_as_data, raise_world_failure, run_worlds

DDP_CLASS = "torch.nn.parallel.DistributedDataParallel"


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


# --- 3, 4 and 5. data-parallel training -------------------------------------------------------

MLP_SIZES = (8, 32, 16, 4)
STEPS, LEARNING_RATE, SHARD = 3, 0.1, 4
FIRST_LINEAR = 1  # index of the first Linear in tiny_mlp(..., input_scaling=True)


def _batches(seed: int, world_size: int, steps: int = STEPS, per_rank: int = SHARD):
    return [regression_batch(per_rank * world_size, MLP_SIZES[0], MLP_SIZES[-1], seed + step) for step in range(steps)]


def _shard(batch, rank: int, per_rank: int = SHARD):
    inputs, targets = batch
    return inputs[rank * per_rank:(rank + 1) * per_rank], targets[rank * per_rank:(rank + 1) * per_rank]


def single_process_states(seed: int, batches) -> list[dict]:
    """The oracle: rank 0's initial model trained on the full batches in one process; its state
    after each SGD step."""
    model = tiny_mlp(MLP_SIZES, seed, input_scaling=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    states = [state_as_numpy(model)]
    for inputs, targets in batches:
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        states.append(state_as_numpy(model))
    return states


def _compare_states(mine: dict, reference: dict, what: str) -> None:
    expect(isinstance(mine, dict) and set(mine) == set(reference),
           f"{what}: the model's parameters and buffers changed names or number")
    for name, value in reference.items():
        expect_close(mine[name], value, f"{what}, `{name}`", rtol=1e-4, atol=1e-5)


def _update_ratio(mine: dict, initial: dict, reference: dict) -> float | None:
    """How many times the reference's update the learner's update is, or None when it is not a
    multiple of it (a rank that stepped with its own shard's gradient moved in another direction,
    by any length)."""
    names = [name for name in reference if name in mine and not name.endswith("scale")]
    update = np.concatenate([(mine[k] - initial[k]).ravel() for k in names])
    wanted = np.concatenate([(reference[k] - initial[k]).ravel() for k in names])
    ratio = float(update @ wanted / (wanted @ wanted))
    return ratio if np.linalg.norm(update - ratio * wanted) <= 1e-3 * np.linalg.norm(update) else None


def _diagnose_first_update(mine: dict, initial: dict, reference: dict, n: int, rank: int) -> None:
    """Name the classic mistakes by the size of the first update: summing without averaging
    (n times too large) or averaging twice (n times too small)."""
    ratio = _update_ratio(mine, initial, reference)
    if ratio is None:
        return
    if abs(ratio - n) < 0.05 * n:
        raise CheckFailed(f"rank {rank}'s first update is {ratio:.2f}x the single-process one (world {n}): you "
                          "summed the gradients; divide by the world size to average them. (With Adam this bug "
                          "would hide: Adam's update barely changes when every gradient is scaled by n.)")
    if abs(ratio - 1 / n) < 0.05 / n:
        raise CheckFailed(f"rank {rank}'s first update is 1/{n} of the single-process one: you divided by the "
                          "world size twice")


def _by_hand_on_rank(rank, world_size, broadcast_parameters, average_gradients, seeds, batches):
    model = tiny_mlp(MLP_SIZES, seeds[rank], input_scaling=True)  # every rank starts from different weights
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    states = []
    with CommunicationLog() as log:
        broadcast_parameters(model)
        states.append(state_as_numpy(model))
        for batch in batches:
            optimizer.zero_grad()
            inputs, targets = _shard(batch, rank)
            nn.functional.mse_loss(model(inputs), targets).backward()
            average_gradients(model)
            optimizer.step()
            states.append(state_as_numpy(model))
    return {"states": states, "events": events_as_data(log)}


def _training_inputs(rng, world_sizes):
    return [(n, [int(rng.integers(1 << 20)) for _ in range(n)], int(rng.integers(1 << 20))) for n in world_sizes]


def _judge_trajectory(per_rank, seeds, batch_seed, n, what) -> None:
    reference = single_process_states(seeds[0], _batches(batch_seed, n))
    for rank, outcome in enumerate(per_rank):  # where every rank started, before how any of them moved
        states = outcome["states"]
        expect(len(states) == len(reference), f"{what}: the training loop did not complete")
        try:
            _compare_states(states[0], reference[0], f"rank {rank}'s model after broadcasting (world {n})")
        except CheckFailed as failed:
            buffer_only = all(np.allclose(states[0][k], reference[0][k]) for k in reference[0] if not k.endswith("scale"))
            hint = (" Parameters agree but the buffer does not: DDP broadcasts buffers too (model.buffers())."
                    if buffer_only else " Every rank must start from rank 0's parameters and buffers.")
            raise CheckFailed(str(failed) + hint) from None
    for rank, outcome in enumerate(per_rank):
        _diagnose_first_update(outcome["states"][1], reference[0], reference[1], n, rank)
        for step in range(1, len(reference)):
            _compare_states(outcome["states"][step], reference[step], f"rank {rank} after step {step} of {what} (world {n})")


@exercise("dp.ddp_by_hand", points=2)
class DataParallelByHand(Check):
    """Verifies: ranks that start from different random weights and buffers agree with rank 0
    after `broadcast_parameters`, and after each of 3 SGD steps with `average_gradients` they hold
    exactly what single-process training on the full batch gives, for worlds of 2 and 4.
    Fakes: torch's DistributedDataParallel (it trips); skipping the broadcast (ranks start apart);
    not communicating (each rank only has its shard's gradient).
    """

    reads = ("broadcast_parameters", "average_gradients")
    references = (DDP_CLASS,)
    timeout_s = 60
    runs_world = True

    def prepare(self, rng):
        return _training_inputs(rng, (2, 4))

    def collect(self, student, worlds):
        return run_worlds(_by_hand_on_rank, [(n, (student.broadcast_parameters, student.average_gradients, seeds,
                                                  _batches(batch_seed, n))) for n, seeds, batch_seed in worlds])

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        for (n, seeds, batch_seed), per_rank in zip(worlds, done):
            _judge_trajectory(per_rank, seeds, batch_seed, n, "your average_gradients")
        raise_world_failure(failure)
        return (f"ranks starting from different weights agree after broadcast_parameters, and {STEPS} SGD steps "
                "equal single-process full-batch training (world sizes 2 and 4)")


def _bucketed_on_rank(rank, world_size, bucketed_ddp, cap, seeds, batches):
    model = tiny_mlp(MLP_SIZES, seeds[rank], input_scaling=True)
    states = []
    with CommunicationLog() as log:
        # Fires when backward computes the first layer's weight gradient, the last one it computes.
        model[FIRST_LINEAR].weight.register_hook(lambda grad: log.mark("first layer reached"))
        wrapped = bucketed_ddp(model, cap)
        log.mark("wrapped")
        trained = wrapped if isinstance(wrapped, nn.Module) else model
        optimizer = torch.optim.SGD(trained.parameters(), lr=LEARNING_RATE)
        states.append(state_as_numpy(model))
        for batch in batches:
            optimizer.zero_grad()
            inputs, targets = _shard(batch, rank)
            loss = nn.functional.mse_loss(wrapped(inputs), targets)
            log.mark("backward")
            loss.backward()
            log.mark("backward done")
            wrapped.finish_gradient_sync()
            log.mark("synced")
            optimizer.step()
            states.append(state_as_numpy(model))
    return {"states": states, "events": events_as_data(log)}


def _split_steps(events: list[dict]) -> list[list[dict]]:
    """The events of each training step, from its "backward" mark to its "synced" mark."""
    steps, current = [], None
    for index, event in enumerate(events):
        event = {**event, "index": index}
        if event.get("label") == "backward":
            current = []
        if current is not None:
            current.append(event)
        if event.get("label") == "synced" and current is not None:
            steps.append(current)
            current = None
    return steps


def _judge_bucket_mechanism(events, buckets: list[int], cap: int, rank: int) -> None:
    steps = _split_steps(events)
    expect(len(steps) == STEPS, f"rank {rank}: the training loop did not complete")
    for step, step_events in enumerate(steps, 1):
        reduces = [e for e in step_events if e["op"] == "all_reduce"]
        sizes = [e["bytes"] for e in reduces]
        expect(len(sizes) == len(buckets),
               f"with bucket_cap_bytes={cap} the gradients form {len(buckets)} buckets (filled from the last parameter "
               f"backwards, each closed once it holds at least the cap), so {len(buckets)} all-reduces per step; "
               f"rank {rank} issued {len(sizes)} in step {step}")
        expect(sorted(sizes) == sorted(buckets),
               f"with bucket_cap_bytes={cap} the buckets should hold {buckets} bytes (filled from the last parameter "
               f"backwards, each closed once it holds at least the cap); rank {rank} all-reduced {sizes} bytes")
        labels = [e.get("label") for e in step_events]
        done = step_events[labels.index("backward done")]["index"]
        first_layer = next(e["index"] for e in step_events if e.get("label") == "first layer reached")
        if len(buckets) > 1:
            expect(reduces[0]["index"] < first_layer,
                   f"rank {rank} launched its first all-reduce only after backward reached the first layer: launch "
                   "each bucket from a gradient hook as soon as its last gradient is ready, so communication overlaps "
                   "the rest of backward")
        waits = {e["of"]: e["index"] for e in step_events if e["op"] == "wait"}
        for reduce in reduces:
            waited = waits.get(reduce["index"])
            expect(waited is not None, f"rank {rank} never waited on one of its all-reduce handles in step {step}: "
                                       "call .wait() on every handle in finish_gradient_sync before using the gradients")
            if len(buckets) > 1:
                expect(waited > done, f"rank {rank} waited for an all-reduce inside backward (in the hook), which "
                                      "stalls backward until it completes: launch with async_op=True in the hook and "
                                      "wait in finish_gradient_sync")


@exercise("dp.bucketed_ddp", points=3)
class BucketedDataParallel(Check):
    """Verifies: training equals single-process training (ranks start apart, so the wrapper must
    broadcast); per step, one all-reduce per bucket with DDP's bucket sizes (reverse order, a
    bucket closes once it holds at least the cap), for caps of 1 byte, exactly a cumulative
    size, and 1 GiB; with several buckets the first all-reduce starts before backward reaches the
    first layer, and every handle is waited on after backward, not inside it.
    Fakes: torch's DDP inside (it trips); launching all buckets from the last hook, waiting in
    the hook, or waiting only on the last handle (the recorded order of launches and waits).
    """

    reads = ("BucketedDDP",)
    references = (DDP_CLASS, "dtp.costs.ddp_bucket_sizes")
    timeout_s = 60
    runs_world = True

    def prepare(self, rng):
        sizes = [p.numel() * 4 for p in tiny_mlp(MLP_SIZES).parameters()]
        cumulative = np.cumsum(sizes[::-1])
        exact = int(cumulative[int(rng.integers(1, len(sizes) - 2))])  # a cap equal to a bucket's size
        return [(n, cap, seeds, batch_seed) for (n, seeds, batch_seed), cap
                in zip(_training_inputs(rng, (2, 3, 2)), (1, exact, 1 << 30))]

    def collect(self, student, worlds):
        return run_worlds(_bucketed_on_rank, [(n, (student.BucketedDDP, cap, seeds, _batches(batch_seed, n)))
                                              for n, cap, seeds, batch_seed in worlds])

    def judge(self, worlds, outcomes) -> str:
        sizes = [p.numel() * 4 for p in tiny_mlp(MLP_SIZES).parameters()]
        done, failure = completed_worlds(outcomes)
        for (n, cap, seeds, batch_seed), per_rank in zip(worlds, done):
            buckets = costs.ddp_bucket_sizes(sizes, cap)
            for rank, outcome in enumerate(per_rank):  # counts first: they explain a wrong result best
                _judge_bucket_mechanism(outcome["events"], buckets, cap, rank)
            _judge_trajectory(per_rank, seeds, batch_seed, n, f"BucketedDDP(bucket_cap_bytes={cap})")
        raise_world_failure(failure)
        return (f"equal to single-process training over {STEPS} steps; caps of 1 byte, exactly one bucket's size and "
                "1 GiB give DDP's buckets, launched during backward and waited on after it")


def _accumulation_on_rank(rank, world_size, accumulate, seeds, batches, micro_batches):
    model = tiny_mlp(MLP_SIZES, seeds[0], input_scaling=True)
    ddp = nn.parallel.DistributedDataParallel(model)

    def counted_all_reduce(_, bucket):  # DDP's default hook, but through Python, so the log sees it
        buffer = bucket.buffer().div_(world_size)
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda future: future.value()[0])

    ddp.register_comm_hook(None, counted_all_reduce)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LEARNING_RATE)
    states, per_step = [state_as_numpy(model)], []
    with CommunicationLog() as log:
        for batch in batches:
            inputs, targets = _shard(batch, rank, SHARD * micro_batches)
            pieces = list(zip(inputs.chunk(micro_batches), targets.chunk(micro_batches)))
            optimizer.zero_grad()
            before = len(log.of("all_reduce"))
            accumulate(ddp, optimizer, pieces)
            per_step.append(len(log.of("all_reduce")) - before)
            states.append(state_as_numpy(model))
    return {"states": states, "all_reduces_per_step": per_step}


@exercise("dp.gradient_accumulation", points=2)
class GradientAccumulation(Check):
    """Verifies: `accumulation_step(ddp_model, optimizer, micro_batches)` on torch DDP takes the
    same step as single-process training on the whole batch, for 2 steps of 3 micro-batches on
    2 ranks, and all-reduces once per step (one bucket), not once per micro-batch.
    Fakes: syncing every micro-batch gives the right weights but 3x the all-reduces (counted by a
    comm hook that sends DDP's buckets through the recorded process group).
    """

    reads = ("accumulation_step",)
    timeout_s = 40
    runs_world = True
    MICRO_BATCHES = 3

    def prepare(self, rng):
        return _training_inputs(rng, (2,))

    def collect(self, student, worlds):
        return run_worlds(_accumulation_on_rank, [
            (n, (student.accumulation_step, seeds, _batches(batch_seed, n, 2, SHARD * self.MICRO_BATCHES),
                 self.MICRO_BATCHES)) for n, seeds, batch_seed in worlds])

    def judge(self, worlds, outcomes) -> str:
        k = self.MICRO_BATCHES
        done, failure = completed_worlds(outcomes)
        for (n, seeds, batch_seed), per_rank in zip(worlds, done):
            reference = single_process_states(seeds[0], _batches(batch_seed, n, 2, SHARD * k))
            for rank, outcome in enumerate(per_rank):
                counts = outcome["all_reduces_per_step"]
                if counts and counts[0] == 0:
                    raise CheckFailed(f"rank {rank} never all-reduced: the last micro-batch's backward must run "
                                      "outside no_sync(), so that DDP averages the accumulated gradients")
                states = outcome["states"]
                if len(states) > 1:
                    ratio = _update_ratio(states[1], reference[0], reference[1])
                    if ratio is not None and abs(ratio - k) < 0.05 * k:
                        raise CheckFailed(f"rank {rank}'s update is {k}x the large-batch step: divide each "
                                          f"micro-batch's loss by the number of micro-batches ({k})")
                for step in range(1, len(reference)):
                    _compare_states(states[step], reference[step],
                                    f"rank {rank} after accumulation step {step} (world {n}, {k} micro-batches)")
                expect(counts == [1] * (len(reference) - 1),
                       f"rank {rank} all-reduced {counts} times per step; with no_sync() on every micro-batch but the "
                       "last, DDP all-reduces once per step (this small model's gradients fill one bucket). DDP "
                       "decides during the forward pass whether the next backward synchronises, so run the forward "
                       "inside no_sync() too")
        raise_world_failure(failure)
        return (f"{k} micro-batches accumulated under no_sync() give the large-batch step, with one all-reduce per step")


# --- 6. costs ---------------------------------------------------------------------------------

@exercise("dp.ring_time", points=1)
class RingTime(FormulaCheck):
    """Verifies: T = 2(n-1)·alpha + 2(n-1)/n·S/bandwidth on random n, S, alpha and bandwidth.
    Fakes: calling dtp.costs.ring_all_reduce_time trips."""

    function = "ring_allreduce_time"
    references = ("dtp.costs.ring_all_reduce_time",)
    timeout_s = 15
    rel = 1e-6
    summary = "matches T = 2(n-1)·alpha + 2(n-1)/n·S/bandwidth on random inputs"

    def cases(self, rng):
        return [((int(rng.integers(2, 1025)), float(rng.uniform(1e3, 1e10)), float(rng.uniform(1e-6, 5e-5)),
                  float(rng.uniform(1e9, 5e11))), {}) for _ in range(6)]

    def expected(self, n, size, alpha, bandwidth):
        return costs.ring_all_reduce_time(n, size, alpha, bandwidth)

    def slips(self, n, size, alpha, bandwidth):
        transfer = costs.ring_all_reduce_bytes_per_rank(n, size) / bandwidth
        return {f"the latency term 2(n-1)·alpha = {2 * (n - 1) * alpha:.4g} s is missing": transfer,
                "that counts n-1 latencies; the ring takes 2(n-1) steps (reduce-scatter + all-gather)":
                    (n - 1) * alpha + transfer}


@exercise("dp.bus_bandwidth", points=1)
class BusBandwidth(FormulaCheck):
    """Verifies: busbw = S/t · 2(n-1)/n on random S, t and n (n = 2, where busbw = algbw, included).
    Fakes: calling dtp.costs.bus_bandwidth trips."""

    function = "bus_bandwidth"
    references = ("dtp.costs.bus_bandwidth",)
    timeout_s = 15
    rel = 1e-6
    summary = "matches busbw = S/t · 2(n-1)/n on random inputs (n = 2 included)"

    def cases(self, rng):
        ns = [2] + [int(rng.integers(3, 513)) for _ in range(4)]
        return [((float(rng.uniform(1e6, 1e10)), float(rng.uniform(1e-4, 1.0)), n), {}) for n in ns]

    def expected(self, size, seconds, n):
        return costs.bus_bandwidth(size, seconds, n)

    def slips(self, size, seconds, n):
        return {"that is the algorithm bandwidth S/t; bus bandwidth scales it by 2(n-1)/n": size / seconds}


# An interview question with fixed numbers, answered in two variables of the notebook.
INTERVIEW = dict(parameters=1.3e9, bytes_per_gradient=2, gpus=64, link_bandwidth=100e9)


@exercise("dp.interview", points=1)
class Interview(FixedAnswers):
    """Verifies: bytes each GPU sends in a ring all-reduce of fp16 gradients, and the time on
    links of a given bandwidth. Fakes: a fixed question, so a copied number passes; it is worth
    one point for that reason."""

    reads = ("interview_bytes_sent_per_gpu", "interview_allreduce_ms")

    def judge(self, inputs, answers) -> str:
        q = INTERVIEW
        size = q["parameters"] * q["bytes_per_gradient"]
        sent = costs.ring_all_reduce_bytes_per_rank(q["gpus"], size)
        expect_answer(answers[0], sent, "interview_bytes_sent_per_gpu", rel=1e-3,
                      slips={"that is the gradient size S; a ring sends 2(n-1)/n·S per GPU": size})
        expect_answer(answers[1], sent / q["link_bandwidth"] * 1e3, "interview_allreduce_ms", rel=1e-3,
                      slips={"that uses S, not the 2(n-1)/n·S each GPU sends": size / q["link_bandwidth"] * 1e3})
        return "both interview answers are right"
