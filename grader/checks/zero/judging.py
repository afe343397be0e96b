"""What the judges of ZeRO-1/2 (`stages`) and ZeRO-3 (`zero3`) share: one world of a run of
`dtp.zero.runs`, judged property by property, each on every rank before the next, so that the
feedback names the most basic mistake first: what was called, how it was sharded, where the
optimizer's state lives, how the gradients were averaged, the numbers, then what was held."""
from __future__ import annotations

from dtp.zero import formulas as zero
from dtp.zero import runs as zero_runs

from ...compare import CheckFailed, expect

STEPS = zero_runs.STEPS
ITEM = zero.FP32_ITEMSIZE
ALLOWED_OPS = {"all_gather", "reduce_scatter", "wait", "mark"}
FSDP_REFERENCES = ("torch.distributed.fsdp.fully_shard", "torch.distributed.fsdp.FullyShardedDataParallel")


def bytes_between(events: list, start: str, stop: str, op: str) -> list[int]:
    """The bytes of each `op` a rank issued between two marks of a step."""
    labels = [e.get("label") for e in events]
    return [e["bytes"] for e in events[labels.index(start):labels.index(stop)] if e["op"] == op]


class ZeroJudge:
    """A subclass sets `name`, `n`, `psi` (the model's elements), `per_rank`, `reference` (the
    single-process run), the class attributes below, and defines `shard_elements()` and the
    steps named in `per_rank_steps` and `memory(rank, outcome)`."""

    optimizer = "Adam"  # the optimizer as the feedback names it
    betas = zero_runs.ADAM["betas"]
    reference_run = "plain data-parallel Adam"
    needs = "ZeRO needs only reduce-scatter (gradients) and all-gather (weights)"
    no_state = ""  # what to say when no optimizer holds state
    state_advice = ""  # what to add when the optimizer's state is not the pieces'
    per_rank_steps: tuple[str, ...] = ("layout",)  # after the operations, before the optimizer state

    def judge(self) -> None:
        for rank, outcome in enumerate(self.per_rank):
            expect(len(outcome["losses"]) == STEPS, f"{self.name}: rank {rank} did not complete {STEPS} steps")
            self.operations(rank, outcome)
        for step in (*self.per_rank_steps, "optimizer_state"):
            for rank, outcome in enumerate(self.per_rank):
                getattr(self, step)(rank, outcome)
        self.averaging()
        self.trajectory()
        for rank, outcome in enumerate(self.per_rank):
            self.memory(rank, outcome)

    # --- what was called ---
    def operations(self, rank: int, outcome: dict) -> None:
        for events in outcome["events"]:
            used = {e["op"] for e in events} - ALLOWED_OPS
            if "all_reduce" in used:
                raise CheckFailed(
                    f"{self.name}: rank {rank} called all_reduce. ZeRO averages gradients with a reduce-scatter, so "
                    "that each rank receives only the average of its own piece ((n-1)/n·Ψ sent); an all-reduce sends "
                    "twice that, and the all-gather of the weights comes on top")
            expect(not used, f"{self.name}: rank {rank} called {', '.join(sorted(used))}; {self.needs}")

    # --- where the optimizer's state lives, and how the gradients were averaged ---
    def optimizer_state(self, rank: int, outcome: dict) -> None:
        shard = self.shard_elements()
        for step in range(1, STEPS):  # the optimizer's state exists from the first step on
            held = outcome["held"][step]["optimizer states"]
            where = f"{self.name}: rank {rank} after backward in step {step + 1}"
            if held >= 2 * ITEM * self.psi:
                raise CheckFailed(f"{where} holds {held} bytes of {self.optimizer} state: that covers all the "
                                  f"parameters. Each rank must update only its piece, with {self.optimizer} state for "
                                  f"it alone: 2·4·{shard} = {2 * ITEM * shard} bytes")
            expect(held == 2 * ITEM * shard, f"{where} holds {held} bytes of {self.optimizer} state; for its pieces "
                                             f"({shard} elements, padding included) {self.optimizer} keeps two fp32 "
                                             f"moments, {2 * ITEM * shard} bytes{self.state_advice}")

    def averaging(self) -> None:
        found = [o["exp_avg"] for o in self.per_rank]
        if any(value is None for value in found):
            raise CheckFailed(f"{self.name}: {self.no_state}")
        # The first momentum is (1 - beta1)·g: summed over the ranks' pieces it shows how g was scaled.
        ratio = sum(found) / ((1 - self.betas[0]) * self.reference["first gradient"])
        n, hides = self.n, (f" ({self.optimizer} hides most of this bug: its update barely changes when every "
                            "gradient is scaled)")
        if abs(ratio - n) < 0.02 * n:
            raise CheckFailed(f"{self.name}: the gradients {self.optimizer} stepped with are {ratio:.2f}x the average: "
                              f"the reduce-scatter sums; divide by the world size{hides}")
        if abs(ratio - 1 / n) < 0.02 / n:
            raise CheckFailed(f"{self.name}: the gradients {self.optimizer} stepped with are 1/{n} of the average: you "
                              f"divided by the world size twice{hides}")
        expect(abs(ratio - 1) < 1e-3, f"{self.name}: the gradients {self.optimizer} stepped with add up to "
                                      f"{ratio:.3g}x the average gradient: each rank must step with the average over "
                                      "ranks of its piece")

    # --- the numbers ---
    def loss(self, rank: int, step: int, outcome: dict) -> None:
        wanted, loss = self.reference["losses"][step][rank], outcome["losses"][step]
        expect(abs(loss - wanted) <= 1e-4 * (1 + abs(wanted)),
               f"{self.name}: rank {rank}'s loss in step {step + 1} is {loss:.6g}, {self.reference_run} gives "
               f"{wanted:.6g}")

    # --- what else was held ---
    def nothing_else(self, where: str, held: dict, advice: str) -> None:
        expect(held["other"] == 0,
               f"{where} keeps {held['other']} bytes in tensors that are neither weights, gradients nor optimizer "
               f"state ({'; '.join(held['other paths'])}): {advice}")
