"""The pipeline chapter's interview questions: answers as functions of the question's numbers."""
from __future__ import annotations

from ...registry import exercise
from ..common import InterviewQuestions

# The question as the notebook states it: p = 8 stages, m = 64 micro-batches of one sequence of
# 4096 tokens, hidden size 8192, fp16 activations and gradients.
P, M, MICRO_BATCH, SEQUENCE, HIDDEN, BYTES = 8, 64, 1, 4096, 8192, 2


@exercise("pp.interview", points=2)
class Interview(InterviewQuestions):
    """Verifies: four interview answers as functions of the question's numbers, on the question
    asked (p = 8, m = 64, one sequence of 4096 tokens, hidden 8192, fp16) and on random ones: the
    bubble as a share of a 1F1B step, the micro-batches stage 0 holds at most, the messages and
    the GiB that cross one stage boundary per step (both directions).
    Fakes: a number copied from the page answers only the question asked, not the random ones;
    dtp.pp.schedules's closed forms trip.
    """

    reads = ("interview_bubble_fraction", "interview_peak_micro_batches", "interview_boundary_messages",
             "interview_boundary_gib")
    references = ("dtp.pp.schedules.bubble_fraction", "dtp.pp.schedules.bubble_over_ideal", "dtp.pp.schedules.peak_in_flight",
                  "dtp.pp.schedules.boundary_messages_per_step", "dtp.pp.schedules.boundary_bytes_per_step")
    asked = {"interview_bubble_fraction": (P, M), "interview_peak_micro_batches": (P, M),
             "interview_boundary_messages": (P, M),
             "interview_boundary_gib": (M, MICRO_BATCH, SEQUENCE, HIDDEN, BYTES)}
    summary = ("bubble share, micro-batches held, messages and GiB across a boundary are right for p = 8, m = 64 and "
               "for random pipelines")

    def drawn(self, name, rng):
        p, m = int(rng.integers(2, 33)), int(rng.integers(1, 257))
        if name == "interview_peak_micro_batches":
            # Fewer micro-batches than stages in every random draw (1F1B's min(p, m) is m there); the
            # asked question (m = 64 > p = 8) covers the other side, so both slips fail every grading.
            m = int(rng.integers(1, p))
        if name == "interview_boundary_gib":
            return (m, int(rng.integers(1, 9)), int(rng.choice([512, 1024, 2048, 4096, 8192])),
                    int(rng.choice([1024, 2048, 4096, 5120, 8192, 12288])), int(rng.choice([2, 4])))
        return (p, m)

    def expected(self, name, *args):
        if name == "interview_bubble_fraction":
            p, m = args
            return (p - 1) / (m + p - 1)
        if name == "interview_peak_micro_batches":
            p, m = args
            return min(p, m)
        if name == "interview_boundary_messages":
            p, m = args
            return 2 * m
        m, micro_batch, sequence, hidden, nbytes = args
        return 2 * m * micro_batch * sequence * hidden * nbytes / 2**30

    def slips(self, name, *args):
        if name == "interview_bubble_fraction":
            p, m = args
            return {f"that is (p-1)/(m+p-2), the source notes' slip: the step lasts m + p - 1 = {m + p - 1} slots":
                    (p - 1) / (m + p - 2),
                    "that is (p-1)/m, relative to the ideal time; the question asks for the share of the whole step":
                    (p - 1) / m}
        if name == "interview_peak_micro_batches":
            p, m = args
            return {"that is GPipe's m; under 1F1B stage 0 starts backwards after p - 1 warm-up forwards": m,
                    "stage 0 holds p micro-batches, but never more than the m there are": p}
        if name == "interview_boundary_messages":
            p, m = args
            return {"a pipeline does not send once per step: every micro-batch crosses every boundary": 1,
                    "that counts one direction; each micro-batch's gradient comes back across the boundary too": m,
                    "that counts every boundary; the question asks about one": 2 * m * (p - 1)}
        m, micro_batch, sequence, hidden, nbytes = args
        gib = 2 * m * micro_batch * sequence * hidden * nbytes / 2**30
        return {"that is one activation, as if the pipeline sent once per step": gib / (2 * m),
                "that counts one direction; the gradients come back too": gib / 2,
                "that is in GB (10^9 bytes); the question asks for GiB (2^30)": gib * 2**30 / 1e9}
