"""Exercise 7: auxiliary-loss-free load balancing (DeepSeek-V3): routing with a per-expert choice
bias, and the bias's sign update."""
from __future__ import annotations

import numpy as np

from dtp.ep import moe  # noqa: F401  imported before the sandbox is confined
from dtp.ep import routing as moe_routing

from ...compare import CheckFailed, expect
from ...registry import Check, exercise
from ..references import refuses_library
from .shared import MOE, integer_array, known_mistake, pair


@exercise("ep.bias_balancing", points=3)
@refuses_library("dtp.ep.routing", MOE)
class BiasBalancing(Check):
    """Verifies: `biased_router` chooses each token's k experts by probability + bias, best
    first, on draws where the bias changes some tokens' choices, and returns as gate weights the
    chosen experts' probabilities without the bias (renormalised and not, k = 1 to 3);
    `update_bias` moves every expert's bias by exactly `rate` towards the mean load (down when
    overloaded, up when underloaded) and leaves an expert exactly at the mean load unchanged, on
    routings with experts above, below and at the mean, from a nonzero bias.
    Fakes: dtp.ep.routing's functions and dtp.ep.moe's router trip; fresh logits, biases and rates
    defeat a table of answers; ignoring the bias fails the choices, adding it to the gates fails
    the weights, a step by the size of the error (not its sign) fails the update.
    """

    reads = ("biased_router", "update_bias")
    timeout_s = 15

    def prepare(self, rng):
        routings = []
        for k, renormalize in ((1, False), (2, True), (2, False), (3, True)):
            experts = int(rng.integers(k + 3, 13))
            while True:  # a bias that changes some token's choice, so that ignoring it fails
                logits = rng.standard_normal((int(rng.integers(8, 40)), experts)) * float(rng.choice([0.7, 2.0]))
                bias = rng.standard_normal(experts) * float(rng.choice([0.05, 0.2]))
                plain, _ = moe.top_k_routing(logits, k, False)
                biased, _ = moe_routing.biased_top_k_routing(logits, bias, k, False)
                if not np.array_equal(plain, biased):
                    break
            routings.append({"logits": logits, "bias": bias, "k": k, "renormalize": renormalize})
        updates = [{"bias": rng.standard_normal(experts) * 0.01, "indices": _loads_around_the_mean(rng, experts, k),
                    "rate": float(rng.uniform(1e-4, 1e-2))}
                   for experts, k in ((int(rng.integers(5, 10)), 1), (8, 2), (int(rng.integers(5, 17)), 3))]
        return {"routings": routings, "updates": updates}

    def collect(self, student, inputs):
        routed = [student.biased_router(case["logits"].copy(), case["bias"].copy(), case["k"], case["renormalize"])
                  for case in inputs["routings"]]
        updated = [np.asarray(student.update_bias(case["bias"].copy(), case["indices"].copy(), case["rate"]), dtype=float)
                   for case in inputs["updates"]]
        return {"routed": routed, "updated": updated}

    def judge(self, inputs, data) -> str:
        expect(isinstance(data, dict) and len(data.get("routed", [])) == len(inputs["routings"])
               and len(data.get("updated", [])) == len(inputs["updates"]), "the grader's calls did not all return")
        for case, answer in zip(inputs["routings"], data["routed"]):
            _judge_routing(case, answer)
        for case, answer in zip(inputs["updates"], data["updated"]):
            _judge_update(case, answer)
        return ("experts chosen by probability + bias, gate weights the probabilities without it (k = 1 to 3), and "
                "each bias moved by the rate towards the mean load, unchanged at the mean")


def _loads_around_the_mean(rng, experts: int, k: int) -> np.ndarray:
    """(T, k) distinct choices per token where some experts get exactly the mean load T·k/E and
    others more or less: a perfectly even routing, then two assignments moved to one expert, which
    ends 2 over the mean. Every load error is then not just ±1, so a step by the size of the error
    (2·rate there) differs from the rule's step by its sign (rate) in every case."""
    tokens = experts * int(rng.integers(2, 6))
    indices = (np.arange(tokens)[:, None] + np.arange(k)[None, :] * (experts // k)) % experts
    target, moved = int(rng.integers(experts)), 0
    for token in rng.permutation(tokens):
        if moved == 2:
            break
        if target not in indices[token]:
            indices[token, int(rng.integers(k))] = target
            moved += 1
    return indices[rng.permutation(tokens)]


def _judge_routing(case, answer) -> None:
    logits, bias, k, renormalize = case["logits"], case["bias"], case["k"], case["renormalize"]
    what = f"biased_router(logits of shape {logits.shape}, bias, k={k}, renormalize={renormalize})"
    indices, weights = pair(answer, "expert_indices, gate_weights", what)
    indices = integer_array(indices, (logits.shape[0], k), "expert_indices", what)
    expected_indices, expected_weights = moe_routing.biased_top_k_routing(logits, bias, k, renormalize)
    if not np.array_equal(indices, expected_indices):
        plain, _ = moe.top_k_routing(logits, k, False)
        on_logits, _ = moe.top_k_routing(logits + bias, k, False)
        slip = known_mistake(indices, {
            "the bias is ignored: choose each token's experts by probability + bias": plain,
            "the bias is added to the logits; add it to the probabilities (the softmax of the logits), as the "
            "exercise states": on_logits,
            "those are the experts by probability + bias, but not best first: sort by falling probability + bias":
                np.sort(expected_indices, axis=1)}, rtol=0, atol=0)
        token = int(np.argmax(np.any(indices != expected_indices, axis=1)))
        raise CheckFailed(f"{what}: {slip}" if slip else
                          f"{what}: token {token} went to experts {indices[token].tolist()}; by probability + bias "
                          f"its choices are {expected_indices[token].tolist()}")
    expect(isinstance(weights, np.ndarray) and weights.shape == expected_weights.shape,
           f"{what}: gate_weights should be an array of shape {expected_weights.shape}")
    if np.allclose(weights, expected_weights, rtol=1e-9, atol=1e-12):
        return
    probabilities = moe.softmax(logits)
    biased = np.take_along_axis(probabilities + bias, expected_indices, axis=1)
    slip = known_mistake(weights, {
        "the gate weights include the bias; the bias decides only which experts compute a token, the gate weight "
        "is the expert's probability alone": [biased, biased / biased.sum(axis=1, keepdims=True)],
        "the gate weights are a softmax of logits + bias; they are the probabilities of the logits alone":
            [np.take_along_axis(moe.softmax(logits + bias), expected_indices, axis=1)],
        ("with renormalize=False the gate weight is the probability itself" if not renormalize else
         "with renormalize=True divide the k chosen probabilities by their sum"):
            moe_routing.biased_top_k_routing(logits, bias, k, not renormalize)[1]})
    raise CheckFailed(f"{what}: {slip}" if slip else
                      f"{what}: the experts are right, the gate weights are not the chosen experts' probabilities"
                      f"{' divided by their sum' if renormalize else ''}")


def _judge_update(case, answer) -> None:
    bias, indices, rate = case["bias"], case["indices"], case["rate"]
    experts = bias.shape[0]
    what = f"update_bias(bias of {experts} experts, expert_indices of shape {indices.shape}, rate={rate:.4g})"
    expect(isinstance(answer, np.ndarray) and answer.shape == (experts,),
           f"{what} should return the {experts} new biases, not an array of shape {getattr(answer, 'shape', None)}")
    expected = moe_routing.update_choice_bias(bias, indices, rate)
    if np.allclose(answer, expected, rtol=1e-12, atol=1e-15):
        return
    loads = np.bincount(indices.reshape(-1), minlength=experts)
    error = loads.mean() - loads
    slip = known_mistake(answer, {
        "that steps by the size of the error, rate·(mean - load); the rule moves each bias by the rate itself, in "
        "the direction of the error's sign": [bias + rate * error, bias + rate * error / loads.sum()],
        "the signs are reversed: an overloaded expert's bias must fall (fewer tokens choose it), an underloaded "
        "one's rise": bias - rate * np.sign(error),
        "an expert exactly at the mean load keeps its bias (the sign of a zero error is 0)":
            [bias + rate * np.where(error > 0, 1.0, -1.0), bias + rate * np.where(error >= 0, 1.0, -1.0)],
        "that is the step alone; add it to the current bias": rate * np.sign(error)}, rtol=1e-12, atol=1e-15)
    expert = int(np.argmax(np.abs(answer - expected)))
    raise CheckFailed(f"{what}: {slip}" if slip else
                      f"{what}: expert {expert} received {loads[expert]} assignments (mean {loads.mean():g}); its bias "
                      f"should become {expected[expert]:.6g}, not {answer[expert]:.6g}")
