"""Exercise 7: auxiliary-loss-free load balancing (DeepSeek-V3): routing with a per-expert choice
bias, and the bias's sign update."""
from __future__ import annotations

import numpy as np

from dtp.ep import moe  # noqa: F401  imported before the sandbox is confined
from dtp.ep import routing as moe_routing

from ...compare import CheckFailed, distinct, expect
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
    routings with experts above, below and at the mean, from a nonzero bias, one of them with
    experts no token chose (the last expert among them: a load count without a fixed length is
    short there, and raises or misplaces the loads).
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
        k = int(rng.integers(1, 3))
        experts = k * int(rng.integers(4, 7))  # room for an expert at three times the mean and one at it
        updates.append({"bias": rng.standard_normal(experts) * 0.01, "indices": _loads_with_idle_experts(rng, experts, k),
                        "rate": float(rng.uniform(1e-4, 1e-2))})
        return {"routings": routings, "updates": updates}

    def collect(self, student, inputs):
        routed = [student.biased_router(case["logits"].copy(), case["bias"].copy(), case["k"], case["renormalize"])
                  for case in inputs["routings"]]
        return {"routed": routed, "updated": [_updated(student, case) for case in inputs["updates"]]}

    def judge(self, inputs, data) -> str:
        expect(isinstance(data, dict) and len(data.get("routed", [])) == len(inputs["routings"])
               and len(data.get("updated", [])) == len(inputs["updates"]), "the grader's calls did not all return")
        for case, answer in zip(inputs["routings"], data["routed"]):
            _judge_routing(case, answer)
        for case, answer in zip(inputs["updates"], data["updated"]):
            _judge_update(case, answer)
        return ("experts chosen by probability + bias, gate weights the probabilities without it (k = 1 to 3), and "
                "each bias moved by the rate towards the mean load, unchanged at the mean")


def _updated(student, case):
    """In the sandbox: the learner's new biases, or what it raised (a load count that is short when
    the last experts got no token raises where it meets the bias), so that the judge can say why."""
    try:
        return np.asarray(student.update_bias(case["bias"].copy(), case["indices"].copy(), case["rate"]), dtype=float)
    except NotImplementedError:
        raise
    except Exception as error:  # noqa: BLE001 - reported, with its cause, by the judge
        return {"raised": f"{type(error).__name__}: {str(error).strip()[:200]}"}


def _loads_with_idle_experts(rng, experts: int, k: int) -> np.ndarray:
    """(T, k) distinct choices per token where the last expert and one other get no token, one
    expert gets three times the mean load T·k/E and the others exactly the mean."""
    mean = int(rng.integers(2, 5))
    tokens = experts * mean // k
    idle = {experts - 1, int(rng.integers(experts - 1))}
    busy = int(rng.choice([e for e in range(experts) if e not in idle]))
    loads = {e: 0 if e in idle else 3 * mean if e == busy else mean for e in range(experts)}
    assignments = np.repeat(np.arange(experts), [loads[e] for e in range(experts)])  # each run shorter than T
    indices = assignments.reshape(k, tokens).T  # token t: assignments t, t + T, ...: distinct experts
    return indices[rng.permutation(tokens)]


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


def choice_slips(case) -> dict:
    """feedback -> the expert indices that mistake chooses."""
    logits, bias, k = case["logits"], case["bias"], case["k"]
    expected, _ = moe_routing.biased_top_k_routing(logits, bias, k, False)
    return {"the bias is ignored: choose each token's experts by probability + bias": moe.top_k_routing(logits, k, False)[0],
            "the bias is added to the logits; add it to the probabilities (the softmax of the logits), as the exercise "
            "states": moe.top_k_routing(logits + bias, k, False)[0],
            "those are the experts by probability + bias, but not best first: sort by falling probability + bias":
                np.sort(expected, axis=1)}


def gate_slips(case) -> dict:
    """feedback -> the gate weights that mistake gives (a list: any of them)."""
    logits, bias, k, renormalize = case["logits"], case["bias"], case["k"], case["renormalize"]
    expected, _ = moe_routing.biased_top_k_routing(logits, bias, k, False)
    biased = np.take_along_axis(moe.softmax(logits) + bias, expected, axis=1)
    return {"the gate weights include the bias; the bias decides only which experts compute a token, the gate weight "
            "is the expert's probability alone": [biased, biased / biased.sum(axis=1, keepdims=True)],
            "the gate weights are a softmax of logits + bias; they are the probabilities of the logits alone":
                [np.take_along_axis(moe.softmax(logits + bias), expected, axis=1)],
            ("with renormalize=False the gate weight is the probability itself" if not renormalize else
             "with renormalize=True divide the k chosen probabilities by their sum"):
                [moe_routing.biased_top_k_routing(logits, bias, k, not renormalize)[1]]}


def _judge_routing(case, answer) -> None:
    logits, bias, k, renormalize = case["logits"], case["bias"], case["k"], case["renormalize"]
    what = f"biased_router(logits of shape {logits.shape}, bias, k={k}, renormalize={renormalize})"
    indices, weights = pair(answer, "expert_indices, gate_weights", what)
    indices = integer_array(indices, (logits.shape[0], k), "expert_indices", what)
    expected_indices, expected_weights = moe_routing.biased_top_k_routing(logits, bias, k, renormalize)
    if not np.array_equal(indices, expected_indices):
        slip = known_mistake(indices, choice_slips(case), rtol=0, atol=0)
        token = int(np.argmax(np.any(indices != expected_indices, axis=1)))
        raise CheckFailed(f"{what}: {slip}" if slip else
                          f"{what}: token {token} went to experts {indices[token].tolist()}; by probability + bias "
                          f"its choices are {expected_indices[token].tolist()}")
    expect(isinstance(weights, np.ndarray) and weights.shape == expected_weights.shape,
           f"{what}: gate_weights should be an array of shape {expected_weights.shape}")
    if np.allclose(weights, expected_weights, rtol=1e-9, atol=1e-12):
        return
    slip = known_mistake(weights, gate_slips(case))
    raise CheckFailed(f"{what}: {slip}" if slip else
                      f"{what}: the experts are right, the gate weights are not the chosen experts' probabilities"
                      f"{' divided by their sum' if renormalize else ''}")


def _idle(case) -> list[int]:
    loads = np.bincount(case["indices"].reshape(-1), minlength=case["bias"].shape[0])
    return np.nonzero(loads == 0)[0].tolist()


IDLE_EXPERTS = ("an expert that no token chose has load 0, below the mean: its bias rises by the rate too. Count every "
                "expert's load, including the zeros: np.bincount(expert_indices.reshape(-1), minlength=len(bias))")


def update_slips(case) -> dict:
    """feedback -> the new biases that mistake gives (a list: any of them)."""
    bias, indices, rate = case["bias"], case["indices"], case["rate"]
    loads = np.bincount(indices.reshape(-1), minlength=bias.shape[0])
    error = loads.mean() - loads
    slips = {
        "that steps by the size of the error, rate·(mean - load); the rule moves each bias by the rate itself, in "
        "the direction of the error's sign": [bias + rate * error, bias + rate * error / loads.sum()],
        "the signs are reversed: an overloaded expert's bias must fall (fewer tokens choose it), an underloaded "
        "one's rise": [bias - rate * np.sign(error)],
        "an expert exactly at the mean load keeps its bias (the sign of a zero error is 0)":
            [bias + rate * np.where(error > 0, 1.0, -1.0), bias + rate * np.where(error >= 0, 1.0, -1.0)],
        "that is the step alone; add it to the current bias": [rate * np.sign(error)]}
    idle = loads == 0
    if idle.any():  # loads counted only for the experts chosen (np.unique): the others left as they were
        chosen_mean = loads[~idle].mean()
        slips[IDLE_EXPERTS] = [np.where(idle, bias, bias + rate * np.sign(error)),
                               np.where(idle, bias, bias + rate * np.sign(chosen_mean - loads))]
    return slips


def _judge_update(case, answer) -> None:
    bias, indices, rate = case["bias"], case["indices"], case["rate"]
    experts = bias.shape[0]
    what = f"update_bias(bias of {experts} experts, expert_indices of shape {indices.shape}, rate={rate:.4g})"
    idle = _idle(case)
    if isinstance(answer, dict) and "raised" in answer:
        raise CheckFailed(f"{what} raised {answer['raised']}" + (
            f" on a routing where experts {idle} received no token: {IDLE_EXPERTS}" if idle else ""))
    expect(isinstance(answer, np.ndarray) and answer.shape == (experts,),
           f"{what} should return the {experts} new biases, not an array of shape {getattr(answer, 'shape', None)}")
    expected = moe_routing.update_choice_bias(bias, indices, rate)
    if np.allclose(answer, expected, rtol=1e-12, atol=1e-15):
        return
    loads = np.bincount(indices.reshape(-1), minlength=experts)
    slip = known_mistake(answer, update_slips(case), rtol=1e-12, atol=1e-15)
    expert = int(np.argmax(np.abs(answer - expected)))
    mine, right = distinct(answer[expert], expected[expert])
    raise CheckFailed(f"{what}: {slip}" if slip else
                      f"{what}: expert {expert} received {loads[expert]} assignments (mean {loads.mean():g}); its bias "
                      f"should become {right}, not {mine}")
