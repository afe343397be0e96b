"""Exercise 3: the closed forms of the bubble and of the activations held, against event-simulated
steps of the course's schedules."""
from __future__ import annotations

from dtp import pipeline

from ...compare import expect_answer
from ...registry import Check, exercise
from ..common import describe_call
from .schedules import event_simulation


# --- 3. closed forms --------------------------------------------------------------------------

def _simulated(name: str, p: int, m: int, v: int, rng) -> dict:
    """The oracle for a closed form: the event simulation of the course's schedule, op times random."""
    times = {"F": float(rng.uniform(0.5, 2.0)), "B": float(rng.uniform(0.5, 2.0)), "W": 0.0}
    return event_simulation(pipeline.make_schedule(name, p, m, v), times)


@exercise("pp.closed_forms", points=2)
class ClosedForms(Check):
    """Verifies: bubble_fraction(p, m, v) and bubble_over_ideal(p, m, v) equal the idle share of
    total time and the idle-to-busy ratio of event-simulated GPipe, 1F1B and interleaved 1F1B
    steps with random op times (v = 1, and v = 2 or 3 with m a multiple of p);
    peak_in_flight(schedule, p, m, stage) equals the simulated peak of GPipe and 1F1B on every
    stage, m below and above p. Fakes: dtp.pipeline's closed forms trip; inputs are random.
    """

    reads = ("bubble_fraction", "bubble_over_ideal", "peak_in_flight")
    references = ("dtp.pipeline.bubble_fraction", "dtp.pipeline.bubble_over_ideal", "dtp.pipeline.peak_in_flight")
    timeout_s = 15

    def prepare(self, rng):
        bubbles = []
        for _ in range(6):
            p = int(rng.integers(2, 9))
            v = int(rng.choice([1, 1, 2, 3]))
            m = p * int(rng.integers(1, 4)) if v > 1 else int(rng.integers(1, 17))
            name = "interleaved 1F1B" if v > 1 else str(rng.choice(["GPipe", "1F1B"]))
            timeline = _simulated(name, p, m, v, rng)
            bubbles.append(((p, m, v), name, timeline["bubble_fraction"], timeline["bubble_over_ideal"]))
        peaks = []
        for name, fewer in (("GPipe", bool(rng.integers(2))), ("1F1B", True), ("1F1B", False)):
            p = int(rng.integers(3, 9))
            m = int(rng.integers(1, p)) if fewer else int(rng.integers(p, 3 * p))  # m below p, then at or above
            timeline = _simulated(name, p, m, 1, rng)
            for stage in sorted({0, int(rng.integers(1, p)), p - 1}):
                peaks.append(((name, p, m, stage), timeline["peak_in_flight"][stage]))
        return {"bubbles": bubbles, "peaks": peaks}

    def collect(self, student, inputs):
        bubbles = [(student.bubble_fraction(*args) if args[2] > 1 else student.bubble_fraction(args[0], args[1]),
                    student.bubble_over_ideal(*args) if args[2] > 1 else student.bubble_over_ideal(args[0], args[1]))
                   for args, _, _, _ in inputs["bubbles"]]
        peaks = [student.peak_in_flight(*args) for args, _ in inputs["peaks"]]
        return {"bubbles": bubbles, "peaks": peaks}

    def judge(self, inputs, data) -> str:
        for ((p, m, v), name, fraction, ratio), (mine_fraction, mine_ratio) in zip(inputs["bubbles"], data["bubbles"]):
            args = (p, m, v) if v > 1 else (p, m)
            where = f" (simulated {name})"
            expect_answer(mine_fraction, fraction, describe_call("bubble_fraction", args, {}) + where, rel=1e-9, slips={
                "that is (p-1)/(v·m), the bubble relative to the ideal time (Megatron-LM's ratio); bubble_fraction is "
                "the share of the whole step: idle / (idle + busy) = (p-1)/(v·m + p-1)": (p - 1) / (v * m),
                "that ignores the v chunks: interleaving makes each bubble step v times shorter": (p - 1) / (m + p - 1),
                "that is the source notes' slip: the step lasts m + p - 1 slots, not m + p - 2": (p - 1) / (v * m + p - 2)})
            expect_answer(mine_ratio, ratio, describe_call("bubble_over_ideal", args, {}) + where, rel=1e-9, slips={
                "that is the share of the whole step; bubble_over_ideal divides the idle time by the busy (ideal) "
                "time, v·m slots: (p-1)/(v·m)": (p - 1) / (v * m + p - 1),
                "that ignores the v chunks: interleaving makes each bubble step v times shorter": (p - 1) / m})
        for ((name, p, m, stage), peak), mine in zip(inputs["peaks"], data["peaks"]):
            slips = {}
            if name == "1F1B":
                slips = {"that is GPipe's peak: 1F1B starts backwards early, so stage s holds min(p - s, m)": m,
                         "that holds for the first stage; stage s holds min(p - s, m)": min(p, m),
                         "stage s holds at most p - s, but never more than the m micro-batches there are": p - stage}
            expect_answer(mine, peak, describe_call("peak_in_flight", (name, p, m, stage), {}), rel=0, slips=slips)
        return ("bubble fraction (of the whole step) and bubble over ideal time match simulated GPipe, 1F1B and "
                "interleaved steps; peak activations match GPipe (m) and 1F1B on every stage")
