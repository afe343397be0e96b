"""Exercise 5: the bytes each rank sends in the all-to-alls, fixed capacity and dropless."""
from __future__ import annotations

import numpy as np

from dtp import moe

from ...compare import expect, expect_answer
from ...registry import Check, exercise
from .shared import skewed_choices

@exercise("ep.all_to_all_bytes", points=2)
class AllToAllBytes(Check):
    """Verifies: bytes each rank sends to other ranks per forward and backward pass, with fixed
    capacity (random n, E, C, d, bytes per element) and dropless (random routings of 2 to 4
    ranks with different token counts), against dtp.moe's closed forms, which
    tests/test_ep_checks.py checks against bytes counted on gloo.
    Fakes: dtp.moe's formulas trip; random inputs each run.
    """

    reads = ("capacity_all_to_all_bytes", "dropless_all_to_all_bytes")
    references = ("dtp.moe.capacity_all_to_all_bytes", "dtp.moe.dropless_all_to_all_bytes")
    timeout_s = 15

    def prepare(self, rng):
        capacity = []
        for n in (2, 3, 4, 8, 64):
            capacity.append((n, n * int(rng.integers(1, 5)), int(rng.integers(1, 500)), int(rng.choice([64, 4096])),
                             int(rng.choice([2, 4]))))
        dropless = []
        for n in (2, 3, 4):
            local, k = int(rng.integers(1, 4)), int(rng.integers(1, 3))
            routings = [skewed_choices(rng, int(rng.integers(1, 30)), n * local, k) for _ in range(n)]
            dropless.append((routings, n * local, int(rng.integers(8, 64)), int(rng.choice([2, 4]))))
        return {"capacity": capacity, "dropless": dropless}

    def collect(self, student, cases):
        return {"capacity": [student.capacity_all_to_all_bytes(*case) for case in cases["capacity"]],
                "dropless": [student.dropless_all_to_all_bytes([r.copy() for r in routings], *rest)
                             for routings, *rest in cases["dropless"]]}

    def judge(self, cases, answers) -> str:
        for case, answer in zip(cases["capacity"], answers["capacity"]):
            n, experts, capacity, d, b = case
            expected = moe.capacity_all_to_all_bytes(*case)
            expect_answer(answer, expected, f"capacity_all_to_all_bytes{case}", slips={
                "that counts the rows a rank keeps for its own experts; only (n-1)/n of each all-to-all leaves it":
                    4 * experts * capacity * d * b,
                "that is the forward pass only; backward runs the two all-to-alls in reverse": expected / 2,
                "that is one all-to-all; a forward and backward pass run four (dispatch, combine and their reverses)":
                    expected / 4})
        for (routings, experts, d, b), answer in zip(cases["dropless"], answers["dropless"]):
            n = len(routings)
            expected = moe.dropless_all_to_all_bytes(routings, experts, d, b)
            what = f"dropless_all_to_all_bytes({n} ranks with {[len(r) for r in routings]} tokens, top-{routings[0].shape[1]})"
            expect(isinstance(answer, (list, tuple, np.ndarray)) and len(answer) == n,
                   f"{what} should return one number per rank, {n} in all")
            owners = [moe.expert_owner(r.reshape(-1), experts, n) for r in routings]
            own_rows = [int(np.sum(o != rank)) for rank, o in enumerate(owners)]
            for rank in range(n):
                expect_answer(answer[rank], expected[rank], f"{what}, rank {rank}", slips={
                    "that counts only the rows of this rank's own tokens; it also sends back the results (and, in "
                    "backward, the gradients) of the rows other ranks sent it": 2 * own_rows[rank] * d * b,
                    "that is the forward pass only; backward sends as much again": expected[rank] / 2,
                    "that includes rows a rank sends to its own experts, which never leave it":
                        2 * (len(owners[rank]) + sum(int(np.sum(o == rank)) for o in owners)) * d * b})
        return "both formulas match on random layouts: 4(n-1)/n·E·C·h·w with capacity, 2(out+in)·h·w dropless"
