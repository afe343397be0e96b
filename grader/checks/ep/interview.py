"""Exercise 6: the chapter's numeric questions."""
from __future__ import annotations

from dtp import moe

from ...compare import expect_answer
from ...registry import exercise
from ..common import FixedAnswers

INTERVIEW_ANSWERS = ("interview_capacity", "interview_total_parameters_b", "interview_active_parameters_b",
                     "interview_gpus_if_ep_multiplies", "interview_expert_copies")


@exercise("ep.interview", points=2)
class Interview(FixedAnswers):
    """Verifies: five fixed answers (a capacity, Mixtral 8x7B's total and active parameters from
    dtp.moe's counts, which tests check against a torch model's numel, and the source notes'
    layout). Fakes: a fixed question, so a copied number passes; it is worth two points for that."""

    reads = INTERVIEW_ANSWERS

    def judge(self, inputs, answers) -> str:
        capacity, total, active, gpus, copies = answers
        expect_answer(capacity, moe.expert_capacity(4096, 64, 2, 1.25), "interview_capacity", slips={
            "k is missing: 4096 tokens make 2·4096 assignments": 80,
            "the capacity factor is missing: C = ceil(1.25 · T·k/E)": 128})
        counts = moe.moe_parameter_counts(moe.MIXTRAL_8X7B)
        expect_answer(total, counts["total"] / 1e9, "interview_total_parameters_b", rel=1e-3, slips={
            "that is in parameters; answer in billions": counts["total"],
            "each SwiGLU expert has three matrices, not two": (counts["total"] - 32 * 8 * 4096 * 14336) / 1e9})
        expect_answer(active, counts["active"] / 1e9, "interview_active_parameters_b", rel=1e-3, slips={
            "a token uses 2 experts per block, not 1": (counts["active"] - 32 * counts["expert"]) / 1e9,
            "that is in parameters; answer in billions": counts["active"]})
        expect_answer(gpus, 8 * 8 * 8 * 16, "interview_gpus_if_ep_multiplies", slips={
            "that is the 1024 of the notes, where EP is not a separate factor": 1024})
        expect_answer(copies, 16 // 8, "interview_expert_copies", slips={
            "that is every data-parallel rank: without EP all 16 would hold every expert; with EP = 8 each group of "
            "8 shares out the experts, so each shard lives on 16/8 GPUs": 16,
            "that is the EP group size; each expert's shard lives once per EP group": 8})
        return "all five answers are right"
