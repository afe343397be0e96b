"""Checks of the expert-parallelism chapter (notebook 05_expert_parallel).

Oracles, computed in the grader: dtp.moe's router, slots and one-hot layer (tests/test_ep_moe.py
checks them against token-by-token loops and torch), autograd through dtp.moe.moe_layer_torch
run once per rank's tokens (the single-process layer with the same weights and routing), and
dtp.moe's closed forms. Mechanisms, from what the learner's code did in a gloo world: every
collective recorded on the process group, and for every all-to-all the rows sent to each rank.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch

from dtp import moe
from dtp.traffic import CommunicationLog

from ..compare import CheckFailed, expect, expect_answer, expect_close
from ..registry import Check, exercise
from .common import FixedAnswers, FormulaCheck, completed_worlds, events_as_data, raise_world_failure, run_worlds

ROUTING_REFERENCES = ("dtp.moe.top_k_routing", "dtp.moe.softmax")
LAYER_REFERENCES = ("dtp.moe.moe_layer", "dtp.moe.moe_layer_torch", "dtp.moe.dispatch_and_combine",
                    "dtp.moe.assign_slots", "dtp.moe.expert_capacity") + ROUTING_REFERENCES
# torch's differentiable all-to-alls: the exercise is to write the backward exchange
TORCH_DIFFERENTIABLE_ALL_TO_ALL = ("torch.distributed.nn.functional.all_to_all_single",
                                   "torch.distributed.nn.functional.all_to_all",
                                   "torch.distributed._functional_collectives.all_to_all_single_autograd",
                                   "torch.distributed._functional_collectives.all_to_all_single")


def _pair(answer, names: str, what: str) -> tuple:
    expect(isinstance(answer, (tuple, list)) and len(answer) == 2, f"{what} should return a pair ({names})")
    return answer[0], answer[1]


def _integers(value, shape: tuple, name: str, what: str) -> np.ndarray:
    expect(isinstance(value, np.ndarray), f"{what}: {name} should be a numpy array, not {type(value).__name__}")
    expect(value.shape == shape, f"{what}: {name} has shape {value.shape}, expected {shape}")
    expect(value.dtype.kind in "iu", f"{what}: {name} should hold integers, not {value.dtype}")
    return value


def _first_slip(actual: np.ndarray, slips: dict, rtol: float = 1e-9, atol: float = 1e-12) -> str | None:
    """The feedback of the first known mistake (feedback -> the value, or values, it gives) that
    `actual` equals."""
    for feedback, values in slips.items():
        for value in values if isinstance(values, list) else [values]:
            if value.shape == actual.shape and np.allclose(actual, value, rtol=rtol, atol=atol):
                return feedback
    return None


# --- 1. the router ----------------------------------------------------------------------------

@exercise("ep.router", points=2)
class Router(Check):
    """Verifies: expert indices (most probable first) and gate weights, renormalised or not, for
    k = 1 to 4 on random logits of random shapes, including logits near 1000 whose exponentials
    overflow unless shifted.
    Fakes: dtp.moe's router trips; fresh random logits defeat a table of answers.
    """

    reads = ("top_k_router",)
    references = ROUTING_REFERENCES
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
            indices, weights = _pair(answer, "expert_indices, gate_weights", what)
            tokens = logits.shape[0]
            indices = _integers(indices, (tokens, k), "expert_indices", what)
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
    if np.array_equal(np.sort(indices, axis=1), np.sort(expected, axis=1)):
        raise CheckFailed(f"{what}: the right experts, in the wrong order: list each token's choices from the most "
                          "probable to the least (the first choice has priority when capacity runs out)")
    probabilities = moe.softmax(logits)
    if np.array_equal(indices, np.argsort(probabilities, axis=1, kind="stable")[:, :k]):
        raise CheckFailed(f"{what}: you chose each token's k least probable experts: sort by falling probability")
    column_softmax = moe.softmax(logits.T).T
    if np.array_equal(indices, np.argsort(-column_softmax, axis=1, kind="stable")[:, :k]):
        raise CheckFailed(f"{what}: your softmax normalises over the tokens (axis 0); a token's probabilities are "
                          "over the experts (axis 1)")
    token = int(np.argmax(np.any(indices != expected, axis=1)))
    raise CheckFailed(f"{what}: token {token} went to experts {indices[token].tolist()}; its {k} most probable "
                      f"experts are {expected[token].tolist()}")


def _judge_gates(logits: np.ndarray, k: int, renormalize: bool, weights: np.ndarray, what: str) -> None:
    _, expected = moe.top_k_routing(logits, k, renormalize)
    if np.allclose(weights, expected, rtol=1e-9, atol=1e-12):
        return
    _, other = moe.top_k_routing(logits, k, not renormalize)
    indices, _ = moe.top_k_routing(logits, k, False)
    column = np.take_along_axis(moe.softmax(logits.T).T, indices, axis=1)
    slips = {
        ("you renormalised the k weights; with renormalize=False the gate weight is the expert's probability "
         "itself (as in the Switch Transformer)") if not renormalize else
        ("with renormalize=True divide the k chosen probabilities by their sum (Mixtral's softmax over the top-k "
         "logits gives the same numbers)"): other,
        "those are the logits; the gate weights are softmax probabilities": np.take_along_axis(logits, indices, axis=1),
        "your softmax normalises over the tokens (axis 0), not over the experts": column,
    }
    slip = _first_slip(weights, slips)
    if slip:
        raise CheckFailed(f"{what}: {slip}")
    expect_close(weights, expected, f"{what}: gate_weights", rtol=1e-9, atol=1e-12, check_dtype=False)


# --- 2. capacity, slots and the single-process layer ------------------------------------------

CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # exact in binary: no rounding to argue about


@exercise("ep.capacity", points=1)
class Capacity(FormulaCheck):
    """Verifies: ceil(capacity_factor · T · k / E) on random sizes, where the quotient is a whole
    number (the ceiling changes nothing) and where it is not.
    Fakes: dtp.moe.expert_capacity trips."""

    function = "expert_capacity"
    references = ("dtp.moe.expert_capacity",)
    timeout_s = 15
    summary = "ceil(capacity_factor · T · k / E) on random sizes, whole quotients and fractional ones"

    def cases(self, rng):
        cases = []
        for _ in range(6):  # fractional quotients
            while True:
                args = (int(rng.integers(1, 5000)), int(rng.choice([3, 6, 8, 12, 16, 64, 128])),
                        int(rng.integers(1, 5)), float(rng.choice(CAPACITY_FACTORS)))
                if (args[3] * args[0] * args[2]) % args[1]:
                    cases.append((args, {}))
                    break
        for _ in range(2):  # whole quotients; powers of two keep every order of the arithmetic exact
            experts, k = int(rng.choice([4, 8, 64])), int(rng.integers(1, 3))
            cases.append(((experts * int(rng.integers(1, 100)), experts, k, 1.0), {}))
        return cases

    def expected(self, tokens, experts, k, factor):
        return moe.expert_capacity(tokens, experts, k, factor)

    def slips(self, tokens, experts, k, factor):
        exact = factor * tokens * k / experts
        return {"that rounds down (as int() does, and round() below one half): a fractional slot must round up "
                "(the ceiling), or even perfectly balanced routing drops tokens": int(exact),
                "that is not rounded: a capacity counts slots, ceil(capacity_factor · T · k / E)": exact,
                "k is missing: each token makes k assignments, T·k in all": float(np.ceil(factor * tokens / experts))}


def _skewed_choices(rng, tokens: int, experts: int, k: int) -> np.ndarray:
    """Each token's k distinct experts, popular experts more often (so that capacity binds)."""
    popularity = rng.standard_normal(experts) * 1.5
    scores = popularity + rng.gumbel(size=(tokens, experts))
    return np.argsort(-scores, axis=1)[:, :k]


def _slots_in_priority(indices: np.ndarray, num_experts: int, capacity, order) -> np.ndarray:
    """Slots given to the assignments (token, choice) in the given priority order."""
    slots = np.full(indices.shape, -1)
    filled = np.zeros(num_experts, dtype=int)
    for token, choice in order:
        expert = indices[token, choice]
        if capacity is None or filled[expert] < capacity:
            slots[token, choice] = filled[expert]
            filled[expert] += 1
    return slots


def _token_major(indices: np.ndarray) -> list[tuple[int, int]]:
    return [(t, j) for t in range(indices.shape[0]) for j in range(indices.shape[1])]


def _slot_slips(indices: np.ndarray, num_experts: int, capacity) -> dict[str, np.ndarray]:
    tokens, k = indices.shape
    choice_major = [(t, j) for j in range(k) for t in range(tokens)]
    slips = {}
    if k > 1:
        slips["you gave priority token by token (token 0's second choice before token 1's first); every first "
              "choice comes before any second choice"] = _slots_in_priority(indices, num_experts, capacity,
                                                                              _token_major(indices))
    if capacity is not None:
        slips["you kept the assignments that came last; priority is by position, earlier tokens first"] = \
            _slots_in_priority(indices, num_experts, capacity, [(t, j) for j in range(k) for t in reversed(range(tokens))])
        slips["you dropped nothing: an assignment whose expert already holds `capacity` tokens is dropped (-1)"] = \
            _slots_in_priority(indices, num_experts, None, choice_major)
        slips[f"an expert holds slots 0 to C-1 = {capacity - 1}: you let it take one more"] = \
            _slots_in_priority(indices, num_experts, capacity + 1, choice_major)
    return slips


@exercise("ep.slots", points=2)
class Slots(Check):
    """Verifies: every assignment's slot or -1 for top-1, top-2 and top-3 routing on skewed random
    choices, with a capacity two or more below the largest load, a capacity exactly equal to one
    expert's load, and dropless (capacity None).
    Fakes: dtp.moe.assign_slots trips; fresh choices each run.
    """

    reads = ("assign_slots",)
    references = ("dtp.moe.assign_slots",)
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for k in (1, 2, 3):
            experts = int(rng.integers(k + 1, 9))
            tokens = int(rng.integers(8, 40))
            while True:  # the first capacity leaves some expert two or more over: every slip shows
                indices = _skewed_choices(rng, tokens, experts, k)
                loads = np.bincount(indices.reshape(-1), minlength=experts)
                tight = moe.expert_capacity(tokens, experts, k, float(rng.choice([0.5, 0.75])))
                if loads.max() >= tight + 2:
                    break
            for capacity in (tight, int(rng.choice(loads[loads > 0])), None):
                cases.append((indices, experts, capacity))
        return cases

    def collect(self, student, cases):
        return [student.assign_slots(indices.copy(), experts, capacity) for indices, experts, capacity in cases]

    def judge(self, cases, answers) -> str:
        expect(len(answers) == len(cases), "the grader's calls did not all return")
        for (indices, experts, capacity), answer in zip(cases, answers):
            what = f"assign_slots(top-{indices.shape[1]} choices of {indices.shape[0]} tokens, {experts} experts, " \
                   f"capacity={capacity})"
            slots = _integers(answer, indices.shape, "the slots", what)
            expected = moe.assign_slots(indices, experts, capacity)
            if np.array_equal(slots, expected):
                continue
            slip = _first_slip(slots, _slot_slips(indices, experts, capacity))
            if slip:
                raise CheckFailed(f"{what}: {slip}")
            token, choice = np.argwhere(slots != expected)[0]
            raise CheckFailed(f"{what}: token {token}'s choice {choice + 1} (expert {indices[token, choice]}) got "
                              f"slot {slots[token, choice]}, expected {expected[token, choice]} (-1: dropped)")
        return ("slots and drops by position, first choices before second ones, for top-1, top-2 and top-3, with "
                "capacities below, at and above the load, and dropless")


def _layer_from(x, w_in, w_out, indices, weights, slots) -> np.ndarray:
    """Σ over kept assignments of gate weight · expert(token): the layer for given routing."""
    output = np.zeros_like(x)
    for token, choice in zip(*np.nonzero(slots >= 0)):
        expert = indices[token, choice]
        output[token] += weights[token, choice] * moe.expert_mlp(x[token], w_in[expert], w_out[expert])
    return output


def _layer_slips(x, router_weight, w_in, w_out, k, capacity, renormalize) -> dict[str, np.ndarray]:
    experts = router_weight.shape[1]
    indices, weights = moe.top_k_routing(x @ router_weight, k, renormalize)
    slots = moe.assign_slots(indices, experts, capacity)
    kept = slots >= 0
    slips = {}
    if capacity is not None:
        kept_sum = np.where(kept, weights, 0).sum(axis=1, keepdims=True)
        if k > 1:
            slips["you renormalised the gate weights after dropping; a dropped assignment's weight is simply lost, "
                  "the kept ones stay as routed"] = _layer_from(x, w_in, w_out, indices,
                                                                np.divide(weights, kept_sum, where=kept_sum > 0,
                                                                          out=np.zeros_like(weights)), slots)
        slips["no assignment was dropped: apply the capacity (an expert takes at most `capacity` tokens)"] = \
            moe.moe_layer(x, router_weight, w_in, w_out, k, None, renormalize)
        probabilities = np.take_along_axis(moe.softmax(x @ router_weight), indices, axis=1)
        assignments = list(zip(*np.nonzero(np.ones_like(slots))))
        slips["you dropped by probability (the most confident assignments first); this chapter drops by position, as "
              "the Switch Transformer does"] = [  # by router probability, or by (renormalised) gate weight
            _layer_from(x, w_in, w_out, indices, weights, _slots_in_priority(
                indices, experts, capacity, sorted(assignments, key=lambda tj: -priority[tj])))
            for priority in (probabilities, weights)]
        if k > 1:
            slips["you gave priority token by token; every first choice comes before any second choice"] = _layer_from(
                x, w_in, w_out, indices, weights, _slots_in_priority(indices, experts, capacity, _token_major(indices)))
    unweighted = _layer_from(x, w_in, w_out, indices, np.ones_like(weights), slots)
    if k == 1 and capacity is not None:  # renormalising one kept weight gives 1: the two mistakes coincide
        slips["every gate weight is 1: either the expert outputs are not multiplied by their gate weights, or you "
              "renormalised the gate weights after dropping (a lone kept weight becomes 1)"] = unweighted
    slips["the expert outputs are not multiplied by their gate weights"] = unweighted
    return slips


def _sorted_rows(array: np.ndarray) -> np.ndarray:
    return array[np.lexsort(array.T[::-1])]


def _explain_layer_output(output: np.ndarray, layer: tuple, what: str) -> None:
    """Compare a layer's output with the reference for `layer` = (x, router, w_in, w_out, k,
    capacity, renormalize); name a known mistake when the output is one, else show the routing of
    the worst token."""
    expected = moe.moe_layer(*layer)
    expect(isinstance(output, np.ndarray), f"{what} should be an array or tensor, not {type(output).__name__}")
    if output.shape != expected.shape or not np.all(np.isfinite(output)) \
            or np.allclose(output, expected, rtol=1e-7, atol=1e-9):
        expect_close(output, expected, what, rtol=1e-7, atol=1e-9, check_dtype=False)
        return
    slip = _first_slip(output, _layer_slips(*layer), rtol=1e-7, atol=1e-9)
    if slip:
        raise CheckFailed(f"{what}: {slip}")
    if np.allclose(_sorted_rows(output), _sorted_rows(expected), rtol=1e-7, atol=1e-9):
        raise CheckFailed(f"{what}: every output row is right but belongs to another token: combine must put each "
                          "expert result back at the token (and choice) whose slot it was computed in")
    x, router, _, _, k, capacity, renormalize = layer
    indices, weights = moe.top_k_routing(x @ router, k, renormalize)
    slots = moe.assign_slots(indices, router.shape[1], capacity)
    token = int(np.argmax(np.abs(output - expected).max(axis=1)))
    raise CheckFailed(f"{what}: token {token}'s output differs most (max abs error "
                      f"{np.abs(output - expected).max():.3g}); it chose experts {indices[token].tolist()} with gate "
                      f"weights {np.round(weights[token], 4).tolist()} and got slots {slots[token].tolist()} (-1: dropped). "
                      "Check that combine reads each assignment's result from the slot (or row) it was dispatched to, "
                      "and multiplies it by that assignment's gate weight")


def _random_layer(rng, tokens: int, experts: int, k: int, skew: float = 1.0):
    d, f = int(rng.integers(3, 9)), int(rng.integers(2, 9))
    x = rng.standard_normal((tokens, d))
    router = rng.standard_normal((d, experts)) + skew * rng.standard_normal(experts)  # some experts popular
    return x, router, rng.standard_normal((experts, d, f)) / np.sqrt(d), rng.standard_normal((experts, f, d))


@exercise("ep.moe_layer", points=2)
class MoELayer(Check):
    """Verifies: the layer's output for top-1, top-2 and top-3 routing, renormalised and not, with
    capacities that drop assignments (a top-2 token losing one expert and keeping the other
    included) and dropless, against dtp.moe's one-hot layer.
    Fakes: dtp.moe's layer, router and slots trip; fresh random weights each run.
    """

    reads = ("moe_layer",)
    references = LAYER_REFERENCES
    timeout_s = 20

    def prepare(self, rng):
        cases = []
        for k, renormalize, factor in ((1, False, 0.75), (2, True, 0.75), (2, False, None), (3, True, 1.0),
                                       (2, True, 0.5), (1, True, None)):
            experts, tokens = int(rng.integers(k + 2, 9)), int(rng.integers(10, 40))
            while True:
                layer = _random_layer(rng, tokens, experts, k)
                capacity = None if factor is None else moe.expert_capacity(tokens, experts, k, factor)
                indices, _ = moe.top_k_routing(layer[0] @ layer[1], k, renormalize)
                kept = moe.assign_slots(indices, experts, capacity) >= 0
                if capacity is None or (0 < kept.sum(axis=1)).any() and (kept.sum(axis=1) < k).any():
                    break  # with capacity, some token keeps part of its choices: dropping is visible
            cases.append((*layer, k, capacity, renormalize))
        return cases

    def collect(self, student, cases):
        return [student.moe_layer(*(a.copy() for a in case[:4]), *case[4:]) for case in cases]

    def judge(self, cases, outputs) -> str:
        expect(len(outputs) == len(cases), "the grader's calls did not all return")
        for case, output in zip(cases, outputs):
            x, router, w_in, w_out, k, capacity, renormalize = case
            what = (f"moe_layer({x.shape[0]} tokens, {router.shape[1]} experts, k={k}, capacity={capacity}, "
                    f"renormalize={renormalize})")
            expect(isinstance(output, np.ndarray), f"{what} should return a numpy array, not {type(output).__name__}")
            _explain_layer_output(output, case, what)
        return ("equal to the one-hot reference for top-1, top-2 and top-3, renormalised and not, with dropping "
                "capacities and dropless")


# --- 3. balancing losses ----------------------------------------------------------------------

@exercise("ep.balancing_loss", points=2)
class BalancingLoss(Check):
    """Verifies: value and gradient with respect to the logits of the Switch load-balancing loss
    (random alpha, and the default 0.01) for top-1 and top-2 routing, and of the router z-loss
    (random coefficient and the default 0.001), also for logits near 800 (float64 exp overflows).
    Fakes: dtp.moe's losses trip; a value without a gradient, or with f carrying gradient, fails
    on the gradient.
    """

    reads = ("load_balancing_loss", "router_z_loss")
    references = ("dtp.moe.load_balancing_loss", "dtp.moe.router_z_loss", "dtp.moe.dispatched_fractions",
                  "dtp.moe.load_balancing_loss_and_gradient", "dtp.moe.router_z_loss_and_gradient")
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for k, alpha in ((1, None), (2, float(rng.uniform(1e-3, 1e-1))), (2, None), (1, float(rng.uniform(1e-3, 1.0)))):
            experts, tokens = int(rng.integers(k + 2, 12)), int(rng.integers(6, 60))
            logits = rng.standard_normal((tokens, experts)) * 2 + rng.standard_normal(experts)
            indices, _ = moe.top_k_routing(logits, k, True)
            cases.append({"logits": logits, "indices": indices, "alpha": alpha, "coefficient": None})
        for offset, coefficient in ((0.0, float(rng.uniform(1e-4, 1e-2))), (800.0, None)):
            logits = rng.standard_normal((int(rng.integers(6, 30)), int(rng.integers(3, 10)))) * 3 + offset
            cases.append({"logits": logits, "indices": None, "alpha": None, "coefficient": coefficient})
        return cases

    def collect(self, student, cases):
        with _one_thread():
            return [self._loss(student, case) for case in cases]

    @staticmethod
    def _loss(student, case) -> dict:
        logits = torch.tensor(case["logits"], requires_grad=True)
        if case["indices"] is not None:
            kwargs = {} if case["alpha"] is None else {"alpha": case["alpha"]}
            loss = student.load_balancing_loss(logits, case["indices"].copy(), **kwargs)
        else:
            kwargs = {} if case["coefficient"] is None else {"coefficient": case["coefficient"]}
            loss = student.router_z_loss(logits, **kwargs)
        return _value_and_gradient(loss, logits)

    def judge(self, cases, results) -> str:
        expect(len(results) == len(cases), "the grader's calls did not all return")
        for case, result in zip(cases, results):
            if case["indices"] is not None:
                _judge_balancing(case, result)
            else:
                _judge_z_loss(case, result)
        return ("the load-balancing loss (top-1 and top-2, default and random alpha) and the z-loss (also for logits "
                "near 800) have the right values and gradients, only P carrying gradient")


@contextlib.contextmanager
def _one_thread():
    """Torch on one thread, as in the sandbox: for tiny tensors a pool of threads only contends
    (which matters where collect runs outside a sandbox, in tests)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _value_and_gradient(loss, logits) -> dict:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return {"wrong_type": type(loss).__name__ if not isinstance(loss, torch.Tensor) else f"shape {tuple(loss.shape)}"}
    if loss.requires_grad:
        loss.backward()
    return {"value": float(loss.detach().reshape(())), "gradient": logits.grad}


def _loss_oracle(case) -> tuple[float, np.ndarray]:
    """Value and gradient in closed form (dtp.moe; tests/test_ep_moe.py checks them against autograd)."""
    if case["indices"] is not None:
        return moe.load_balancing_loss_and_gradient(case["logits"], case["indices"],
                                                    0.01 if case["alpha"] is None else case["alpha"])
    return moe.router_z_loss_and_gradient(case["logits"], 0.001 if case["coefficient"] is None else case["coefficient"])


def _checked_value(result, what: str) -> float:
    expect("wrong_type" not in result, f"{what} should return a scalar torch tensor, not {result.get('wrong_type')}")
    return result["value"]


def _judge_balancing(case, result) -> None:
    tokens, experts = case["logits"].shape
    k = case["indices"].shape[1]
    alpha = case["alpha"]
    what = f"load_balancing_loss({tokens}×{experts} logits, top-{k}, {'default alpha' if alpha is None else f'alpha={alpha:.4g}'})"
    value, gradient = _loss_oracle(case)
    used_alpha = 0.01 if alpha is None else alpha
    probabilities = moe.softmax(case["logits"]).mean(axis=0)
    slips = {"that is alpha·E·Σ P_i²: f_i is the fraction of assignments each expert received (a count, from the "
             "indices), not its mean probability": used_alpha * experts * float(probabilities @ probabilities),
             "f is normalised by T; count it over all T·k assignments so that it sums to 1 (the loss is alpha at "
             "perfect balance)": value * k,
             "the factor E is missing (it makes the loss alpha at perfect balance, whatever E)": value / experts,
             "alpha is missing": value / used_alpha}
    expect_answer(_checked_value(result, what), value, what, rel=1e-9, slips=slips)
    _judge_gradient(result, gradient, what, "f is a count of assignments and carries no gradient; only P does "
                    "(compute f from the indices, or detach it)")


def _judge_z_loss(case, result) -> None:
    logits = case["logits"]
    coefficient = case["coefficient"]
    what = (f"router_z_loss({logits.shape[0]}×{logits.shape[1]} logits near {logits.mean():.0f}, "
            f"{'default coefficient' if coefficient is None else f'coefficient={coefficient:.4g}'})")
    used = 0.001 if coefficient is None else coefficient
    value, gradient = _loss_oracle(case)
    log_sum_exp = logits.max(axis=1) + np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1))
    actual = _checked_value(result, what)
    expect(np.isfinite(actual), f"{what} is {actual}: exp overflows for logits this large; use torch.logsumexp "
                                "(it subtracts the maximum first)")
    expect_answer(actual, value, what, rel=1e-9, slips={
        "the log-sum-exp is not squared": used * log_sum_exp.mean(),
        "that sums over tokens; the z-loss averages over them": value * logits.shape[0],
        "that squares each token's largest logit, not its log-sum-exp": used * (logits.max(axis=1) ** 2).mean(),
        "the coefficient is missing (ST-MoE's c_z is 0.001)": value / used})
    _judge_gradient(result, gradient, what, "differentiate through torch.logsumexp")


def _judge_gradient(result, expected: np.ndarray, what: str, hint: str) -> None:
    gradient = result.get("gradient")
    expect(gradient is not None and np.any(gradient != 0),
           f"{what}: the value is right, but backward() gave the logits no gradient: build the loss from torch "
           "operations on router_logits (P must carry the gradient), not from numpy or detached values")
    if not np.allclose(gradient, expected, rtol=1e-7, atol=1e-12):
        raise CheckFailed(f"{what}: the value is right but its gradient with respect to the logits is not: {hint}")


# --- 4. the expert-parallel layer on gloo -------------------------------------------------------

COUNT_EXCHANGE_BYTES_PER_EXPERT = 8  # an int64 count per expert: the only other traffic allowed


def _ep_on_rank(rank, world_size, layer, cases):
    outcomes = []
    for case in cases:
        experts = slice(rank * case["local"], (rank + 1) * case["local"])
        x = torch.tensor(case["x"][rank], requires_grad=True)
        router = torch.tensor(case["router"], requires_grad=True)
        w_in = torch.tensor(case["w_in"][experts], requires_grad=True)
        w_out = torch.tensor(case["w_out"][experts], requires_grad=True)
        with CommunicationLog() as log, moe.AllToAllLog(payloads=True) as all_to_alls:
            output = layer(x, router, w_in, w_out, case["k"], case["capacity"], case["renormalize"])
            log.mark("forward done")
            differentiable = isinstance(output, torch.Tensor) and output.requires_grad
            if differentiable:
                try:
                    (output * torch.tensor(case["upstream"][rank])).sum().backward()
                except RuntimeError as error:  # raised by the learner's backward (in autograd's engine)
                    raise CheckFailed(f"rank {rank}'s backward pass raised {str(error).splitlines()[0][:200]}: the "
                                      "backward of an all-to-all is the reverse all-to-all, rows_to and rows_from "
                                      "swapped, returning one gradient row per row forward sent") from None
            log.mark("backward done")
        outcomes.append({"output": output, "differentiable": differentiable, "events": events_as_data(log),
                         "all_to_alls": all_to_alls.calls,
                         "gradients": {name: t.grad for name, t in
                                       (("x", x), ("router", router), ("w_in", w_in), ("w_out", w_out))}})
    return outcomes


def _ep_case(rng, world_size: int, local: int, k: int, renormalize: bool, tokens: list[int], capacity_factor):
    experts = world_size * local
    d, f = int(rng.integers(4, 8)), int(rng.integers(3, 7))
    router = rng.standard_normal((d, experts)) + 1.5 * rng.standard_normal(experts)  # popular experts: drops
    x = [rng.standard_normal((t, d)) for t in tokens]
    capacity = None if capacity_factor is None else moe.expert_capacity(max(tokens), experts, k, capacity_factor)
    case = {"x": x, "router": router, "w_in": rng.standard_normal((experts, d, f)) / np.sqrt(d),
            "w_out": rng.standard_normal((experts, f, d)), "upstream": [rng.standard_normal((t, d)) for t in tokens],
            "k": k, "renormalize": renormalize, "capacity": capacity, "local": local}
    drops = capacity is not None and any((_routing(case, r)[2] < 0).any() for r in range(world_size))
    if capacity is not None and not drops:
        return _ep_case(rng, world_size, local, k, renormalize, tokens, capacity_factor)  # this test needs drops
    return case


def _routing(case, rank: int):
    indices, weights = moe.top_k_routing(case["x"][rank] @ case["router"], case["k"], case["renormalize"])
    return indices, weights, moe.assign_slots(indices, case["router"].shape[1], case["capacity"])


def _single_process(case) -> dict:
    """The oracle: each rank's tokens through the single-process layer (capacity per rank), one
    router copy per rank (its gradient is the rank's own), the experts shared."""
    w_in, w_out = torch.tensor(case["w_in"], requires_grad=True), torch.tensor(case["w_out"], requires_grad=True)
    per_rank = []
    for rank, tokens in enumerate(case["x"]):
        x, router = torch.tensor(tokens, requires_grad=True), torch.tensor(case["router"], requires_grad=True)
        output = moe.moe_layer_torch(x, router, w_in, w_out, case["k"], case["capacity"], case["renormalize"])
        (output * torch.tensor(case["upstream"][rank])).sum().backward()
        per_rank.append((x, router, output))
    result = {"x": [x.grad.numpy() for x, _, _ in per_rank], "router": [r.grad.numpy() for _, r, _ in per_rank]}
    local = case["local"]
    result["w_in"] = [w_in.grad[r * local:(r + 1) * local].numpy() for r in range(len(case["x"]))]
    result["w_out"] = [w_out.grad[r * local:(r + 1) * local].numpy() for r in range(len(case["x"]))]
    return result


def _describe(case, world_size: int) -> str:
    capacity = "dropless" if case["capacity"] is None else f"capacity {case['capacity']}"
    return (f"world {world_size}, {case['local']} experts per rank, top-{case['k']}, {capacity}, tokens per rank "
            f"{[len(x) for x in case['x']]}")


def _judge_outputs(case, outcomes, what: str) -> None:
    for rank, outcome in enumerate(outcomes):
        output = outcome["output"]
        layer = (case["x"][rank], case["router"], case["w_in"], case["w_out"], case["k"], case["capacity"],
                 case["renormalize"])
        _explain_layer_output(output, layer, f"{what}: rank {rank}'s output")


def _split_phases(outcome) -> tuple[list[dict], list[dict]]:
    """(forward, backward) collectives of one rank, each all-to-all joined with its split sizes."""
    calls = iter(outcome["all_to_alls"])
    forward, backward, phase = [], [], None
    phase = forward
    for event in outcome["events"]:
        if event["op"] == "mark":
            phase = backward if event["label"] == "forward done" else None
            continue
        if event["op"] == "wait" or phase is None:
            continue
        phase.append({**event, **(next(calls, {}) if event["op"] == "all_to_all" else {})})
    return forward, backward


def _token_exchanges(collectives: list[dict]) -> list[dict]:
    """The all-to-alls of token rows (floating point); integer ones exchange counts."""
    return [c for c in collectives if c["op"] == "all_to_all" and "float" in c.get("dtype", "")]


def _judge_collectives(case, outcomes, world_size: int, what: str) -> None:
    experts = case["router"].shape[1]
    for rank, outcome in enumerate(outcomes):
        forward, backward = _split_phases(outcome)
        for collective in forward + backward:
            if collective["op"] != "all_to_all" and collective["bytes"] > COUNT_EXCHANGE_BYTES_PER_EXPERT * experts:
                raise CheckFailed(f"{what}: rank {rank} called {collective['op']} with {collective['bytes']} bytes; "
                                  "tokens and results travel by all_to_all_single only (dispatch and combine)")
        dispatch_and_combine = _token_exchanges(forward)
        expect(len(dispatch_and_combine) == 2,
               f"{what}: rank {rank} ran {len(dispatch_and_combine)} all-to-alls of floating-point rows in the forward "
               "pass; a forward pass runs two: the dispatch and the combine (dropless, the counts go first, as an "
               "integer tensor)")
        expect(outcome["differentiable"], f"{what}: rank {rank}'s output does not require grad: autograd cannot go "
                                          "back through dist.all_to_all_single; wrap it in a torch.autograd.Function")
        reverse = _token_exchanges(backward)
        expect(len(reverse) == 2,
               f"{what}: rank {rank} ran {len(reverse)} all-to-alls in the backward pass; the backward of an "
               "all-to-all is the reverse all-to-all (input and output split sizes swapped), so backward runs two: "
               "write them in your autograd Function's backward")


def _match_rows(chunk: np.ndarray, wanted: np.ndarray, rtol: float) -> int:
    """How many of the `wanted` rows appear in `chunk` (each chunk row used once)."""
    available = list(range(len(chunk)))
    found = 0
    for row in wanted:
        for position in available:
            if np.allclose(chunk[position], row, rtol=rtol, atol=1e-12):
                available.remove(position)
                found += 1
                break
    return found


def _judge_dataflow(case, outcomes, world_size: int, what: str) -> None:
    """Dispatch: rank r's piece for rank q holds the token of every kept assignment of r to an
    expert of q (and, with capacity, exactly E/n·C rows). Combine: rank q's piece for rank r holds
    the expert output of each of those assignments."""
    local, capacity = case["local"], case["capacity"]
    for source in range(world_size):
        indices, _, slots = _routing(case, source)
        dispatch = _token_exchanges(_split_phases(outcomes[source])[0])[0]
        kept_token, kept_choice = np.nonzero(slots >= 0)
        owners = moe.expert_owner(indices[kept_token, kept_choice], case["router"].shape[1], world_size)
        for destination in range(world_size):
            mine = owners == destination
            tokens, chosen = kept_token[mine], indices[kept_token[mine], kept_choice[mine]]
            rows = np.asarray(dispatch["payload"][destination]).reshape(-1, case["x"][source].shape[1]) \
                if destination < len(dispatch["payload"]) else np.zeros((0, case["x"][source].shape[1]))
            expected_rows = local * capacity if capacity is not None else len(tokens)
            expect(len(rows) == expected_rows,
                   f"{what}: rank {source} sent rank {destination} {len(rows)} rows in the dispatch; "
                   + (f"with capacity {capacity} every rank sends each rank its E/n·C = {expected_rows} slots"
                      if capacity is not None else
                      f"dropless, it sends one row per assignment to that rank's experts: {expected_rows}"))
            found = _match_rows(rows, case["x"][source][tokens], rtol=1e-12)
            expect(found == len(tokens),
                   f"{what}: of the {len(tokens)} tokens rank {source} routes to rank {destination}'s experts, only "
                   f"{found} were in its dispatch to that rank: send each kept assignment's token row, unchanged")
            combine = _token_exchanges(_split_phases(outcomes[destination])[0])[1]
            results = [moe.expert_mlp(case["x"][source][t], case["w_in"][e], case["w_out"][e])
                       for t, e in zip(tokens, chosen)]
            returned = np.asarray(combine["payload"][source]).reshape(-1, case["x"][source].shape[1]) \
                if source < len(combine["payload"]) else np.zeros((0, case["x"][source].shape[1]))
            found = _match_rows(returned, results, rtol=1e-9)
            expect(found == len(tokens),
                   f"{what}: rank {destination}'s combine to rank {source} held {found} of the {len(tokens)} expert "
                   "outputs that rank's tokens needed: the expert's rank computes them and sends them back unweighted "
                   "in the combine all-to-all")


def _judge_bytes(case, outcomes, world_size: int, what: str) -> None:
    d, experts = case["router"].shape
    if case["capacity"] is None:
        expected = moe.dropless_all_to_all_bytes([_routing(case, r)[0] for r in range(world_size)], experts, d, 8)
    else:
        expected = [moe.capacity_all_to_all_bytes(world_size, experts, case["capacity"], d, 8)] * world_size
    for rank, outcome in enumerate(outcomes):
        forward, backward = _split_phases(outcome)
        sent = sum(sum(c["bytes_to"]) - c["bytes_to"][rank] for c in _token_exchanges(forward + backward))
        expect(sent == expected[rank],
               f"{what}: rank {rank} sent {sent} bytes of token rows to other ranks over forward and backward; the "
               f"formula gives {expected[rank]}" + (" (dropless sends only real rows: no padding)"
                                                    if case["capacity"] is None else ""))


def _judge_gradients(case, outcomes, oracle, what: str) -> None:
    for rank, outcome in enumerate(outcomes):
        for name, label in (("x", "x"), ("router", "the router weight"), ("w_in", "w_in"), ("w_out", "w_out")):
            gradient = outcome["gradients"][name]
            expect(gradient is not None, f"{what}: rank {rank}'s {label} received no gradient: the output must depend "
                                         "on it through autograd (gates from the router's softmax, experts through "
                                         "the differentiable all-to-alls)")
            if not np.allclose(gradient, oracle[name][rank], rtol=1e-7, atol=1e-10):
                raise CheckFailed(
                    f"{what}: the outputs are right but rank {rank}'s gradient of {label} is not "
                    f"(max error {np.abs(gradient - oracle[name][rank]).max():.3g}): each backward all-to-all must "
                    "send every row's gradient back to the rank that sent the row (input and output split sizes "
                    "swapped)" + (", and the router's gradient comes through the gate weights" if name == "router"
                                  else ""))


class ExpertParallelCheck(Check):
    reads = ("expert_parallel_moe",)
    references = TORCH_DIFFERENTIABLE_ALL_TO_ALL
    timeout_s = 40
    runs_world = True
    dropless = False

    def worlds(self, rng) -> list[tuple[int, list]]:
        raise NotImplementedError

    def prepare(self, rng):
        return self.worlds(rng)

    def collect(self, student, worlds):
        return run_worlds(_ep_on_rank, [(n, (student.expert_parallel_moe, cases)) for n, cases in worlds])

    def judge(self, worlds, outcomes) -> str:
        done, failure = completed_worlds(outcomes)
        for (n, cases), per_rank in zip(worlds, done):
            for index, case in enumerate(cases):
                what = _describe(case, n)
                ranks = [per_rank[rank][index] for rank in range(n)]
                oracle = _single_process(case)
                _judge_outputs(case, ranks, what)
                _judge_collectives(case, ranks, n, what)
                _judge_dataflow(case, ranks, n, what)
                _judge_bytes(case, ranks, n, what)
                _judge_gradients(case, ranks, oracle, what)
        raise_world_failure(failure)
        return self.summary


@exercise("ep.expert_parallel_capacity", points=3)
class ExpertParallelCapacity(ExpertParallelCheck):
    """Verifies: on 2 and 4 gloo ranks with 3 and 2 experts per rank, top-1 and top-2, with a
    capacity that drops tokens: every rank's output and the gradients of its tokens, its router
    copy and its experts equal the single-process layer's (capacity per rank); the forward runs two
    all-to-alls of token rows and the backward two; each rank's dispatch to each rank is its E/n·C
    slots holding the right token rows, each combine holds the expert outputs its tokens need; the
    bytes sent to other ranks equal 4(n-1)/n·E·C·h·w.
    Fakes: torch's differentiable all-to-alls trip; all_gather, broadcast or point-to-point
    traffic beyond the count exchange is refused; results computed another way (the store, a file)
    fail on the rows each all-to-all carried.
    """

    summary = ("outputs and gradients (x, router, experts) equal the single-process layer on 2 and 4 ranks with "
               "dropped tokens; 2 all-to-alls forward and 2 backward, each carrying the right rows, 4(n-1)/n·E·C·h·w "
               "bytes per rank")

    def worlds(self, rng):
        worlds = []
        for n, local in ((2, 3), (4, 2)):
            tokens = [int(rng.integers(6, 16))] * n
            cases = [_ep_case(rng, n, local, 2, True, tokens, float(rng.choice([0.5, 0.75]))),
                     _ep_case(rng, n, local, 1, False, tokens, 1.0)]
            worlds.append((n, cases))
        return worlds


@exercise("ep.expert_parallel_dropless", points=3)
class ExpertParallelDropless(ExpertParallelCheck):
    """Verifies: dropless routing on 2 and 4 gloo ranks with 2 and 3 experts per rank, top-1 and
    top-2, ranks holding different numbers of tokens (one of them a single token, so that some
    splits are empty): outputs and all gradients equal the single-process layer's; two
    all-to-alls of token rows forward and two backward (plus at most a small integer count
    exchange); each dispatch piece is exactly the rows routed to that rank, each combine piece the
    expert outputs they need; bytes equal 2(out + in)·h·w, so no padding.
    Fakes: as for the fixed-capacity layer; padding to equal splits fails on the bytes.
    """

    summary = ("dropless outputs and gradients equal the single-process layer on 2 and 4 ranks with uneven (and "
               "empty) splits; 2 all-to-alls forward and 2 backward carrying exactly the routed rows, 2(out+in)·h·w "
               "bytes per rank")

    def worlds(self, rng):
        worlds = []
        for n, local in ((2, 2), (4, 3)):
            tokens = [int(rng.integers(3, 20)) for _ in range(n)]
            tokens[int(rng.integers(n))] = 1
            cases = [_ep_case(rng, n, local, 2, True, tokens, None), _ep_case(rng, n, local, 1, False, tokens, None)]
            worlds.append((n, cases))
        return worlds


# --- 5. bytes -----------------------------------------------------------------------------------

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
            routings = [_skewed_choices(rng, int(rng.integers(1, 30)), n * local, k) for _ in range(n)]
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


# --- 6. numeric questions -------------------------------------------------------------------------

INTERVIEW_ANSWERS = ("interview_capacity", "interview_total_parameters_b", "interview_active_parameters_b",
                     "interview_gpus_if_ep_multiplies", "interview_expert_copies")


@exercise("ep.interview", points=2)
class Interview(FixedAnswers):
    """Verifies: five fixed answers (a capacity, Mixtral 8x7B's total and active parameters from
    dtp.moe's counts, which tests check against a torch model's numel, and the source notes'
    layout). Fakes: a fixed question, so a copied number passes; it is worth two points for that."""

    reads = INTERVIEW_ANSWERS

    def judge(self, inputs, answers) -> str:
        capacity, total, active, gpus, copies = answers
        expect_answer(capacity, moe.expert_capacity(4096, 64, 2, 1.25), "interview_capacity", slips={
            "k is missing: 4096 tokens make 2·4096 assignments": 80,
            "the capacity factor is missing: C = ceil(1.25 · T·k/E)": 128})
        counts = moe.moe_parameter_counts(moe.MIXTRAL_8X7B)
        expect_answer(total, counts["total"] / 1e9, "interview_total_parameters_b", rel=1e-3, slips={
            "that is in parameters; answer in billions": counts["total"],
            "each SwiGLU expert has three matrices, not two": (counts["total"] - 32 * 8 * 4096 * 14336) / 1e9})
        expect_answer(active, counts["active"] / 1e9, "interview_active_parameters_b", rel=1e-3, slips={
            "a token uses 2 experts per block, not 1": (counts["active"] - 32 * counts["expert"]) / 1e9,
            "that is in parameters; answer in billions": counts["active"]})
        expect_answer(gpus, 8 * 8 * 8 * 16, "interview_gpus_if_ep_multiplies", slips={
            "that is the 1024 of the notes, where EP is not a separate factor": 1024})
        expect_answer(copies, 16 // 8, "interview_expert_copies", slips={
            "that is every data-parallel rank: without EP all 16 would hold every expert; with EP = 8 each group of "
            "8 shares out the experts, so each shard lives on 16/8 GPUs": 16,
            "that is the EP group size; each expert's shard lives once per EP group": 8})
        return "all five answers are right"
