"""Exercise 2: the capacity rule, slots (which assignments an expert keeps) and the single-process
MoE layer. The layer's diagnosis of a wrong output (`explain_layer_output`) also judges every
rank's output of the expert-parallel layer."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from dtp.ep import moe

from ...compare import CheckFailed, expect, expect_close
from ...registry import Check, exercise
from ..references import refuses_library
from ..common import FormulaCheck
from .shared import MOE, integer_array, known_mistake, skewed_choices

CAPACITY_FACTORS = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0)  # exact in binary: no rounding to argue about


@exercise("ep.capacity", points=1)
@refuses_library(MOE)
class Capacity(FormulaCheck):
    """Verifies: ceil(capacity_factor · T · k / E) on random sizes, where the quotient is a whole
    number (the ceiling changes nothing) and where it is not; every grading has a fractional part
    below one half (round() rounds down there), a top-k with k > 1 whose capacity changes without
    k, and one where rounding T·cf/E up before multiplying by k gives more.
    Fakes: dtp.ep.moe.expert_capacity trips; fresh sizes each run."""

    function = "expert_capacity"
    summary = "ceil(capacity_factor · T · k / E) on random sizes, whole quotients and fractional ones"

    def cases(self, rng):
        while True:  # six fractional quotients that, together, tell every slip from the ceiling
            fractional = [_fractional_capacity_case(rng) for _ in range(6)]
            if all(any(separates(*args) for args in fractional) for separates in CAPACITY_SEPARATIONS):
                break
        cases = [(args, {}) for args in fractional]
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
                "k is missing: each token makes k assignments, T·k in all": float(np.ceil(factor * tokens / experts)),
                "you rounded capacity_factor · T / E up before multiplying by k; round once, at the end: "
                "ceil(capacity_factor · T · k / E)": k * float(np.ceil(factor * tokens / experts))}


def _fractional_capacity_case(rng) -> tuple:
    while True:
        args = (int(rng.integers(1, 5000)), int(rng.choice([3, 6, 8, 12, 16, 64, 128])), int(rng.integers(1, 5)),
                float(rng.choice(CAPACITY_FACTORS)))
        if _exact_capacity(*args).denominator > 1:
            return args


def _exact_capacity(tokens, experts, k, factor) -> Fraction:
    return Fraction(factor) * tokens * k / experts


# Conditions on one case under which a slip of expert_capacity gives another number than the right
# one; every grading has a case meeting each (a fractional quotient already refutes floor and no rounding).
CAPACITY_SEPARATIONS = (
    lambda *args: _exact_capacity(*args) % 1 < Fraction(1, 2),  # round() rounds down
    lambda tokens, experts, k, factor: math.ceil(_exact_capacity(tokens, experts, 1, factor))
    != math.ceil(_exact_capacity(tokens, experts, k, factor)),  # k left out
    lambda tokens, experts, k, factor: k * math.ceil(_exact_capacity(tokens, experts, 1, factor))
    != math.ceil(_exact_capacity(tokens, experts, k, factor)),  # rounded before multiplying by k
)


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
        slips[f"an expert keeps at most C = {capacity} assignments, in slots 0 to C-1; you let it keep C + 1"] = \
            _slots_in_priority(indices, num_experts, capacity + 1, choice_major)
    return slips


def _every_slip_shows(indices: np.ndarray, num_experts: int, capacity) -> bool:
    """No known mistake gives the right slots for these choices (token by token priority, say, can
    fill the experts in the same order by chance)."""
    expected = moe.assign_slots(indices, num_experts, capacity)
    return not any(np.array_equal(slips, expected) for slips in _slot_slips(indices, num_experts, capacity).values())


@exercise("ep.slots", points=2)
@refuses_library(MOE)
class Slots(Check):
    """Verifies: every assignment's slot or -1 for top-1, top-2 and top-3 routing on skewed random
    choices, with a capacity two or more below the largest load, a capacity exactly equal to one
    expert's load, and dropless (capacity None); the tight capacity is drawn so that every known
    slip (token-by-token priority, last first, no drops, one slot too many) gives other slots.
    Fakes: dtp.ep.moe.assign_slots trips; fresh choices each run.
    """

    reads = ("assign_slots",)
    timeout_s = 15

    def prepare(self, rng):
        cases = []
        for k in (1, 2, 3):
            experts = int(rng.integers(k + 1, 9))
            tokens = int(rng.integers(8, 40))
            while True:  # the first capacity leaves some expert two or more over, and every slip shows in it
                indices = skewed_choices(rng, tokens, experts, k)
                loads = np.bincount(indices.reshape(-1), minlength=experts)
                tight = moe.expert_capacity(tokens, experts, k, float(rng.choice([0.5, 0.75])))
                if loads.max() >= tight + 2 and _every_slip_shows(indices, experts, tight):
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
            slots = integer_array(answer, indices.shape, "the slots", what)
            expected = moe.assign_slots(indices, experts, capacity)
            if np.array_equal(slots, expected):
                continue
            slip = known_mistake(slots, _slot_slips(indices, experts, capacity))
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


def layer_slips(x, router_weight, w_in, w_out, k, capacity, renormalize) -> dict[str, np.ndarray]:
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
    else:
        slips["the expert outputs are not multiplied by their gate weights"] = unweighted
    return slips


def _sorted_rows(array: np.ndarray) -> np.ndarray:
    return array[np.lexsort(array.T[::-1])]


def explain_layer_output(output: np.ndarray, layer: tuple, what: str) -> None:
    """Compare a layer's output with the reference for `layer` = (x, router, w_in, w_out, k,
    capacity, renormalize); name a known mistake when the output is one, else show the routing of
    the worst token."""
    expected = moe.moe_layer(*layer)
    expect(isinstance(output, np.ndarray), f"{what} should be an array or tensor, not {type(output).__name__}")
    if output.shape != expected.shape or not np.all(np.isfinite(output)) \
            or np.allclose(output, expected, rtol=1e-7, atol=1e-9):
        expect_close(output, expected, what, rtol=1e-7, atol=1e-9, check_dtype=False)
        return
    slip = known_mistake(output, layer_slips(*layer), rtol=1e-7, atol=1e-9)
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


def partly_dropped(layer: tuple) -> bool:
    """For `layer` = (x, router, w_in, w_out, k, capacity, renormalize): some token keeps part of
    its k choices (top-1: some token is dropped and some kept), so that dropping shows."""
    x, router, _, _, k, capacity, renormalize = layer
    indices, _ = moe.top_k_routing(x @ router, k, renormalize)
    kept = (moe.assign_slots(indices, router.shape[1], capacity) >= 0).sum(axis=1)
    return bool(((kept > 0) & (kept < k)).any()) if k > 1 else bool(kept.min() == 0 and kept.max() == 1)


def every_layer_slip_shows(layer: tuple) -> bool:
    """With a capacity the layer drops part of some token's choices, and no known mistake gives the
    right output (priority by probability or token by token can keep the same assignments by
    chance). Dropless top-1 with renormalised gates is exempt: its gates are 1, so the unweighted
    layer is right there, and the other cases catch it."""
    _, _, _, _, k, capacity, renormalize = layer
    if capacity is None and k == 1 and renormalize:
        return True
    if capacity is not None and not partly_dropped(layer):
        return False
    expected = moe.moe_layer(*layer)
    return not any(np.allclose(value, expected, rtol=1e-7, atol=1e-9) for values in layer_slips(*layer).values()
                   for value in (values if isinstance(values, list) else [values]))


@exercise("ep.moe_layer", points=2)
@refuses_library(MOE)
class MoELayer(Check):
    """Verifies: the layer's output for top-1, top-2 and top-3 routing, renormalised and not, with
    capacities that drop assignments (a top-2 token losing one expert and keeping the other
    included) and dropless, against dtp.ep.moe's one-hot layer; each case is drawn so that every
    known slip (renormalising after dropping, dropping by probability, token-by-token priority,
    no dropping, no gate weights) gives another output.
    Fakes: dtp.ep.moe's layer, router and slots trip; fresh random weights each run.
    """

    reads = ("moe_layer",)
    timeout_s = 20

    def prepare(self, rng):
        cases = []
        for k, renormalize, factor in ((1, False, 0.75), (2, True, 0.75), (2, False, None), (3, True, 1.0),
                                       (2, True, 0.5), (1, True, None)):
            experts, tokens = int(rng.integers(k + 2, 9)), int(rng.integers(10, 40))
            while True:
                layer = _random_layer(rng, tokens, experts, k)
                capacity = None if factor is None else moe.expert_capacity(tokens, experts, k, factor)
                if every_layer_slip_shows((*layer, k, capacity, renormalize)):
                    break
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
            explain_layer_output(output, case, what)
        return ("equal to the one-hot reference for top-1, top-2 and top-3, renormalised and not, with dropping "
                "capacities and dropless")

