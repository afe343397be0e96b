"""Exercises 2 and 3 of the ZeRO chapter: ZeRO-1 and ZeRO-2 trained on gloo (ZeRO-3, exercise 4, is in
`zero3`).

Oracles, computed in the grader: single-process Adam on the full batch (which plain data-parallel
Adam equals), and the layout a run used, recovered from the pieces it all-gathered
(`dtp.zero.formulas.units_from_pieces`). Mechanisms, from what the learner's code did on each rank: the
collectives recorded on the process group, the bytes of the tensors it kept
(`dtp.zero.measure.held_bytes`), and the full weights and gradients alive after every operation,
per unit (`dtp.zero.measure.FullTensorTracker`), all recorded by `dtp.zero.runs.train_zero_rank`.
"""
from __future__ import annotations

import numpy as np

from dtp.common.models import tiny_mlp
from dtp.zero import formulas as zero
from dtp.zero import runs as zero_runs

from ...compare import CheckFailed, expect, expect_close
from ...registry import exercise
from ..common import WorldsCheck, run_worlds
from .judging import ITEM, STEPS, ZeroJudge, bytes_between

ZERO_OPTIMIZER = "torch.distributed.optim.ZeroRedundancyOptimizer"


def _parameter_sizes(sizes) -> list[int]:
    return [p.numel() for p in tiny_mlp(sizes).parameters()]


class StageJudge(ZeroJudge):
    """Judges one world of ZeRO-1 or ZeRO-2 (see ZeroJudge for the order)."""

    no_state = ("no torch.optim.Adam holds Adam's state on some rank: step your piece of the weights with "
                "torch.optim.Adam, so that its state is this rank's piece only")

    def __init__(self, stage: int, n: int, sizes, seed: int, batch_seed: int, per_rank: list[dict], what: str):
        self.stage, self.n, self.sizes, self.per_rank, self.what = stage, n, sizes, per_rank, what
        self.parameter_sizes = _parameter_sizes(sizes)
        self.parameter_names = [name for name, _ in tiny_mlp(sizes).named_parameters()]
        self.psi = sum(self.parameter_sizes)
        self.reference = zero_runs.single_process_adam(sizes, seed, zero_runs.batches(sizes, batch_seed, n), n)
        self.units: list[int] = []

    @property
    def name(self) -> str:
        return f"{self.what} (world {self.n})"

    # --- how it was sharded ---
    def layout(self, rank: int, outcome: dict) -> None:
        n = self.n
        for step, events in enumerate(outcome["events"], 1):
            scatters = [e["bytes"] // zero.FP32_ITEMSIZE for e in events if e["op"] == "reduce_scatter"]
            expect(all(size % n == 0 for size in scatters),
                   f"{self.name}: rank {rank} reduce-scattered {scatters} elements in step {step}: pad each tensor to a "
                   f"multiple of the world size ({n}) so that every rank receives an equal piece")
            pieces = [e["bytes"] // zero.FP32_ITEMSIZE for e in events if e["op"] == "all_gather"]
            units = zero.units_from_pieces(pieces, self.parameter_sizes, n)
            if units is None:
                raise CheckFailed(
                    f"{self.name}: in step {step} rank {rank} all-gathered pieces of {sorted(pieces)} elements"
                    f" for parameters of {self.parameter_sizes} elements; "
                    f"each parameter must be gathered once, in pieces of ceil(u/{n}) elements of a tensor of u "
                    "elements (one tensor per parameter, per layer, or one flat buffer of all of them)")
            self.units = units
            expect(sorted(size // n for size in scatters) == sorted(zero.shard_numel(u, n) for u in units),
                   f"{self.name}: in step {step} rank {rank} reduce-scattered {scatters} elements; each unit it "
                   f"all-gathered ({units} elements) should be reduce-scattered once, padded to a multiple of {n}")
            if self.stage >= 2:
                self.scattered_during_backward(rank, step, events)

    def scattered_during_backward(self, rank: int, step: int, events) -> None:
        late = bytes_between(events, "step", "end", "reduce_scatter")
        expect(not late, f"{self.name}: rank {rank} reduce-scattered gradients after backward (in step {step}): "
                         f"ZeRO-{self.stage} reduce-scatters each gradient during backward, as soon as it is produced "
                         "(a post-accumulate-grad hook), so that the full gradients never exist together")

    def shard_elements(self) -> int:
        return sum(zero.shard_numel(u, self.n) for u in self.units)

    # --- the numbers ---
    def trajectory(self) -> None:
        for rank, outcome in enumerate(self.per_rank):
            for step in range(STEPS):
                self.loss(rank, step, outcome)
                self.compare_state(rank, step, outcome)

    def compare_state(self, rank: int, step: int, outcome: dict) -> None:
        reference = self.reference["states"][step]
        mine = outcome["states"][step]
        what = f"{self.name}: rank {rank}'s weights after step {step + 1}"
        expect(isinstance(mine, dict) and set(mine) == set(reference), f"{what}: the model's parameters changed names")
        for name, value in reference.items():
            try:
                expect_close(mine[name], value, f"{what}, `{name}`", rtol=1e-4, atol=1e-5)
            except CheckFailed as failed:
                unchanged = step > 0 and np.array_equal(mine[name], outcome["states"][step - 1][name])
                hint = " It did not change in this step: did the updated pieces reach every rank (all-gather)?" \
                    if unchanged else ""
                raise CheckFailed(str(failed) + hint) from None

    # --- what else was held ---
    def memory(self, rank: int, outcome: dict) -> None:
        n, psi, item = self.n, self.psi, ITEM
        shard = self.shard_elements()
        padded = n * shard
        for step in range(1, STEPS):
            held = outcome["held"][step]
            where = f"{self.name}: rank {rank} after backward in step {step + 1}"
            if self.stage == 2:
                self.gradients_freed(rank, step, outcome)
            expect(held["weights"] in (item * (psi + shard), item * padded),
                   f"{where} holds {held['weights']} bytes of weights; the model's {item * psi} and your pieces' "
                   f"{item * shard} make {item * (psi + shard)} (or {item * padded} if the model's weights live in "
                   "padded buffers that your pieces are views of)")
            if self.stage >= 2:
                expect(held["gradients"] == item * shard,
                       f"{where} holds {held['gradients']} bytes of gradients; ZeRO-{self.stage} keeps the averaged "
                       f"gradient of its pieces only, {item * shard} bytes (set it as the pieces' .grad)")
            else:
                expect(held["gradients"] in (item * psi, item * padded),
                       f"{where} holds {held['gradients']} bytes of gradients; ZeRO-1 keeps the full gradients that "
                       f"backward produced, {item * psi} bytes, and makes the averaged pieces only in step()")
            self.nothing_else(where, held, "free buffers once a collective is done")

    def gradients_freed(self, rank: int, step: int, outcome: dict) -> None:
        left = outcome["full grads after backward"][step]
        expect(left == 0, f"{self.name}: after backward in step {step + 1} rank {rank} still holds {left} bytes of "
                          "full gradients: ZeRO-2 keeps only the averaged piece; once a gradient is reduce-scattered, "
                          "drop it (parameter.grad = None) and keep no other reference to it")
        peak = outcome["grad peak"][step]
        expect(peak < ITEM * self.psi,
               f"{self.name}: during backward in step {step + 1} rank {rank} held all {peak} bytes of full gradients "
               "at once: reduce-scatter each gradient as backward produces it (a post-accumulate-grad hook) and "
               "free it there")
        stale = outcome["stale gradients"][step]
        if stale is not None:
            names = [self.parameter_names[i] for i in stale["parameters"]]
            raise CheckFailed(
                f"{self.name}: during {stale['phase']} in step {step + 1} rank {rank} still held the full "
                f"gradient{'s' if len(names) > 1 else ''} of {', '.join(names)} ({stale['bytes']} bytes) after they "
                "had been reduce-scattered and the next gradient had been reduce-scattered too: ZeRO-2 frees each "
                "full gradient as soon as its piece is averaged (parameter.grad = None in the hook, and no other "
                "reference to it, in a list or on the wrapper), so that one unit's full gradient at most is alive")

def _needs_padding(sizes, n: int) -> bool:
    """Whether a run of tiny_mlp(sizes) on n ranks pads some parameter and some layer: only then
    does an implementation that forgets the padding fail (with hidden sizes of 16, 20 or 24 every
    parameter is a multiple of 4)."""
    parameters = _parameter_sizes(sizes)
    layers = [w + b for w, b in zip(parameters[::2], parameters[1::2])]
    return any(u % n for u in parameters) and any(u % n for u in layers)


def _stage_inputs(rng, world_sizes, layers: int) -> list[tuple]:
    worlds = []
    for n in world_sizes:
        sizes = None
        while sizes is None or not _needs_padding(sizes, n):
            sizes = (8, *[int(rng.integers(16, 25)) for _ in range(layers - 1)], 4)
        worlds.append((n, sizes, int(rng.integers(1 << 20)), int(rng.integers(1 << 20))))
    return worlds


class ZeroStageCheck(WorldsCheck):
    """One ZeRO stage trained on gloo worlds of the given sizes and judged world by world."""

    stage = 0
    name = ""
    layers = 3
    world_sizes: tuple[int, ...] = ()
    timeout_s = 60

    def prepare(self, rng):
        return _stage_inputs(rng, self.world_sizes, self.layers)

    def collect(self, student, worlds):
        make = getattr(student, self.reads[0])
        return run_worlds(zero_runs.train_zero_rank, [(n, (self.stage, make, sizes, seed, batch_seed))
                                                         for n, sizes, seed, batch_seed in worlds])

    def judge_world(self, world, per_rank) -> None:
        StageJudge(self.stage, *world, per_rank, self.name).judge()


@exercise("zero.zero1", points=3)
class ZeRO1(ZeroStageCheck):
    """Verifies: on 2 and 4 gloo ranks, 3 Adam steps equal plain data-parallel Adam (weights and
    losses); per step only a reduce-scatter and an all-gather per unit (parameters, or flat
    buffers of them), padded to a multiple of n; the Adam that steps the rank's piece holds
    state for it alone (8 bytes per element of the piece), and the gradients averaged (not
    summed, not divided twice: read from Adam's first momentum); nothing else kept.
    Fakes: torch's ZeroRedundancyOptimizer trips; full Adam on every rank (its state bytes);
    all-reduce then local update (recorded on the process group)."""

    reads = ("ZeRO1Adam",)
    references = (ZERO_OPTIMIZER,)
    stage, name, world_sizes = 1, "ZeRO1Adam", (2, 4)
    summary = ("3 Adam steps equal plain data-parallel Adam on 2 and 4 ranks; gradients reduce-scattered and "
               "averaged, Adam state only for this rank's piece, weights all-gathered: 2(n-1)/n·Ψ sent per step")


@exercise("zero.zero2", points=3)
class ZeRO2(ZeroStageCheck):
    """Verifies: as zero.zero1 (2 and 3 ranks), and the gradients: each is reduce-scattered
    during backward and dropped there, so no full gradient is alive after backward (anywhere in
    the process: the storages that were a .grad, and every copy made of them, are followed),
    never all of them at once during backward, a unit's full gradient is gone once the next
    unit is reduce-scattered (per parameter, from the order of the rank's operations, once gloo
    has let go of its buffers), and the rank keeps only the averaged gradient of its pieces.
    Fakes: keeping full gradients (or references to them) until the end of backward or for
    good, or reduce-scattering after backward, show in the followed storages and the recorded
    order."""

    reads = ("ZeRO2Adam",)
    references = (ZERO_OPTIMIZER,)
    stage, name, world_sizes = 2, "ZeRO2Adam", (2, 3)
    summary = ("3 Adam steps equal plain data-parallel Adam on 2 and 3 ranks; each gradient reduce-scattered during "
               "backward and freed before the next one's reduce-scatter, only the averaged pieces kept; 2(n-1)/n·Ψ "
               "sent per step")
