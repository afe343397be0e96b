"""The interview questions."""
from __future__ import annotations

from dtp import pipeline

from ...compare import expect_answer
from ..common import FixedAnswers
from ...registry import exercise


# --- 6. interview questions -------------------------------------------------------------------

INTERVIEW = dict(p=8, m=64, micro_batch=1, sequence=4096, hidden=8192, bytes_per_value=2)


@exercise("pp.interview", points=2)
class Interview(FixedAnswers):
    """Verifies: four answers about a pipeline of p = 8 stages and m = 64 micro-batches: the bubble
    as a share of the step, the micro-batches stage 0 holds under 1F1B, the messages and the GiB
    that cross one stage boundary per step. Fakes: fixed questions, so a copied number passes;
    worth two points for that reason."""

    reads = ("interview_bubble_fraction", "interview_peak_micro_batches", "interview_boundary_messages",
             "interview_boundary_gib")

    def judge(self, inputs, answers) -> str:
        q = INTERVIEW
        p, m = q["p"], q["m"]
        activation = q["micro_batch"] * q["sequence"] * q["hidden"] * q["bytes_per_value"]
        expect_answer(answers[0], pipeline.bubble_fraction(p, m), "interview_bubble_fraction", rel=1e-6, slips={
            "that is 7/70, the source notes' slip: the step lasts m + p - 1 = 71 slots": (p - 1) / (m + p - 2),
            "that is (p-1)/m, relative to the ideal time; the question asks for the share of the whole step":
                (p - 1) / m})
        expect_answer(answers[1], pipeline.peak_in_flight("1F1B", p, m, 0), "interview_peak_micro_batches", rel=1e-9,
                      slips={"that is GPipe's m; under 1F1B more micro-batches do not mean more activations": m})
        expect_answer(answers[2], 2 * m, "interview_boundary_messages", rel=1e-9, slips={
            "a pipeline does not send once per step: every micro-batch crosses every boundary": 1,
            "that counts one direction; each micro-batch's gradient comes back across the boundary too": m,
            "that counts every boundary; the question asks about one": pipeline.boundary_messages_per_step(p, m)})
        gib = pipeline.boundary_bytes_per_step(m, q["micro_batch"], q["sequence"], q["hidden"], q["bytes_per_value"]) / 2**30
        expect_answer(answers[3], gib, "interview_boundary_gib", rel=1e-6, slips={
            "that is one activation, as if the pipeline sent once per step": activation / 2**30,
            "that counts one direction; the gradients come back too": gib / 2,
            "that is in GB (10^9 bytes); the question asks for GiB (2^30)": gib * 2**30 / 1e9})
        return "all four interview answers are right"
