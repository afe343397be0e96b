"""Exercise 3: the closed forms of the bubble and of the activations held, against event-simulated
steps of the course's schedules."""
from __future__ import annotations

from dtp.pp import schedules as pipeline

from ...compare import expect_answer
from ...registry import Check, exercise
from ..common import describe_call
from .schedules import event_simulation

# --- 3. closed forms --------------------------------------------------------------------------

def _simulated(name: str, p: int, m: int, v: int, rng) -> dict:
    """The oracle for a closed form: the event simulation of the course's schedule, op times random
    (ZB-H1's W no longer than its F and B, as the schedule assumes)."""
    times = {"F": float(rng.uniform(0.5, 2.0)), "B": float(rng.uniform(0.5, 2.0)), "W": 0.0}
    if name == "ZB-H1":
        times["W"] = float(rng.uniform(0.1, 1.0)) * min(times["F"], times["B"])
    return event_simulation(pipeline.make_schedule(name, p, m, v), times)


@exercise("pp.closed_forms", points=2)
class ClosedForms(Check):
    """Verifies: bubble_fraction(p, m, v) and bubble_over_ideal(p, m, v) equal the idle share of
    total time and the idle-to-busy ratio of event-simulated GPipe, 1F1B and interleaved 1F1B
    steps with random op times (v = 1, and v = 2 or 3 with m a multiple of p; both in every grading);
    peak_in_flight(schedule, p, m, stage[, v]) equals the simulated peak of GPipe, 1F1B, ZB-H1
    (m below and above p) and interleaved 1F1B (chunk activation sets, v = 2 or 3, m = p to 3p)
    on the first, the last and a random stage. Exact rationals (fractions.Fraction) are numbers.
    Fakes: dtp.pp.schedules's closed forms trip; inputs are random.
    """

    reads = ("bubble_fraction", "bubble_over_ideal", "peak_in_flight")
    references = ("dtp.pp.schedules.bubble_fraction", "dtp.pp.schedules.bubble_over_ideal", "dtp.pp.schedules.peak_in_flight")
    timeout_s = 15

    def prepare(self, rng):
        bubbles = []
        # one interleaved and one plain case, then four free draws: an answer without v always meets
        # a v > 1 (six free draws were all v = 1 once in 64 gradings)
        for v_choices in ([2, 3], [1], *[[1, 1, 2, 3]] * 4):
            p = int(rng.integers(2, 9))
            v = int(rng.choice(v_choices))
            m = p * int(rng.integers(1, 4)) if v > 1 else int(rng.integers(1, 17))
            name = "interleaved 1F1B" if v > 1 else str(rng.choice(["GPipe", "1F1B"]))
            timeline = _simulated(name, p, m, v, rng)
            bubbles.append(((p, m, v), name, timeline["bubble_fraction"], timeline["bubble_over_ideal"]))
        peaks = []
        for name, fewer in (("GPipe", bool(rng.integers(2))), ("1F1B", True), ("1F1B", False), ("ZB-H1", True),
                            ("ZB-H1", False), ("interleaved 1F1B", False)):
            p = int(rng.integers(3, 9))
            # m below p (at least 2, so that holding min(p - s, m) and min(p, m) differ on the last stage),
            # then at or above p; interleaved: a multiple of p
            m = int(rng.integers(2, p)) if fewer else int(rng.integers(p, 3 * p))
            v = int(rng.integers(2, 4)) if name == "interleaved 1F1B" else 1
            if v > 1:
                m = p * int(rng.integers(1, 4))
            timeline = _simulated(name, p, m, v, rng)
            for stage in sorted({0, int(rng.integers(1, p)), p - 1}):
                args = (name, p, m, stage) + ((v,) if v > 1 else ())
                peaks.append((args, timeline["peak_in_flight"][stage]))
        return {"bubbles": bubbles, "peaks": peaks}

    def collect(self, student, inputs):
        bubbles = [(student.bubble_fraction(*args) if args[2] > 1 else student.bubble_fraction(args[0], args[1]),
                    student.bubble_over_ideal(*args) if args[2] > 1 else student.bubble_over_ideal(args[0], args[1]))
                   for args, _, _, _ in inputs["bubbles"]]
        peaks = [student.peak_in_flight(*args) for args, _ in inputs["peaks"]]  # v only for the interleaved one
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
        for (args, peak), mine in zip(inputs["peaks"], data["peaks"]):
            name, p, m, stage = args[:4]
            expect_answer(mine, peak, describe_call("peak_in_flight", args, {}), rel=0,
                          slips=_peak_slips(name, p, m, stage, args[4] if len(args) > 4 else 1))
        return ("bubble fraction (of the whole step) and bubble over ideal time match simulated GPipe, 1F1B and "
                "interleaved steps; peak activations match GPipe, 1F1B, ZB-H1 and interleaved 1F1B on every stage")


def _peak_slips(name: str, p: int, m: int, stage: int, v: int) -> dict:
    """Known wrong peaks, each with what it mistakes."""
    if name == "1F1B":
        return {"that is GPipe's peak: 1F1B starts backwards early, so stage s holds min(p - s, m)": m,
                "that holds for the first stage; stage s holds min(p - s, m)": min(p, m),
                "stage s holds at most p - s, but never more than the m micro-batches there are": p - stage}
    if name == "ZB-H1":
        return {"that is 1F1B's peak; ZB-H1 also keeps up to s weight gradients pending on stage s, and a micro-batch "
                "counts as held until its W: min(p, m) on every stage": min(p - stage, m),
                "that is GPipe's peak; ZB-H1 holds no more than 1F1B's first stage, min(p, m)": m}
    if name == "interleaved 1F1B":
        warm_up = (v - 1) * p + 2 * (p - stage - 1)
        return {"that is the warm-up alone; the first steady-state forward comes before the first backward, so "
                "add one: min((v-1)·p + 2(p-s-1) + 1, v·m) chunk sets": min(warm_up, v * m),
                "that holds for stage 0; stage s runs (v-1)·p + 2(p-s-1) warm-up forwards, then holds one more":
                    min((v + 1) * p - 1, v * m),
                "that ignores the chunks: a stage holds up to (v-1)·p + 2(p-s-1) + 1 chunk activation sets":
                    min(p - stage, m),
                "that counts micro-batches, but each holds one activation set per chunk it has been through; "
                "count chunk sets": -(-min(warm_up + 1, v * m) // v)}
    return {}
