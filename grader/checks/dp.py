"""Checks of the data-parallelism chapter (notebook 02_data_parallel).

Oracles: numpy sums, `dist.all_reduce`, single-process training on the full batch, torch's
`DistributedDataParallel`, and the closed forms in `dtp.costs`. Inputs are random on every run.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dtp import costs
from dtp.models import parameters_as_numpy, regression_batch, tiny_mlp
from dtp.traffic import TrafficCounter
from dtp.world import run_world

from ..compare import CheckFailed, expect, expect_close, expect_number
from ..registry import exercise
from ..sandbox import seconds_left


def world_options() -> dict:
    """Limits for a check's gloo world within the exercise's time limit: a deadlocked collective
    must time out (and be reported as a deadlock) well before the sandbox is killed."""
    left = seconds_left()
    return dict(timeout_s=left, collective_timeout_s=min(8.0, left / 3))


# --- 1. ring all-reduce over simulated ranks --------------------------------------------------

def _diagnose_partial_reduction(result: np.ndarray, expected: np.ndarray, n: int) -> str:
    if result.shape != expected.shape:
        return ""
    reduced = np.isclose(result, expected).mean()
    if 0 < reduced <= 1.5 / n:
        return (f" Only {reduced:.0%} of the entries hold the full sum, about one chunk in {n}: "
                "that is the state after the reduce-scatter; did you forget the all-gather phase?")
    return ""


@exercise("dp.ring_allreduce_numpy", points=2, reads=("ring_all_reduce_numpy",), timeout_s=30)
def check_ring_allreduce_numpy(student) -> str:
    ring = student.ring_all_reduce_numpy
    rng = np.random.default_rng()
    for n in (2, 3, 4, 7):
        for length in (n * int(rng.integers(3, 9)), n * int(rng.integers(3, 9)) + int(rng.integers(1, n))):
            arrays = [rng.standard_normal(length) for _ in range(n)]
            originals = [a.copy() for a in arrays]
            returned = ring([a.copy() for a in arrays])
            expect(isinstance(returned, (tuple, list)) and len(returned) == 2,
                   "ring_all_reduce_numpy must return a pair (results, bytes_sent)")
            results, bytes_sent = returned
            expect(len(results) == n, f"with {n} ranks you returned {len(results)} results, expected one per rank")
            expected = np.sum(originals, axis=0)
            for rank, result in enumerate(results):
                try:
                    expect_close(result, expected, f"rank {rank}'s result (n={n}, {length} elements)")
                except CheckFailed as failed:
                    raise CheckFailed(str(failed) + _diagnose_partial_reduction(np.asarray(result), expected, n))
            size = originals[0].nbytes
            expect(len(bytes_sent) == n and all(isinstance(b, (int, np.integer)) or
                                                (isinstance(b, (float, np.floating)) and float(b).is_integer())
                                                for b in bytes_sent),
                   f"bytes_sent must hold one whole number of bytes per rank (got {str(bytes_sent)[:80]})")
            per_rank = costs.ring_all_reduce_bytes_per_rank(n, size)
            if length % n == 0 and not all(b == per_rank for b in bytes_sent):
                if all(b == (n - 1) / n * size for b in bytes_sent):
                    raise CheckFailed(f"each rank sent (n-1)/n·S = {(n - 1) * size // n} bytes, one phase only; "
                                      "a ring all-reduce is a reduce-scatter and then an all-gather, 2(n-1)/n·S")
                if all(b == (n - 1) * size for b in bytes_sent):
                    raise CheckFailed(f"each rank sent (n-1)·S = {(n - 1) * size} bytes, as if it sent its whole "
                                      f"array to every other rank; the ring sends chunks of S/n, 2(n-1)/n·S = {per_rank:.0f} in all")
                raise CheckFailed(f"n={n}, S={size} bytes: ranks sent {list(map(int, bytes_sent))} bytes; "
                                  f"each should send 2(n-1)/n·S = {per_rank:.0f}")
            if length % n:
                expect(sum(bytes_sent) == 2 * (n - 1) * size,
                       f"n={n}, S={size} bytes (not divisible by n): the ranks sent {int(sum(bytes_sent))} bytes in all; "
                       f"every chunk travels n-1 hops in each phase, so the total is 2(n-1)·S = {2 * (n - 1) * size}")
    return "results equal the sum on every rank; each rank sent 2(n-1)/n·S bytes (n = 2, 3, 4, 7)"


# --- 2. ring all-reduce on gloo ---------------------------------------------------------------

def _ring_on_rank(rank, world_size, ring, sizes, seed):
    outcomes = []
    for size in sizes:
        generator = torch.Generator().manual_seed(seed * 1000 + rank * 10 + size)
        mine = torch.randn(size, generator=generator)
        original, expected = mine.clone(), mine.clone()
        dist.all_reduce(expected)
        with TrafficCounter() as traffic:
            ring(mine)
        outcomes.append((size, mine, expected, traffic.bytes_sent, len(traffic.all_reduce_calls),
                         torch.equal(mine, original)))
    return outcomes


@exercise("dp.ring_allreduce_gloo", points=2, reads=("ring_all_reduce",), timeout_s=40)
def check_ring_allreduce_gloo(student) -> str:
    ring = student.ring_all_reduce
    rng = np.random.default_rng()
    for n in (2, 4):
        # n + 2 elements: chunking that yields fewer than n chunks (torch.chunk(6, 4) gives 3) shows up.
        sizes = [n * 64, n * int(rng.integers(20, 60)) + int(rng.integers(1, n)), n + 2, int(rng.integers(n, 5000))]
        per_rank = run_world(_ring_on_rank, n, (ring, sizes, int(rng.integers(1 << 30))), **world_options())
        for rank, outcomes in enumerate(per_rank):
            for size, result, expected, _, all_reduces, unchanged in outcomes:
                expect(all_reduces == 0, "your ring called dist.all_reduce; build it from send/recv (or isend/irecv)")
                expect(not unchanged, f"rank {rank}'s tensor is unchanged after ring_all_reduce (world {n}, {size} "
                       "floats): sum into `tensor` in place, like dist.all_reduce (write into views of it, e.g. "
                       "chunks from tensor.tensor_split(n), with add_ and copy_)")
                expect_close(result, expected, f"rank {rank}'s tensor after ring_all_reduce (world {n}, {size} floats)",
                             rtol=1e-4, atol=1e-5)
        for index, size in enumerate(sizes):
            total = sum(outcomes[index][3] for outcomes in per_rank)
            expect(total == 2 * (n - 1) * size * 4,
                   f"world {n}, {size} floats: the ranks sent {total} bytes in all; a ring all-reduce sends "
                   f"2(n-1)·S = {2 * (n - 1) * size * 4} (each of n chunks travels n-1 hops per phase)")
    return "equal to dist.all_reduce for world sizes 2 and 4, sizes divisible and not by n, with 2(n-1)·S bytes sent"


# --- 3 and 4. data parallel training ----------------------------------------------------------

MLP_SIZES = (8, 32, 16, 4)
STEPS, LEARNING_RATE, SHARD = 3, 0.1, 4


def _train(model, batches, after_backward=lambda: None, during_backward_calls=None, traffic=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(inputs), targets)
        before = len(traffic.all_reduce_calls) if traffic else 0
        loss.backward()
        if during_backward_calls is not None:
            during_backward_calls.append(len(traffic.all_reduce_calls) - before)
        after_backward()
        optimizer.step()


def _data_parallel_on_rank(rank, world_size, student_kind, student_impl, bucket_cap_bytes, seed):
    """Train three copies of one model: the learner's data parallelism, torch DDP, and a
    single process on the full batch; return their parameters and the collectives counted."""
    full = [regression_batch(SHARD * world_size, MLP_SIZES[0], MLP_SIZES[-1], seed + step) for step in range(STEPS)]
    shards = [(x[rank * SHARD:(rank + 1) * SHARD], y[rank * SHARD:(rank + 1) * SHARD]) for x, y in full]

    reference = tiny_mlp(MLP_SIZES, seed)
    initial = parameters_as_numpy(reference)
    _train(reference, full[:1])  # plain SGD keeps no state, so training in two calls changes nothing
    reference_after_one_step = parameters_as_numpy(reference)
    _train(reference, full[1:])

    ddp = nn.parallel.DistributedDataParallel(tiny_mlp(MLP_SIZES, seed))
    _train(ddp, shards)

    model = tiny_mlp(MLP_SIZES, seed)
    during_backward = []
    with TrafficCounter() as traffic:
        if student_kind == "by_hand":
            _train(model, shards[:1], lambda: student_impl(model))
            after_one_step = parameters_as_numpy(model)
            _train(model, shards[1:], lambda: student_impl(model))
        else:
            wrapped = student_impl(model, bucket_cap_bytes)
            _train(wrapped, shards, wrapped.finish_gradient_sync, during_backward, traffic)
            after_one_step = None
            if isinstance(wrapped, nn.Module):
                model = wrapped  # its parameters are the ones trained, even if it copied the model
    return {"learner": parameters_as_numpy(model), "communicated_bytes": traffic.bytes_sent +
            sum(call["bytes"] for call in traffic.all_reduce_calls), "ddp": parameters_as_numpy(ddp.module),
            "single": parameters_as_numpy(reference), "initial": initial, "after_one_step": after_one_step,
            "single_after_one_step": reference_after_one_step,
            "all_reduce_calls": traffic.all_reduce_calls, "during_backward": during_backward}


def _compare_training(outcomes, n: int, what: str) -> None:
    for rank, out in enumerate(outcomes):
        for index, (mine, single, ddp) in enumerate(zip(out["learner"], out["single"], out["ddp"])):
            expect_close(ddp, single, "torch DDP against single-process training (grader self-check)", rtol=1e-4, atol=1e-5)
            expect_close(mine, single, f"rank {rank}'s parameter {index} after {STEPS} steps of {what} (world {n})",
                         rtol=1e-4, atol=1e-5)


def _check_update_ratio(outcomes, n: int) -> None:
    """Name the classic mistakes: summing without averaging (n× too large) or averaging twice."""
    for rank, out in enumerate(outcomes):
        def first_update(after):
            return np.concatenate([(p - p0).ravel() for p, p0 in zip(after, out["initial"])])
        mine, reference = first_update(out["after_one_step"]), first_update(out["single_after_one_step"])
        ratio = float(mine @ reference / (reference @ reference))
        if abs(ratio - n) < 0.05 * n:
            raise CheckFailed(f"rank {rank}'s first update is {ratio:.2f}x the single-process one (world {n}): "
                              "you summed the gradients; divide by the world size to average them")
        if abs(ratio - 1 / n) < 0.05 / n:
            raise CheckFailed(f"rank {rank}'s first update is 1/{n} of the single-process one: you divided by the "
                              "world size twice, or averaged without summing across ranks")


@exercise("dp.ddp_by_hand", points=2, reads=("average_gradients",), timeout_s=60)
def check_ddp_by_hand(student) -> str:
    average_gradients = student.average_gradients
    seed = int(np.random.default_rng().integers(1 << 20))
    for n in (2, 4):
        outcomes = run_world(_data_parallel_on_rank, n, ("by_hand", average_gradients, None, seed), **world_options())
        _check_update_ratio(outcomes, n)
        try:
            _compare_training(outcomes, n, "your average_gradients")
        except CheckFailed as failed:
            if any(out["communicated_bytes"] == 0 for out in outcomes):
                raise CheckFailed(f"{failed} Your average_gradients communicated nothing: each rank only has "
                                  "the gradient of its own shard until an all-reduce sums them") from None
            raise
    return f"{STEPS} SGD steps equal single-process full-batch training and torch DDP, world sizes 2 and 4"


@exercise("dp.bucketed_ddp", points=3, reads=("BucketedDDP",), timeout_s=60)
def check_bucketed_ddp(student) -> str:
    bucketed = student.BucketedDDP
    seed = int(np.random.default_rng().integers(1 << 20))
    sizes = [p.numel() * 4 for p in tiny_mlp(MLP_SIZES).parameters()]
    caps = (1, int(np.random.default_rng().integers(sizes[0] + 64, sizes[0] + sizes[2])), 1 << 30)
    for n, cap in ((2, caps[0]), (4, caps[1]), (2, caps[2])):
        outcomes = run_world(_data_parallel_on_rank, n, ("bucketed", bucketed, cap, seed), **world_options())
        buckets = costs.ddp_bucket_sizes(sizes, cap)
        for rank, out in enumerate(outcomes):
            launched = [call["bytes"] for call in out["all_reduce_calls"]]
            expect(len(launched) == len(buckets) * STEPS,
                   f"with bucket_cap_bytes={cap} the {len(sizes)} parameters ({sizes} bytes) form {len(buckets)} buckets, "
                   f"so {len(buckets)} all-reduces per step; rank {rank} launched {len(launched) / STEPS:g} per step")
            expect(sorted(launched[:len(buckets)]) == sorted(buckets),
                   f"with bucket_cap_bytes={cap} the buckets should hold {buckets} bytes (filled from the last "
                   f"parameter backwards); rank {rank} all-reduced tensors of {launched[:len(buckets)]} bytes")
            expect(out["during_backward"] == [len(buckets)] * STEPS,
                   f"rank {rank} launched {out['during_backward']} all-reduces during backward in each step, expected "
                   f"{len(buckets)}: launch each bucket from a gradient hook as soon as its last gradient is ready")
            expect(all(call["async_op"] for call in out["all_reduce_calls"]),
                   "call dist.all_reduce(..., async_op=True) in the hooks, so communication overlaps the rest "
                   "of backward, and wait for the handles in finish_gradient_sync")
        # Counts first: a wrong count explains a wrong result better than the parameters do.
        _compare_training(outcomes, n, f"BucketedDDP(bucket_cap_bytes={cap})")
    return (f"equal to single-process training and torch DDP; {STEPS} steps with bucket caps of 1 byte, "
            "about 2 kB and 1 GiB give the expected number of asynchronous all-reduces, all launched during backward")


# --- 5. costs ---------------------------------------------------------------------------------

@exercise("dp.ring_time", points=1, reads=("ring_allreduce_time",), timeout_s=15)
def check_ring_time(student) -> str:
    ring_time = student.ring_allreduce_time
    rng = np.random.default_rng()
    for _ in range(5):
        n, size = int(rng.integers(2, 1025)), float(rng.uniform(1e3, 1e10))
        alpha, bandwidth = float(rng.uniform(1e-6, 5e-5)), float(rng.uniform(1e9, 5e11))
        expected = costs.ring_all_reduce_time(n, size, alpha, bandwidth)
        answer = ring_time(n, size, alpha, bandwidth)
        what = f"ring_allreduce_time(n={n}, size_bytes={size:.4g}, alpha_s={alpha:.3g}, bandwidth={bandwidth:.3g})"
        latency, transfer = 2 * (n - 1) * alpha, expected - 2 * (n - 1) * alpha
        if isinstance(answer, float) and np.isclose(answer, transfer, rtol=1e-6):
            raise CheckFailed(f"{what} left out the latency term 2(n-1)·alpha = {latency:.4g} s")
        if isinstance(answer, float) and np.isclose(answer, (n - 1) * alpha + transfer, rtol=1e-6):
            raise CheckFailed(f"{what} counted n-1 latencies; the ring takes 2(n-1) steps (reduce-scatter + all-gather)")
        expect_number(answer, expected, what)
    return "matches T = 2(n-1)·alpha + 2(n-1)/n·S/bandwidth on random inputs"


@exercise("dp.bus_bandwidth", points=1, reads=("bus_bandwidth",), timeout_s=15)
def check_bus_bandwidth(student) -> str:
    bus = student.bus_bandwidth
    rng = np.random.default_rng()
    for _ in range(5):
        n, size, seconds = int(rng.integers(2, 513)), float(rng.uniform(1e6, 1e10)), float(rng.uniform(1e-4, 1.0))
        answer = bus(size, seconds, n)
        what = f"bus_bandwidth(size_bytes={size:.4g}, time_s={seconds:.3g}, n={n})"
        if isinstance(answer, float) and np.isclose(answer, size / seconds, rtol=1e-6):
            raise CheckFailed(f"{what} returned the algorithm bandwidth S/t; bus bandwidth scales it by 2(n-1)/n")
        expect_number(answer, costs.bus_bandwidth(size, seconds, n), what)
    return "matches busbw = S/t · 2(n-1)/n on random inputs"


# An interview question with fixed numbers, answered in two variables of the notebook.
INTERVIEW = dict(parameters=1.3e9, bytes_per_gradient=2, gpus=64, bus_bandwidth=100e9)


@exercise("dp.interview", points=1, reads=("interview_bytes_sent_per_gpu", "interview_allreduce_ms"), timeout_s=15)
def check_interview(student) -> str:
    q = INTERVIEW
    size = q["parameters"] * q["bytes_per_gradient"]
    sent = costs.ring_all_reduce_bytes_per_rank(q["gpus"], size)
    if isinstance(student.interview_bytes_sent_per_gpu, (int, float)) and \
            np.isclose(student.interview_bytes_sent_per_gpu, size, rtol=1e-3):
        raise CheckFailed("interview_bytes_sent_per_gpu equals the gradient size S; a ring sends 2(n-1)/n·S per GPU")
    expect_number(student.interview_bytes_sent_per_gpu, sent, "interview_bytes_sent_per_gpu", rel=1e-3)
    expect_number(student.interview_allreduce_ms, sent / q["bus_bandwidth"] * 1e3, "interview_allreduce_ms", rel=1e-3)
    return "both interview answers are right"
