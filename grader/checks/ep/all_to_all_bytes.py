"""Exercise 5: the bytes each rank sends in the all-to-alls, fixed capacity and dropless."""
from __future__ import annotations

import numpy as np

from dtp.ep import moe

from ...compare import expect, expect_answer
from ...registry import Check, exercise
from ..references import refuses_library
from .shared import MOE, skewed_choices


@exercise("ep.all_to_all_bytes", points=2)
@refuses_library(MOE)
class AllToAllBytes(Check):
    """Verifies: bytes each rank sends to other ranks per forward and backward pass, with fixed
    capacity (random n, E, C, d, bytes per element) and dropless (random routings of 2 to 4
    ranks with different token counts, top-1 and top-2), against dtp.ep.moe's closed forms, which
    tests/ep/test_ep_checks.py checks against bytes counted on gloo. The dropless layouts are drawn
    so that every known slip (own rows only, half, as if with capacity, own experts' rows counted,
    first choices only) gives some rank another number.
    Fakes: dtp.ep.moe's formulas trip; random inputs each run.
    """

    reads = ("capacity_all_to_all_bytes", "dropless_all_to_all_bytes")
    timeout_s = 15

    def prepare(self, rng):
        capacity = []
        for n in (2, 3, 4, 8, 64):
            capacity.append((n, n * int(rng.integers(1, 5)), int(rng.integers(1, 500)), int(rng.choice([64, 4096])),
                             int(rng.choice([2, 4]))))
        while True:  # routings that tell every slip from the right count, one of them top-2
            dropless = []
            for n, k in zip((2, 3, 4), rng.permutation([1, 2, int(rng.integers(1, 3))])):
                local = int(rng.integers(1, 4))
                routings = [skewed_choices(rng, int(rng.integers(1, 30)), n * local, int(k)) for _ in range(n)]
                dropless.append((routings, n * local, int(rng.integers(8, 64)), int(rng.choice([2, 4]))))
            if _every_dropless_slip_shows(dropless):
                break
        return {"capacity": capacity, "dropless": dropless}

    def collect(self, student, cases):
        return {"capacity": [student.capacity_all_to_all_bytes(*case) for case in cases["capacity"]],
                "dropless": [student.dropless_all_to_all_bytes([r.copy() for r in routings], *rest)
                             for routings, *rest in cases["dropless"]]}

    def judge(self, cases, answers) -> str:
        for case, answer in zip(cases["capacity"], answers["capacity"]):
            expect_answer(answer, moe.capacity_all_to_all_bytes(*case), f"capacity_all_to_all_bytes{case}",
                          slips=capacity_slips(case))
        for (routings, experts, d, b), answer in zip(cases["dropless"], answers["dropless"]):
            n = len(routings)
            expected = moe.dropless_all_to_all_bytes(routings, experts, d, b)
            what = f"dropless_all_to_all_bytes({n} ranks with {[len(r) for r in routings]} tokens, top-{routings[0].shape[1]})"
            expect(isinstance(answer, (list, tuple, np.ndarray)) and len(answer) == n,
                   f"{what} should return one number per rank, {n} in all")
            slips = _dropless_slips(routings, experts, d, b)
            for rank in range(n):
                expect_answer(answer[rank], expected[rank], f"{what}, rank {rank}",
                              slips={feedback: values[rank] for feedback, values in slips.items()})
        return "both formulas match on random layouts: 4(n-1)/n·E·C·h·w with capacity, 2(out+in)·h·w dropless"


def capacity_slips(case) -> dict:
    """feedback -> the bytes that mistake gives, for capacity_all_to_all_bytes(*case)."""
    n, experts, capacity, d, b = case
    expected = moe.capacity_all_to_all_bytes(*case)
    return {"that counts the rows a rank keeps for its own experts; only (n-1)/n of each all-to-all leaves it":
                4 * experts * capacity * d * b,
            # half: two of the four all-to-alls, whichever two (forward alone, or dispatch without combine)
            "that is half: it counts two all-to-alls, and a forward and backward pass run four (dispatch and "
            "combine, then the reverse of each in backward)": expected / 2,
            "that is one all-to-all; a forward and backward pass run four (dispatch, combine and their reverses)":
                expected / 4,
            "that counts the bytes a rank receives as well as those it sends": 2 * expected}


def _dropless_slips(routings, experts: int, d: int, b: int) -> dict[str, list[float]]:
    """Feedback -> the bytes per rank that mistake gives, for one dropless layout."""
    n = len(routings)
    expected = moe.dropless_all_to_all_bytes(routings, experts, d, b)
    owners = [moe.expert_owner(r.reshape(-1), experts, n) for r in routings]
    out = [int(np.sum(o != rank)) for rank, o in enumerate(owners)]  # rows a rank sends to other ranks' experts
    arriving = [sum(int(np.sum(o == rank)) for o in owners) for rank in range(n)]  # its own rows included
    first_choices = moe.dropless_all_to_all_bytes([r[:, :1] for r in routings], experts, d, b)
    return {
        "that counts only the rows of this rank's own tokens; it also sends back the results (and, in backward, the "
        "gradients) of the rows other ranks sent it": [2 * out[r] * d * b for r in range(n)],
        # out + in rows: the forward pass alone, or the dispatch and its reverse without the combine
        "that is half: a rank sends out + in rows in the forward pass (its tokens to other ranks' experts, the results "
        "of the rows it received) and as many again in backward (their gradients); yours counts out + in rows once":
            [e / 2 for e in expected],
        "that assumes a rank receives as many rows as it sends, which holds with a fixed capacity; dropless, count "
        "the rows other ranks send it": [4 * out[r] * d * b for r in range(n)],
        "that includes rows a rank sends to its own experts, which never leave it":
            [2 * (len(owners[r]) + arriving[r]) * d * b for r in range(n)],
        "that counts each token's first choice only; a token is sent to each of its k experts": first_choices}


def _every_dropless_slip_shows(dropless: list) -> bool:
    """Every slip gives some rank of some layout another number than the right one."""
    right = [moe.dropless_all_to_all_bytes(*case) for case in dropless]
    slips = [_dropless_slips(*case) for case in dropless]
    return all(any(value != right[world][rank] for world in range(len(dropless))
                   for rank, value in enumerate(slips[world][feedback])) for feedback in slips[0])
