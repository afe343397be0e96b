"""Exercise 5 of the ZeRO chapter: the exact bytes a rank holds and sends per step, padding
included, against `dtp.zero.formulas.held_bytes_per_rank` and `dtp.zero.formulas.sent_bytes_per_rank` (which
tests/zero/test_zero_formulas.py checks against measured gloo runs)."""
from __future__ import annotations

import numpy as np

from dtp.zero import formulas as zero

from ...compare import expect, expect_answer
from ...registry import Check, exercise
from ..common import describe_call


@exercise("zero.bytes_per_step", points=2)
class BytesPerStep(Check):
    """Verifies: bytes a rank holds (weights, gradients, Adam state) and sends per step (ring
    collectives) for the course's fp32 runs, with each unit padded to n·ceil(u/n), on random
    units and world sizes (sizes not divisible by n, one flat unit, many units), stages 0 to 3.
    Fakes: dtp.zero.formulas's functions trip; inputs are drawn at random."""

    reads = ("zero_bytes_held", "zero_bytes_sent")
    references = ("dtp.zero.formulas.held_bytes_per_rank", "dtp.zero.formulas.sent_bytes_per_rank")
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for draw in range(4):
            n = int(rng.integers(2, 9))
            if draw == 0:  # one flat buffer, not divisible by n
                units = [n * int(rng.integers(10, 5000)) + int(rng.integers(1, n))]
            else:  # several units, two of them one element past a multiple of n: padding each differs from padding all
                units = [n * int(rng.integers(1, 1000)) + 1 for _ in range(2)]
                units += [int(rng.integers(1, 5000)) for _ in range(int(rng.integers(0, 5)))]
                rng.shuffle(units)
            cases += [(units, n, stage) for stage in zero.STAGES]
        return cases

    def collect(self, student, cases):
        return {"held": [student.zero_bytes_held(list(units), n, stage) for units, n, stage in cases],
                "sent": [student.zero_bytes_sent(list(units), n, stage) for units, n, stage in cases]}

    def judge(self, cases, answers) -> str:
        for (units, n, stage), held, sent in zip(cases, answers["held"], answers["sent"]):
            call = describe_call("zero_bytes_held", (units, n, stage), {})
            expect(isinstance(held, dict) and set(held) == set(zero.COMPONENTS),
                   f"{call} should return a dict with the keys {list(zero.COMPONENTS)}")
            right = zero.held_bytes_per_rank(units, n, stage)
            slip = _held_slip(held, units, n, stage)
            for component in zero.COMPONENTS:
                expect_answer(held[component], right[component], f"{call}[{component!r}]", rel=1e-9,
                              slips={slip[0]: slip[1][component]} if slip else None)
            call = describe_call("zero_bytes_sent", (units, n, stage), {})
            pieces = sum(zero.shard_numel(u, n) for u in units) * zero.FP32_ITEMSIZE
            slips = {"that leaves out the padding: every collective moves pieces of ceil(u/n) elements":
                     (3 if stage == 3 else 2) * (n - 1) / n * sum(units) * zero.FP32_ITEMSIZE}
            if stage == 3:
                slips["ZeRO-3 gathers the weights twice per step, for forward and again for backward: 3, not 2, "
                      "collectives per unit"] = 2 * (n - 1) * pieces
            if stage >= 1:
                slips["that counts what gloo moves (its reduce-scatter is an all-reduce); count a ring's bytes"] = \
                    (4 if stage == 3 else 3) * (n - 1) * pieces
                slips["that counts the whole units, not the (n-1)·ceil(u/n) a ring sends per rank"] = \
                    (3 if stage == 3 else 2) * n * pieces
            expect_answer(sent, zero.sent_bytes_per_rank(units, n, stage), call, rel=1e-9, slips=slips)
        return ("bytes held and sent per step match the padded formulas for stages 0 to 3 on random units and world "
                "sizes")


def _held_slip(held: dict, units: list[int], n: int, stage: int) -> tuple[str, dict] | None:
    """The known mistake a whole answer of zero_bytes_held matches, if any."""
    variants = {
        "that leaves out the padding: a unit of u elements is held as a piece of ceil(u/n) elements, each unit "
        "padded on its own": zero.held_bytes_per_rank(units, n, stage, padded=False),
        "that pads all units together, as one flat buffer; here each unit is padded on its own":
            zero.held_bytes_per_rank(units, n, stage, units=[sum(units)]),
    }
    if stage in (1, 2):
        right = zero.held_bytes_per_rank(units, n, stage)
        variants["in stages 1 and 2 the optimizer steps a copy of this rank's piece of the weights: count it"] = \
            {**right, "weights": zero.FP32_ITEMSIZE * sum(units)}
    for feedback, values in variants.items():
        try:
            if all(np.isclose(float(held[k]), values[k], rtol=1e-9, atol=0) for k in zero.COMPONENTS):
                return feedback, values
        except (TypeError, ValueError):
            return None
    return None
