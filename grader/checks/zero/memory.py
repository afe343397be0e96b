"""Exercise 1 of the ZeRO chapter: model-state memory per GPU and the saving factor, stage by
stage, against the closed forms of `dtp.zero.formulas` (mixed-precision Adam, 16 bytes per parameter)."""
from __future__ import annotations

from dtp.zero import formulas as zero

from ...compare import expect_answer
from ...registry import Check, exercise
from ..common import describe_call

MIXED = "mixed_adam"


def _stage_slips(n_params: float, n_gpus: int, stage: int) -> dict[str, float]:
    """Known mistakes, and the memory per GPU each of them gives."""
    psi, n = n_params, n_gpus
    slips = {"that counts 8 bytes of optimizer state per parameter; mixed-precision Adam keeps 12: fp32 master "
             "weights, momentum and variance": zero.model_state_bytes_per_gpu(psi, n, stage, "mixed_sgd_momentum")}
    if stage == 1:
        slips["that is 16Ψ/4: the 4x of the source notes is the limit as Nd grows; at finite Nd ZeRO-1 keeps the "
              "16-bit weights and gradients whole, 2Ψ + 2Ψ + 12Ψ/Nd"] = 4 * psi
    if stage == 2:
        slips["that is 16Ψ/8: the 8x of the source notes is the limit as Nd grows; at finite Nd ZeRO-2 keeps the "
              "16-bit weights whole, 2Ψ + 14Ψ/Nd"] = 2 * psi
    if stage >= 1:
        slips["that is the previous stage's memory: stage 1 shards the optimizer states, stage 2 the gradients too, "
              "stage 3 the weights too (stage 0 is plain data parallelism)"] = \
            zero.model_state_bytes_per_gpu(psi, n, stage - 1, MIXED)
    if stage < 3:
        slips["that shards one component too many (stage 1: optimizer states; 2: + gradients; 3: + weights)"] = \
            zero.model_state_bytes_per_gpu(psi, n, stage + 1, MIXED)
    return slips


@exercise("zero.memory_per_gpu", points=2)
class MemoryPerGpu(Check):
    """Verifies: model-state bytes per GPU of mixed-precision Adam (2 + 2 + 12 bytes per
    parameter) for stages 0 to 3, and the saving factor over plain data parallelism, on random
    Ψ and Nd (Nd = 1, 8, 64 and 1024 among them).
    Fakes: dtp.zero.formulas's functions trip; inputs are drawn at random."""

    reads = ("zero_memory_per_gpu", "zero_saving_factor")
    references = ("dtp.zero.formulas.model_state_bytes_per_gpu", "dtp.zero.formulas.model_state_breakdown_per_gpu",
                  "dtp.zero.formulas.memory_saving_factor", "dtp.zero.formulas.hybrid_sharding_bytes_per_gpu")
    timeout_s = 15

    def prepare(self, rng):
        gpus = [1, 8, 64, 1024] + [int(rng.integers(2, 5000)) for _ in range(2)]
        return [(float(rng.integers(10**6, 10**12)), n, stage) for n in gpus for stage in zero.STAGES]

    def collect(self, student, cases):
        return {"memory": [student.zero_memory_per_gpu(psi, n, stage) for psi, n, stage in cases],
                "factor": [student.zero_saving_factor(n, stage) for _, n, stage in cases]}

    def judge(self, cases, answers) -> str:
        for (psi, n, stage), answer in zip(cases, answers["memory"]):
            expect_answer(answer, zero.model_state_bytes_per_gpu(psi, n, stage, MIXED),
                          describe_call("zero_memory_per_gpu", (psi, n, stage), {}), rel=1e-9,
                          slips=_stage_slips(psi, n, stage))
        for (_, n, stage), answer in zip(cases, answers["factor"]):
            right = zero.memory_saving_factor(n, stage, MIXED)
            slips = {"that is memory per GPU over 16Ψ; the saving factor is 16Ψ over memory per GPU": 1 / right}
            if stage in (1, 2):
                slips[f"that is the Nd → ∞ limit; at Nd = {n} the factor is smaller"] = zero.saving_factor_limit(stage)
            expect_answer(answer, right, describe_call("zero_saving_factor", (n, stage), {}), rel=1e-9, slips=slips)
        return ("memory per GPU for stages 0 to 3 and the saving factors match 2Ψ + 2Ψ + 12Ψ/Nd, 2Ψ + 14Ψ/Nd and "
                "16Ψ/Nd on random Ψ and Nd")
