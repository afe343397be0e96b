"""Exercise 2 of the overlap chapter: ZeRO-3 whose all-gathers run under the previous unit's
compute, in forward and in backward, with at most two gathered units alive.

Each rank trains the learner's module for two Adam steps (`dtp.overlap.runs.zero3_prefetch_rank`)
and records, in one ordered list, its all-gathers, reduce-scatters, the waits on their handles
and its matrix products, and after every operation the gathered units alive. The judge reads
order and memory only: a unit's all-gather must be issued before the matrix product that runs
before it is needed, and waited on after that product.
"""
from __future__ import annotations

import numpy as np

from dtp.common.models import tiny_mlp
from dtp.overlap.runs import GATHERED_UNITS_LIMIT, PREFETCH_STEPS, zero3_prefetch_rank
from dtp.zero import formulas as zero
from dtp.zero import runs as zero_runs

from ...compare import CheckFailed, expect, expect_close
from ...registry import exercise
from ..references import refuses_library
from ..common import WorldsCheck, run_worlds
from ..zero.judging import FSDP_REFERENCES
from .order import between_marks, products_between, unexpected_ops, wait_of


def _parameters(sizes):
    return [(p.numel(), p.dim() > 1) for p in tiny_mlp(sizes).parameters()]


class PrefetchJudge:
    def __init__(self, n: int, sizes, seed: int, batch_seed: int, per_rank: list):
        self.n, self.sizes, self.per_rank = n, sizes, per_rank
        self.parameters = _parameters(sizes)
        self.reference = zero_runs.single_process_adam(
            sizes, seed, zero_runs.batches(sizes, batch_seed, n, PREFETCH_STEPS), n)
        self.where = f"with {n} processes"

    def judge(self) -> None:
        for rank, outcome in enumerate(self.per_rank):
            for step, events in enumerate(outcome["events"], 1):
                self.operations(rank, events)
                units = self.units(rank, step, events)
                self.gathered_again(rank, step, events, units)
                self.memory(rank, step, outcome["gathered units"][step - 1])
                for phase, stop in (("forward", "backward"), ("backward", "step")):
                    self.prefetched(rank, step, events, phase, stop)
        self.results()

    def operations(self, rank, events) -> None:
        other = unexpected_ops(events, {"all_gather", "reduce_scatter"})
        expect(not other, f"{self.where}: rank {rank} called {', '.join(other)}; ZeRO-3 needs only all-gathers "
                          "(weights) and reduce-scatters (gradients)")

    def units(self, rank, step, events) -> list[int]:
        pieces = [events[i]["bytes"] // zero.FP32_ITEMSIZE for i in between_marks(events, "forward", "backward")
                  if events[i]["op"] == "all_gather"]
        units = zero.units_from_pieces(pieces, [size for size, _ in self.parameters], self.n, ordered=True)
        if units is None:
            raise CheckFailed(f"{self.where}: in forward of step {step} rank {rank} all-gathered pieces of {pieces} "
                              f"elements for parameters of {[size for size, _ in self.parameters]} elements; gather "
                              "each unit once, in the model's order, in pieces of ceil(u/n) elements")
        return units

    def gathered_again(self, rank, step, events, units) -> None:
        """Every unit holding a weight matrix is gathered again in backward."""
        flags, index, needed = self.parameters, 0, []
        for unit in units:
            total, matrix = 0, False
            while total < unit:
                total += flags[index][0]
                matrix = matrix or flags[index][1]
                index += 1
            if matrix:
                needed.append(zero.shard_numel(unit, self.n))
        again = [events[i]["bytes"] // zero.FP32_ITEMSIZE for i in between_marks(events, "backward", "step")
                 if events[i]["op"] == "all_gather"]
        for piece in again:
            if piece in needed:
                needed.remove(piece)
        expect(not needed, f"{self.where}: rank {rank} did not all-gather every weight again in backward (step "
                           f"{step}; pieces of {needed} elements missing): ZeRO-3 frees a unit's weights after its "
                           "forward and gathers them again for its backward")

    def memory(self, rank, step, peaks) -> None:
        for phase in ("forward", "backward"):
            alive = peaks.get(phase, 0)
            expect(alive <= GATHERED_UNITS_LIMIT,
                   f"{self.where}: in {phase} of step {step} rank {rank} had the gathered weights of {alive} units "
                   f"alive at once (counted after every operation, an all-gather's buffer from its issue). Prefetch "
                   "one unit ahead: the unit computing and the next one, two at most. Gathering further ahead, or "
                   "everything at once, spends the memory ZeRO-3 exists to save")

    def prefetched(self, rank, step, events, phase, stop) -> None:
        """Each all-gather after the phase's first: a product between its issue and its wait;
        no product on a unit's weights before its wait."""
        span = between_marks(events, phase, stop)
        gathers = [i for i in span if events[i]["op"] == "all_gather"]
        numbers = {i: n for n, i in enumerate((i for i, e in enumerate(events) if e["op"] == "all_gather"), 1)}
        for position, index in enumerate(gathers):
            waited = wait_of(events, index)
            expect(waited is not None, f"{self.where}: in {phase} of step {step} rank {rank} never waited on the "
                                       f"handle of all-gather {position + 1}: wait on it before using its weights")
            early = [i for i in range(index + 1, waited) if events[i]["op"] == "compute"
                     and numbers[index] in events[i].get("gathers", [])]
            expect(not early, f"{self.where}: in {phase} of step {step} rank {rank} computed with the weights of "
                              f"all-gather {position + 1} before waiting on its handle: the buffer may not have "
                              "arrived. Wait just before the unit's compute")
            if position and not products_between(events, index, waited):
                raise CheckFailed(
                    f"{self.where}: in {phase} of step {step} rank {rank} waited on all-gather {position + 1} with no "
                    "matrix product between its issue and its wait, so it ran while the rank sat idle: nothing "
                    "overlapped. Issue unit i+1's all-gather (async_op=True) before unit i's compute, and wait on it "
                    f"only when unit i+1 needs it{' (in backward: unit i-1, before unit i backward)' if phase == 'backward' else ''}")

    def results(self) -> None:
        parameter_sizes = [size for size, _ in self.parameters]
        for step in range(PREFETCH_STEPS):
            for rank, outcome in enumerate(self.per_rank):
                wanted, loss = self.reference["losses"][step][rank], outcome["losses"][step]
                expect(abs(loss - wanted) <= 1e-4 * (1 + abs(wanted)),
                       f"{self.where}: rank {rank}'s loss in step {step + 1} is {loss:.6g}; unsharded training gives "
                       f"{wanted:.6g}")
            pieces_by_rank = [o["pieces"][step] for o in self.per_rank]
            units = zero.units_from_pieces([np.size(p) for p in pieces_by_rank[0]], parameter_sizes, self.n, ordered=True)
            expect(units is not None, f"{self.where}: the module's parameters are not pieces of ceil(u/n) elements "
                                      "of the model's parameters in the model's order")
            full = np.concatenate(zero.unshard(pieces_by_rank, units))
            reference = np.concatenate([np.ravel(v) for v in self.reference["states"][step].values()])
            expect_close(full, reference, f"{self.where}: the weights after step {step + 1}, put together from every "
                                          "rank's pieces", rtol=1e-4, atol=1e-5)


@exercise("overlap.zero3_prefetch", points=4)
@refuses_library("dtp.overlap.runs", "dtp.zero.runs", "dtp.zero.sharded")
class Zero3Prefetch(WorldsCheck):
    """Verifies: on 2 and 3 gloo ranks, two Adam steps of a 4-layer MLP through the learner's
    module equal unsharded training (pieces put back together in the grader); in forward and in
    backward every all-gather after the first has a matrix product between its issue and its
    wait (it ran under compute), no product uses a gather's weights before its wait, every
    weight is gathered again in backward, and at most two units' gathered weights are alive
    after any operation (buffers counted from their issue, copies followed).
    Fakes: torch's fully_shard/FSDP trip; a blocking all-gather (wait right after issue) shows
    in the order; prefetching everything shows in the units alive; keeping the gathered weights
    for backward shows in the missing backward gathers and the units alive."""

    reads = ("PrefetchZeRO3Module",)
    references = FSDP_REFERENCES
    timeout_s = 90
    summary = ("two Adam steps equal unsharded training on 2 and 3 ranks; every all-gather after the first ran under "
               "a matrix product, in forward and in backward, waited on only when needed; at most two units gathered "
               "at once")

    def prepare(self, rng):
        worlds = []
        for n in (2, 3):
            sizes = (8, *[int(rng.integers(9, 25)) for _ in range(3)], 4)
            worlds.append((n, sizes, int(rng.integers(1 << 20)), int(rng.integers(1 << 20))))
        return worlds

    def collect(self, student, worlds):
        make = student.PrefetchZeRO3Module
        return run_worlds(zero3_prefetch_rank, [(n, (make, sizes, seed, batch_seed))
                                                 for n, sizes, seed, batch_seed in worlds])

    def judge_world(self, world, per_rank) -> None:
        PrefetchJudge(*world, per_rank).judge()
