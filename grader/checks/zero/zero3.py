"""Exercise 4 of the ZeRO chapter: ZeRO-3 around a small GPT with tied embeddings, trained by AdamW.

The check draws the model (vocabulary, blocks, hidden size, heads) and the world; the learner's
`ZeRO3Module(model, units)` wraps it with each block a unit and the root for the rest. Oracle, in
the grader: single-process AdamW on the whole batch (`dtp.zero.runs.single_process_adamw_gpt`),
with the pieces of every rank put back together unit by unit. Mechanisms, from what each rank did
(`dtp.zero.runs.train_zero3_gpt_rank`): the collectives and their order against the forward,
backward and step marks; the bytes of the tensors it kept; the gathered weights alive after every
operation and how many units' all-gathers they came from (`dtp.zero.measure.FullTensorTracker`).
"""
from __future__ import annotations

import numpy as np

from dtp.zero import formulas as zero
from dtp.zero import runs as zero_runs

from ...compare import CheckFailed, expect, expect_close
from ...registry import exercise
from ..common import WorldsCheck, run_worlds
from .judging import FSDP_REFERENCES, ITEM, STEPS, ZeroJudge, bytes_between


def unit_sizes(config, seed: int = 0) -> tuple[list[list[str]], list[int]]:
    """The units' parameter names (pieces' order: blocks, then the root) and their elements."""
    model = zero_runs.small_gpt(config, seed)
    parameters = dict(model.named_parameters())
    units = zero_runs.gpt_units(model)
    return units, [sum(parameters[name].numel() for name in unit) for unit in units]


class GPTZero3Judge(ZeroJudge):
    """One world (see ZeroJudge for the order; the collectives are judged after the pieces)."""

    optimizer, betas, reference_run = "AdamW", zero_runs.ADAMW["betas"], "data-parallel AdamW"
    needs = ("ZeRO-3 needs only all-gathers (weights, before forward and again before backward) and reduce-scatters "
             "(gradients)")
    no_state = "AdamW holds no state on some rank: are the pieces the module's parameters?"
    state_advice = ": the module's parameters must be the pieces only"
    per_rank_steps = ("layout", "collectives")

    def __init__(self, n: int, config, seed: int, batch_seed: int, per_rank: list[dict]):
        self.n, self.config, self.per_rank = n, config, per_rank
        self.units, self.sizes = unit_sizes(config, seed)
        self.pieces = [zero.shard_numel(u, n) for u in self.sizes]
        self.psi = sum(self.sizes)
        self.reference = zero_runs.single_process_adamw_gpt(
            config, seed, zero_runs.gpt_batches(config, batch_seed, n), n)
        vocab, layers, hidden, heads = config
        self.name = (f"ZeRO3Module (world {n}, a GPT of {layers} blocks, hidden {hidden}, vocabulary {vocab}, "
                     "tied embeddings)")

    def shard_elements(self) -> int:
        return sum(self.pieces)

    def layout(self, rank: int, outcome: dict) -> None:
        sizes = [int(np.size(piece)) for piece in outcome["states"][0]]
        expect(sizes == self.pieces,
               f"{self.name}: rank {rank}'s module has parameters of {sizes} elements; it should have one flat piece "
               f"per unit, ceil(u/{self.n}) elements of each unit's u: {self.pieces} (the blocks in order, then the "
               "root with what the blocks leave, the tied embedding once)")

    def collectives(self, rank: int, outcome: dict) -> None:
        expected = sorted(ITEM * c for c in self.pieces)
        for step, events in enumerate(outcome["events"], 1):
            where = f"{self.name}: rank {rank} in step {step}"
            forward = sorted(bytes_between(events, "forward", "backward", "all_gather"))
            expect(forward == expected,
                   f"{where} all-gathered pieces of {forward} bytes in forward; each unit's piece ({expected} bytes) "
                   "should be all-gathered once, just before the unit runs (a forward pre-hook)")
            again = sorted(bytes_between(events, "backward", "step", "all_gather"))
            first = sorted(bytes_between(outcome["events"][0], "backward", "step", "all_gather"))
            if again != expected and step > 1 and first == expected:
                raise CheckFailed(
                    f"{where} all-gathered pieces of {again} bytes during backward, where step 1 gathered every "
                    f"unit ({expected}): the weights gathered for step 1's backward outlived it, and step {step}'s "
                    "backward used them, stale. Free a unit's backward copy once its gradient is reduce-scattered")
            if again != expected and again:
                raise CheckFailed(
                    f"{where} all-gathered pieces of {again} bytes during backward; each unit's piece ({expected} "
                    "bytes) should be all-gathered once there, when backward first needs the unit's weights")
            if again != expected:
                peak = max(o["full weights"][step - 1]["forward"] for o in self.per_rank)
                raise CheckFailed(
                    f"{where} all-gathered nothing during backward, not every unit's piece once "
                    f"({expected} bytes). Weights that autograd saved in forward stay alive until backward reaches them "
                    f"(here up to {peak} of the {ITEM * self.psi} bytes of weights at once): free each unit's weights "
                    "after its forward, leave autograd a marker instead (saved_tensors_hooks), and gather the unit "
                    "again when backward first needs it")
            scattered = sorted(bytes_between(events, "backward", "step", "reduce_scatter"))
            late = bytes_between(events, "step", "end", "reduce_scatter")
            expect(not late, f"{where} reduce-scattered after backward: reduce-scatter each unit's gradient during "
                             "backward, as soon as it is complete (in the backward of the gather)")
            expect(scattered == sorted(ITEM * self.n * c for c in self.pieces),
                   f"{where} reduce-scattered {scattered} bytes in backward; each unit's full gradient, padded to "
                   f"{self.n}·ceil(u/{self.n}) elements, should be reduce-scattered once "
                   f"({sorted(ITEM * self.n * c for c in self.pieces)} bytes)")

    def trajectory(self) -> None:
        for step in range(STEPS):
            for rank, outcome in enumerate(self.per_rank):
                self.loss(rank, step, outcome)
            full = zero.unshard([o["states"][step] for o in self.per_rank], self.sizes)
            for unit, names, got in zip(range(len(self.units)), self.units, full):
                wanted = np.concatenate([np.ravel(self.reference["states"][step][name]) for name in names])
                label = f"block {unit}" if unit < len(self.units) - 1 else "the root (embeddings, final norm)"
                expect_close(got, wanted, f"{self.name}: the weights of {label} after step {step + 1}, put together "
                                          "from every rank's pieces", rtol=1e-4, atol=1e-5)

    def memory(self, rank: int, outcome: dict) -> None:
        shard, total = sum(self.pieces), ITEM * self.psi
        for step in range(1, STEPS):
            held, record, units = outcome["held"][step], outcome["full weights"][step], outcome["gathered units"][step]
            where = f"{self.name}: rank {rank}"
            for phase in ("forward", "backward"):
                expect(record[phase] < total,
                       f"{where} held all {record[phase]} bytes of gathered weights at once during {phase} in step "
                       f"{step + 1}: gather each unit just before it runs and free it right after")
                expect(units[phase] <= zero_runs.GATHERED_UNITS_LIMIT,
                       f"{where} held the gathered weights of {units[phase]} units at once during {phase} in step "
                       f"{step + 1} (up to {record[phase]} of the {total} bytes of weights): ZeRO-3 keeps a unit "
                       f"gathered only while it runs (the root's around the blocks), at most "
                       f"{zero_runs.GATHERED_UNITS_LIMIT} units at any time. Free a unit's weights after its forward, "
                       "and its backward copy once its gradient is reduce-scattered")
            for moment in ("after backward", "after step"):
                expect(record[moment] == 0, f"{where} {moment} in step {step + 1} still holds {record[moment]} bytes "
                                            "of gathered weights: free them once the unit's forward or backward is done")
            what = f"{where} after backward in step {step + 1}"
            expect(held["weights"] == ITEM * shard,
                   f"{what} holds {held['weights']} bytes of parameters; ZeRO-3 keeps only this rank's pieces, "
                   f"{ITEM * shard} bytes: register only the pieces as the module's parameters")
            expect(held["gradients"] == ITEM * shard,
                   f"{what} holds {held['gradients']} bytes of gradients; the pieces' averaged gradients are "
                   f"{ITEM * shard} bytes")
            self.nothing_else(what, held, "the model's own parameters must go once the pieces are made, and "
                                          "gathered weights once used")


def _needs_padding(config, n: int) -> bool:
    return all(size % n for size in unit_sizes(config)[1])


@exercise("zero.zero3", points=4)
class ZeRO3(WorldsCheck):
    """Verifies: on 3 and 4 ranks, a GPT drawn by the check (3 blocks, hidden 8 to 16, a
    vocabulary of 17 to 40, tied embeddings) wrapped by the learner's module with each block a unit
    and the root for the rest, trained by AdamW (weight decay 0.1) over its parameters, equals
    data-parallel AdamW (losses, and the pieces put back together in the grader); the parameters are
    one padded piece per unit; every unit is all-gathered once in forward and once again in
    backward, and reduce-scattered once in backward; gathered weights, followed through every copy
    by a dispatch mode, come from at most two units' all-gathers at any moment (counted after every
    operation, once gloo has let go of its buffers; never judged by time), never amount to all
    weights, and are gone after backward and after the step; AdamW's state and the gradients cover
    the pieces only, and the gradients are averaged (from AdamW's first momentum).
    Fakes: torch's fully_shard/FSDP and the course's dtp.zero.sharded.ZeRO3 trip; letting autograd keep
    the gathered weights (the missing backward all-gathers, the units counted alive); keeping the
    model's parameters (bytes); a hard-coded model (the model and its sizes are drawn)."""

    reads = ("ZeRO3Module",)
    references = FSDP_REFERENCES + ("dtp.zero.sharded.ZeRO3",)
    world_sizes = (3, 4)
    timeout_s = 90
    summary = ("3 AdamW steps of a GPT with tied embeddings equal data-parallel AdamW on 3 and 4 ranks; only pieces "
               "held, each unit (block, root) gathered just before forward and again in backward, at most two units "
               "gathered at once; 3(n-1)/n·Ψ sent per step")

    def prepare(self, rng):
        worlds = []
        for n in self.world_sizes:
            config = None
            while config is None or not _needs_padding(config, n):
                heads = 2
                # Three blocks: holding all units but one is then three units at once, which the
                # limit of two must catch (with two blocks it would be within it).
                config = (int(rng.integers(17, 41)), 3, heads * int(rng.integers(4, 9)), heads)
            worlds.append((n, config, int(rng.integers(1 << 20)), int(rng.integers(1 << 20))))
        return worlds

    def collect(self, student, worlds):
        make = student.ZeRO3Module
        return run_worlds(zero_runs.train_zero3_gpt_rank, [(n, (make, config, seed, batch_seed))
                                                            for n, config, seed, batch_seed in worlds])

    def judge_world(self, world, per_rank) -> None:
        GPTZero3Judge(*world, per_rank).judge()
