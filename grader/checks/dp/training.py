"""Data-parallel training on gloo: DDP by hand (broadcast, gradient averaging), bucketed DDP
with backward hooks, and gradient accumulation with no_sync. The oracle is single-process
training on the full batch from rank 0's initial weights; the mechanism is read from the
collectives and waits recorded on the process group."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from dtp.common.models import regression_batch, state_as_numpy, tiny_mlp
from dtp.common.traffic import CommunicationLog
from dtp.common.world import LAZY_TORCH_MODULES
from dtp.dp import costs

from ...compare import CheckFailed, expect, expect_close
from ...registry import Check, exercise
from ..common import WorldsCheck, completed_worlds, events_as_data, raise_world_failure, run_worlds

DDP_CLASS = "torch.nn.parallel.DistributedDataParallel"

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
class DataParallelByHand(WorldsCheck):
    """Verifies: ranks that start from different random weights and buffers agree with rank 0
    after `broadcast_parameters`, and after each of 3 SGD steps with `average_gradients` they hold
    exactly what single-process training on the full batch gives, for worlds of 2 and 4.
    Fakes: torch's DistributedDataParallel (it trips); skipping the broadcast (ranks start apart);
    not communicating (each rank only has its shard's gradient).
    """

    reads = ("broadcast_parameters", "average_gradients")
    references = (DDP_CLASS,)
    timeout_s = 60
    summary = (f"ranks starting from different weights agree after broadcast_parameters, and {STEPS} SGD steps "
               "equal single-process full-batch training (world sizes 2 and 4)")

    def prepare(self, rng):
        return _training_inputs(rng, (2, 4))

    def collect(self, student, worlds):
        return run_worlds(_by_hand_on_rank, [(n, (student.broadcast_parameters, student.average_gradients, seeds,
                                                  _batches(batch_seed, n))) for n, seeds, batch_seed in worlds])

    def judge_world(self, world, per_rank) -> None:
        n, seeds, batch_seed = world
        _judge_trajectory(per_rank, seeds, batch_seed, n, "your average_gradients")


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


def _buckets_never_past_the_cap(parameter_bytes: list[int], cap: int) -> list[int]:
    """A known near-miss of DDP's rule: a bucket is closed before a parameter would take it past
    the cap (a parameter larger than the cap gets a bucket of its own)."""
    buckets, current = [], 0
    for size in reversed(parameter_bytes):
        if current and current + size > cap:
            buckets.append(current)
            current = 0
        current += size
    return buckets + ([current] if current else [])


def _buckets_past_the_cap(parameter_bytes: list[int], cap: int) -> list[int]:
    """Another near-miss: a bucket closes only once it holds more than the cap."""
    return costs.ddp_bucket_sizes(parameter_bytes, cap + 1)


def _separating_caps(parameter_bytes: list[int]) -> list[int]:
    """Caps equal to a cumulative size (from the last parameter) at which DDP's rule forms other
    buckets than both near-misses: every grading tests one of them, so neither can pass by the
    draw (at some cumulative sizes a near-miss forms the same buckets)."""
    cumulative = np.cumsum(parameter_bytes[::-1])[:-1]
    caps = [int(cap) for cap in cumulative
            if costs.ddp_bucket_sizes(parameter_bytes, int(cap)) not in
            (_buckets_never_past_the_cap(parameter_bytes, int(cap)), _buckets_past_the_cap(parameter_bytes, int(cap)))]
    assert caps, "the check's model has no cap that tells DDP's bucket rule from its near-misses"
    return caps


def _judge_bucket_mechanism(events, buckets: list[int], cap: int, rank: int, parameter_bytes: list[int]) -> None:
    steps = _split_steps(events)
    expect(len(steps) == STEPS, f"rank {rank}: the training loop did not complete")
    for step, step_events in enumerate(steps, 1):
        reduces = [e for e in step_events if e["op"] == "all_reduce"]
        sizes = [e["bytes"] for e in reduces]
        expect(len(sizes) == len(buckets) or sorted(sizes) == sorted(_buckets_never_past_the_cap(parameter_bytes, cap)),
               f"with bucket_cap_bytes={cap} the gradients form {len(buckets)} buckets (filled from the last parameter "
               f"backwards, each closed once it holds at least the cap), so {len(buckets)} all-reduces per step; "
               f"rank {rank} issued {len(sizes)} in step {step}")
        if sorted(sizes) != sorted(buckets) and sorted(sizes) == sorted(_buckets_never_past_the_cap(parameter_bytes, cap)):
            raise CheckFailed(
                f"with bucket_cap_bytes={cap} rank {rank} all-reduced buckets of {sizes} bytes: yours never grow past "
                f"the cap. DDP adds a parameter to the open bucket first and closes the bucket once it holds at least "
                f"the cap, so a bucket can exceed it by one parameter: {buckets} bytes")
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
    size (always one where a bucket that never grows past the cap, or closes only past it, forms
    other buckets), and 1 GiB; with several buckets the first all-reduce starts before backward reaches the
    first layer, and every handle is waited on after backward, not inside it.
    Fakes: torch's DDP inside (it trips); launching all buckets from the last hook, waiting in
    the hook, or waiting only on the last handle (the recorded order of launches and waits).
    """

    reads = ("BucketedDDP",)
    references = (DDP_CLASS, "dtp.dp.costs.ddp_bucket_sizes")
    timeout_s = 60
    runs_world = True
    preimport = LAZY_TORCH_MODULES

    def prepare(self, rng):
        sizes = [p.numel() * 4 for p in tiny_mlp(MLP_SIZES).parameters()]
        exact = int(rng.choice(_separating_caps(sizes)))
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
                _judge_bucket_mechanism(outcome["events"], buckets, cap, rank, sizes)
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
    preimport = LAZY_TORCH_MODULES
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
