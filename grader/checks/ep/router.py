"""Exercise 1: the top-k router (expert indices, best first, and gate weights)."""
from __future__ import annotations

import numpy as np

from dtp.ep import moe

from ...compare import CheckFailed, expect, expect_close
from ...registry import Check, exercise
from ..references import refuses_library
from .shared import MOE, integer_array, known_mistake, name_mistakes, pair


@exercise("ep.router", points=2)
@refuses_library(MOE)
class Router(Check):
    """Verifies: expert indices (most probable first) and gate weights, renormalised or not, for
    k = 1 to 4 on random logits of random shapes, including logits near 1000 whose exponentials
    overflow unless shifted.
    Fakes: dtp.ep.moe's router trips; fresh random logits defeat a table of answers.
    """

    reads = ("top_k_router",)
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for k, renormalize in ((1, False), (1, True), (2, True), (2, False), (3, True), (4, False)):
            experts = int(rng.integers(k + 1, 17))
            logits = rng.standard_normal((int(rng.integers(5, 40)), experts)) * float(rng.choice([0.5, 3.0]))
            cases.append((logits, k, renormalize))
        large = rng.standard_normal((int(rng.integers(5, 20)), 6)) * 5 + 1000.0  # exp(1000) overflows
        cases.append((large, 2, bool(rng.integers(2))))
        return cases

    def collect(self, student, cases):
        return [student.top_k_router(logits.copy(), k, renormalize) for logits, k, renormalize in cases]

    def judge(self, cases, answers) -> str:
        expect(len(answers) == len(cases), "the grader's calls did not all return")
        for (logits, k, renormalize), answer in zip(cases, answers):
            what = f"top_k_router(logits of shape {logits.shape}, k={k}, renormalize={renormalize})"
            indices, weights = pair(answer, "expert_indices, gate_weights", what)
            tokens = logits.shape[0]
            indices = integer_array(indices, (tokens, k), "expert_indices", what)
            expect(isinstance(weights, np.ndarray) and weights.shape == (tokens, k),
                   f"{what}: gate_weights should be an array of shape {(tokens, k)}")
            expect(np.all(np.isfinite(weights)),
                   f"{what}: gate_weights contains NaN or inf for logits near {logits.max():.0f}: exp overflows; "
                   "subtract each token's largest logit before exponentiating (the softmax does not change)")
            _judge_choices(logits, k, indices, what)
            _judge_gates(logits, k, renormalize, weights, what)
        return ("expert indices (most probable first) and gate weights, renormalised and not, match for k = 1 to 4, "
                "also for logits near 1000")


def _judge_choices(logits: np.ndarray, k: int, indices: np.ndarray, what: str) -> None:
    expected, _ = moe.top_k_routing(logits, k, renormalize=False)
    if np.array_equal(indices, expected):
        return
    diagnoses = []
    if np.array_equal(np.sort(indices, axis=1), np.sort(expected, axis=1)):
        diagnoses.append("the right experts, in the wrong order: list each token's choices from the most probable to "
                         "the least (the first choice has priority when capacity runs out)")
    slip = known_mistake(indices, choice_slips(logits, k), rtol=0, atol=0)
    if diagnoses or slip:
        raise CheckFailed(f"{what}: {name_mistakes(diagnoses + ([slip] if slip else []))}")
    token = int(np.argmax(np.any(indices != expected, axis=1)))
    best = (f"its most probable expert is {expected[token, 0]}" if k == 1 else
            f"its {k} most probable experts are {expected[token].tolist()}")
    raise CheckFailed(f"{what}: token {token} went to experts {indices[token].tolist()}; {best}")


def choice_slips(logits: np.ndarray, k: int) -> dict:
    """feedback -> the expert indices that mistake chooses."""
    return {"you chose each token's k least probable experts: sort by falling probability":
                np.argsort(moe.softmax(logits), axis=1, kind="stable")[:, :k],
            "your softmax normalises over the tokens (axis 0); a token's probabilities are over the experts (axis 1)":
                np.argsort(-moe.softmax(logits.T).T, axis=1, kind="stable")[:, :k]}


def gate_slips(logits: np.ndarray, k: int, renormalize: bool) -> dict:
    """feedback -> the gate weights that mistake gives (for the right experts)."""
    _, other = moe.top_k_routing(logits, k, not renormalize)
    indices, _ = moe.top_k_routing(logits, k, False)
    return {
        ("you renormalised the k weights; with renormalize=False the gate weight is the expert's probability "
         "itself (as in the Switch Transformer)") if not renormalize else
        ("with renormalize=True divide the k chosen probabilities by their sum (Mixtral's softmax over the top-k "
         "logits gives the same numbers)"): other,
        "those are the logits; the gate weights are softmax probabilities": np.take_along_axis(logits, indices, axis=1),
        "your softmax normalises over the tokens (axis 0), not over the experts":
            np.take_along_axis(moe.softmax(logits.T).T, indices, axis=1),
    }


def _judge_gates(logits: np.ndarray, k: int, renormalize: bool, weights: np.ndarray, what: str) -> None:
    _, expected = moe.top_k_routing(logits, k, renormalize)
    if np.allclose(weights, expected, rtol=1e-9, atol=1e-12):
        return
    slip = known_mistake(weights, gate_slips(logits, k, renormalize))
    if slip:
        raise CheckFailed(f"{what}: {slip}")
    expect_close(weights, expected, f"{what}: gate_weights", rtol=1e-9, atol=1e-12, check_dtype=False)

