"""The expert-parallel checks draw, in every grading, the cases that tell the right answer from its
known near-misses, and their feedback names a mistake only when it is the one that fits (all of
them when several give the same answer). The near-misses are written out here, apart from the
checks' own slip tables, where they are simple enough to."""
import math
from fractions import Fraction

import numpy as np
import pytest

from conftest import assert_every_slip_refused, numbers_slips_refused, refused_with, words
from dtp.ep import moe, routing
from grader.checks.ep import all_to_all_bytes, bias_balancing, expert_parallel, losses, node_limited, router, tp_ep
from grader.checks.ep import layer as layer_checks
from grader.checks.ep.layer import layer_slips
from grader.compare import CheckFailed
from grader.registry import find_exercise

SEEDS = range(200)


def prepared(exercise_id: str, seed: int):
    return find_exercise(exercise_id).check.prepare(np.random.default_rng(seed))


def rejected(exercise_id: str, inputs, answers) -> str:
    with pytest.raises(CheckFailed) as failure:
        find_exercise(exercise_id).check.judge(inputs, answers)
    return str(failure.value)


# --- every grading separates the near-misses ---

def test_capacity_draws_separate_round_no_k_and_early_rounding_in_every_grading():
    near_misses = {
        "round": lambda t, e, k, f: round(f * t * k / e),
        "k left out": lambda t, e, k, f: math.ceil(Fraction(f) * t / e),
        "rounded before multiplying by k": lambda t, e, k, f: k * math.ceil(Fraction(f) * t / e),
        "floor": lambda t, e, k, f: math.floor(Fraction(f) * t * k / e),
        "int() + 1": lambda t, e, k, f: int(f * t * k / e) + 1,
    }
    for seed in SEEDS:
        cases = [args for args, _ in prepared("ep.capacity", seed)]
        for name, near_miss in near_misses.items():
            assert any(near_miss(*args) != moe.expert_capacity(*args) for args in cases), (seed, name)


def token_major_slots(indices, num_experts, capacity):
    slots, filled = np.full(indices.shape, -1), np.zeros(num_experts, dtype=int)
    for token in range(indices.shape[0]):
        for choice in range(indices.shape[1]):
            expert = indices[token, choice]
            if capacity is None or filled[expert] < capacity:
                slots[token, choice], filled[expert] = filled[expert], filled[expert] + 1
    return slots


def test_slots_draws_separate_token_by_token_priority_in_every_grading():
    for seed in SEEDS:
        cases = prepared("ep.slots", seed)
        for k in (2, 3):  # with a capacity that drops, and dropless
            for with_capacity in (True, False):
                assert any(not np.array_equal(token_major_slots(*case), moe.assign_slots(*case)) for case in cases
                           if case[0].shape[1] == k and (case[2] is not None) == with_capacity), (seed, k)


def renormalised_after_dropping(x, router, w_in, w_out, k, capacity, renormalize):
    indices, weights = moe.top_k_routing(x @ router, k, renormalize)
    kept = moe.assign_slots(indices, router.shape[1], capacity) >= 0
    weights = np.where(kept, weights, 0.0)
    weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), 1e-300)
    output = np.zeros_like(x)
    for token, choice in zip(*np.nonzero(kept)):
        expert = indices[token, choice]
        output[token] += weights[token, choice] * moe.expert_mlp(x[token], w_in[expert], w_out[expert])
    return output


def test_moe_layer_draws_separate_every_slip_in_every_grading():
    for seed in range(60):
        for layer in prepared("ep.moe_layer", seed):
            k, capacity, renormalize = layer[4:]
            right = moe.moe_layer(*layer)
            if capacity is not None and k > 1:
                assert not np.allclose(renormalised_after_dropping(*layer), right), seed
            if capacity is None and k == 1 and renormalize:
                continue  # a renormalised top-1 gate is 1: the unweighted layer is right here
            for feedback, values in layer_slips(*layer).items():
                for value in values if isinstance(values, list) else [values]:
                    assert not np.allclose(value, right, rtol=1e-7, atol=1e-9), (seed, feedback)


def test_expert_parallel_capacity_draws_drop_part_of_a_token_and_separate_every_slip():
    for seed in range(30):
        for n, cases in prepared("ep.expert_parallel_capacity", seed):
            for case in cases:
                layers = [(case["x"][r], case["router"], case["w_in"], case["w_out"], case["k"], case["capacity"],
                           case["renormalize"]) for r in range(n)]
                kept = [(expert_parallel._routing(case, r)[2] >= 0).sum(axis=1) for r in range(n)]
                if case["k"] > 1:
                    assert any(((kept_r > 0) & (kept_r < case["k"])).any() for kept_r in kept), seed
                    assert any(not np.allclose(renormalised_after_dropping(*layer), moe.moe_layer(*layer))
                               for layer in layers), seed
                assert any((kept_r < case["k"]).any() for kept_r in kept), seed  # something is dropped


def test_expert_parallel_dropless_draws_have_unequal_splits_between_some_pair_of_ranks():
    for seed in range(100):
        for n, cases in prepared("ep.expert_parallel_dropless", seed):
            for case in cases:
                sent = np.zeros((n, n), dtype=int)
                for source in range(n):
                    for expert in expert_parallel._routing(case, source)[0].reshape(-1):
                        sent[source, expert // case["local"]] += 1
                assert not np.array_equal(sent, sent.T), seed  # rows_to != rows_from on some rank
                assert min(len(x) for x in case["x"]) == 1 and len({len(x) for x in case["x"]}) > 1, seed


def test_dropless_bytes_draws_separate_every_slip_and_include_top_2():
    for seed in SEEDS:
        dropless = prepared("ep.all_to_all_bytes", seed)["dropless"]
        assert any(routings[0].shape[1] == 2 for routings, *_ in dropless), seed
        right = [moe.dropless_all_to_all_bytes(*case) for case in dropless]
        first_choices = [moe.dropless_all_to_all_bytes([r[:, :1] for r in routings], *rest)
                         for routings, *rest in dropless]
        assert first_choices != right, seed
        as_if_received_equals_sent = []
        for routings, experts, d, b in dropless:
            n = len(routings)
            out = [int(np.sum(r.reshape(-1) // (experts // n) != rank)) for rank, r in enumerate(routings)]
            as_if_received_equals_sent.append([4 * o * d * b for o in out])
        assert as_if_received_equals_sent != right, seed


# --- feedback names the mistake that fits, and every one that fits equally ---

def test_slots_name_both_mistakes_when_one_slot_too_many_is_the_same_as_dropping_nothing():
    indices = np.array([[0], [0], [0], [1]])  # expert 0 gets 3 tokens, capacity 2: C + 1 drops nothing
    feedback = rejected("ep.slots", [(indices, 2, 2)], [np.array([[0], [1], [2], [0]])])
    assert "more than one mistake" in feedback and "you dropped nothing" in feedback and "C + 1" in feedback


def test_slots_name_one_slot_too_many_alone_when_it_is_the_only_fit():
    indices = np.array([[0], [0], [0], [0], [1]])  # capacity 2: C + 1 keeps 3 of 4, dropping nothing keeps 4
    feedback = rejected("ep.slots", [(indices, 2, 2)], [np.array([[0], [1], [2], [-1], [0]])])
    assert "more than one mistake" not in feedback and "you let it keep C + 1" in feedback


def test_capacity_bytes_name_both_fits_where_a_rank_keeps_half_and_double_counting_coincide():
    case = (2, 4, 10, 64, 2)  # n = 2: 4·E·C·h·w is also twice the right answer
    feedback = rejected("ep.all_to_all_bytes", {"capacity": [case], "dropless": []}, {"capacity": [4 * 4 * 10 * 64 * 2],
                                                                                      "dropless": []})
    assert "keeps for its own experts" in feedback and "receives as well" in feedback
    feedback = rejected("ep.all_to_all_bytes", {"capacity": [(4,) + case[1:]], "dropless": []},
                        {"capacity": [4 * 4 * 10 * 64 * 2], "dropless": []})
    assert "keeps for its own experts" in feedback and "more than one" not in feedback


def test_half_the_capacity_bytes_is_not_called_the_forward_pass_only():
    case = (3, 6, 5, 64, 2)
    feedback = rejected("ep.all_to_all_bytes", {"capacity": [case], "dropless": []},
                        {"capacity": [moe.capacity_all_to_all_bytes(*case) / 2], "dropless": []})
    assert "counts two all-to-alls" in feedback and "forward pass only" not in feedback


def test_dropless_bytes_of_the_dispatch_alone_are_told_they_are_half_not_the_forward_pass():
    routings = [np.array([[0], [1], [1]]), np.array([[0]])]  # rank 0 owns expert 0, rank 1 expert 1
    # the dispatch and its reverse only: a rank's rows out, then the gradients of the rows it received
    out, received = [2, 1], [1, 2]
    dispatch_only = [(out[r] + received[r]) * 8 * 4 for r in range(2)]
    assert moe.dropless_all_to_all_bytes(routings, 2, 8, 4) == [2 * d for d in dispatch_only]
    feedback = rejected("ep.all_to_all_bytes", {"capacity": [], "dropless": [(routings, 2, 8, 4)]},
                        {"capacity": [], "dropless": [dispatch_only]})
    assert "that is half" in feedback and "forward pass only" not in feedback and "more than one" not in feedback


def test_top_1_unweighted_layer_gets_one_message_that_names_both_causes():
    layer = next(case for case in prepared("ep.moe_layer", 1) if case[4] == 1 and case[5] is not None)
    x, router, w_in, w_out, k, capacity, renormalize = layer
    indices, weights = moe.top_k_routing(x @ router, k, renormalize)
    slots = moe.assign_slots(indices, router.shape[1], capacity)
    unweighted = np.zeros_like(x)
    for token in np.nonzero(slots[:, 0] >= 0)[0]:
        expert = indices[token, 0]
        unweighted[token] = moe.expert_mlp(x[token], w_in[expert], w_out[expert])
    feedback = rejected("ep.moe_layer", [layer], [unweighted])
    assert "every gate weight is 1" in feedback and "more than one mistake" not in feedback


def test_router_names_the_most_probable_expert_of_a_top_1_token_without_a_count():
    logits = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 2.5], [2.0, 0.5, 0.0], [0.0, 0.1, 3.0]])
    indices = np.array([[0], [1], [2], [0], [1]])  # the last token is sent to its second choice
    weights = np.take_along_axis(moe.softmax(logits), indices, axis=1)
    feedback = rejected("ep.router", [(logits, 1, False)], [(indices, weights)])
    assert "its most probable expert is 2" in feedback and "1 most probable" not in feedback


def test_interview_draws_capacities_that_round_and_floor_get_wrong():
    for seed in SEEDS:
        questions = prepared("ep.interview", seed)["interview_capacity"]
        assert questions[0] == (4096, 64, 2, 1.25)  # the question asked comes first
        for tokens, experts, k, factor in questions[1:]:
            right = moe.expert_capacity(tokens, experts, k, factor)
            assert round(factor * tokens * k / experts) != right and int(factor * tokens * k / experts) != right


# --- every named slip of the chapter's newer checks refused, and named, on every one of 100 draws ---

DRAWS = range(100)


def variants_of(slips: dict) -> list[tuple[str, int, object]]:
    """(feedback, variant, value) for a slip table whose values may be lists of variants."""
    return [(feedback, i, value) for feedback, values in slips.items()
            for i, value in enumerate(values if isinstance(values, list) else [values])]


def count(counts: dict, refusals: dict) -> None:
    for key, refused in refusals.items():
        counts[key] = counts.get(key, 0) + refused


@pytest.mark.parametrize("exercise_id", ["ep.shared_experts", "ep.interview", "ep.capacity"])
def test_every_formula_slip_is_refused_on_every_draw(exercise_id):
    assert_every_slip_refused(exercise_id, numbers_slips_refused(exercise_id, len(DRAWS)))


def bias_answers(inputs) -> dict:
    return {"routed": [routing.biased_top_k_routing(c["logits"], c["bias"], c["k"], c["renormalize"])
                       for c in inputs["routings"]],
            "updated": [routing.update_choice_bias(c["bias"], c["indices"], c["rate"]) for c in inputs["updates"]]}


class UpdateStudent:
    """update_bias with a load count of no fixed length (np.bincount without minlength)."""

    @staticmethod
    def update_bias(bias, expert_indices, rate):
        loads = np.bincount(expert_indices.reshape(-1))
        return bias + rate * np.sign(loads.mean() - loads)


def test_every_bias_balancing_slip_is_refused_on_every_draw():
    check = find_exercise("ep.bias_balancing").check
    counts = {}
    for seed in DRAWS:
        inputs = prepared("ep.bias_balancing", seed)
        right = bias_answers(inputs)
        check.judge(inputs, right)
        refusals = {}
        for index, case in enumerate(inputs["routings"]):
            indices, weights = right["routed"][index]
            for feedback, variant, value in variants_of(bias_balancing.choice_slips(case)):
                routed = [*right["routed"][:index], (value, weights), *right["routed"][index + 1:]]
                refusals[feedback, variant] = refusals.get((feedback, variant), False) or refused_with(
                    lambda: check.judge(inputs, {**right, "routed": routed}), feedback)
            for feedback, variant, value in variants_of(bias_balancing.gate_slips(case)):
                routed = [*right["routed"][:index], (indices, value), *right["routed"][index + 1:]]
                refusals[feedback, variant] = refusals.get((feedback, variant), False) or refused_with(
                    lambda: check.judge(inputs, {**right, "routed": routed}), feedback)
        for index, case in enumerate(inputs["updates"]):
            for feedback, variant, value in variants_of(bias_balancing.update_slips(case)):
                updated = [*right["updated"][:index], value, *right["updated"][index + 1:]]
                refusals[feedback, variant] = refusals.get((feedback, variant), False) or refused_with(
                    lambda: check.judge(inputs, {**right, "updated": updated}), feedback)
        short = [bias_balancing._updated(UpdateStudent, case) for case in inputs["updates"]]
        refusals["np.bincount without minlength", 0] = refused_with(lambda: check.judge(inputs, {**right, "updated": short}),
                                                                     "received no token")
        count(counts, refusals)
    assert_every_slip_refused("ep.bias_balancing", counts)


def test_every_node_limited_slip_is_refused_on_every_draw():
    check = find_exercise("ep.node_limited").check
    counts = {}
    for seed in DRAWS:
        cases = prepared("ep.node_limited", seed)
        right = [{"routed": routing.node_limited_routing(c["logits"], c["k"], c["experts_per_node"], c["max_nodes"],
                                                         c["renormalize"]),
                  "crossing": routing.cross_node_dispatch_bytes(c["limited_indices"], c["experts_per_node"],
                                                                c["source_node"], c["hidden"], c["bytes_per_element"]),
                  "bound": c["logits"].shape[0] * c["max_nodes"] * c["hidden"] * c["bytes_per_element"]} for c in cases]
        check.judge(cases, right)
        refusals = {}
        for index, case in enumerate(cases):
            slips = {"routed": node_limited.routing_slips(case["logits"], case["k"], case["experts_per_node"],
                                                          case["max_nodes"]),
                     "crossing": node_limited.crossing_slips(case), "bound": node_limited.bound_slips(case)}
            for part, table in slips.items():
                for feedback, value in table.items():
                    wrong = (value, right[index]["routed"][1]) if part == "routed" else value
                    answers = [*right[:index], {**right[index], part: wrong}, *right[index + 1:]]
                    refusals[feedback] = refusals.get(feedback, False) or refused_with(lambda: check.judge(cases, answers),
                                                                                       feedback)
        count(counts, refusals)
    assert_every_slip_refused("ep.node_limited", counts)


def tp_ep_outcomes(case, outputs) -> list:
    """What each rank of the TP 2 x EP 2 world returns: its output and one all-to-all of its EP group
    with the dispatch bytes of the formula (the rank's own part included)."""
    experts, (seq, hidden) = case["router"].shape[1], case["x"].shape
    sent = tp_ep.moe_tp_ep.tp_ep_dispatch_bytes(seq, tp_ep.TP, tp_ep.EP, experts, case["k"], case["factor"], hidden, 8)
    return [{"output": outputs[rank % tp_ep.TP],
             "events": [{"op": "all_to_all", "bytes": sent * tp_ep.EP // (tp_ep.EP - 1),
                         "group": [rank % tp_ep.TP + tp_ep.TP * j for j in range(tp_ep.EP)]}]}
            for rank in range(tp_ep.TP * tp_ep.EP)]


def test_every_tp_ep_slip_is_refused_on_every_draw():
    check = find_exercise("ep.tp_ep").check
    counts = {}
    for seed in DRAWS:
        inputs = prepared("ep.tp_ep", seed)
        case = inputs["case"]
        right_bytes = [tp_ep.moe_tp_ep.tp_ep_dispatch_bytes(*args[:-1], sequence_parallel=args[-1])
                       for args in inputs["formulas"]]
        right = {"worlds": [tp_ep_outcomes(case, tp_ep.layer_outputs(case))], "bytes": right_bytes}
        check.judge(inputs, right)
        refusals = {}
        for index, args in enumerate(inputs["formulas"]):
            for feedback, value in tp_ep.formula_slips(args).items():
                answers = {**right, "bytes": [*right_bytes[:index], value, *right_bytes[index + 1:]]}
                refusals[feedback] = refusals.get(feedback, False) or refused_with(
                    lambda: check.judge(inputs, answers), feedback)
        whole = {**right, "worlds": [tp_ep_outcomes(case, tp_ep.whole_sequence_outputs(case))]}
        refusals["whole sequence dispatched, own rows kept"] = refused_with(lambda: check.judge(inputs, whole),
                                                                            "kept its own rows of the output")
        count(counts, refusals)
    assert_every_slip_refused("ep.tp_ep", counts)


# --- and of the chapter's first exercises, through the same slip tables ---

def case_by_case(judge, right: list, slips_of, wrong_answer=lambda value, right_answer: value, lists_are_variants=True):
    """(feedback in words, variant) -> whether that slip, committed in one case (any), is refused and
    named by `judge(answers)`; `slips_of(index)` is the case's slip table (a list there holds the
    slip's variants, or with `lists_are_variants` False, one answer that is a list)."""
    refusals = {}
    for index in range(len(right)):
        table = slips_of(index)
        found = variants_of(table) if lists_are_variants else [(feedback, 0, value) for feedback, value in table.items()]
        for feedback, variant, value in found:
            answers = [*right[:index], wrong_answer(value, right[index]), *right[index + 1:]]
            key = words(feedback), variant  # a slip's feedback may quote the case's numbers
            refusals[key] = refusals.get(key, False) or refused_with(lambda: judge(answers), feedback)
    return refusals


def test_every_router_slip_is_refused_on_every_draw():
    check, counts = find_exercise("ep.router").check, {}
    for seed in DRAWS:
        cases = prepared("ep.router", seed)
        right = [moe.top_k_routing(*case) for case in cases]
        check.judge(cases, right)
        count(counts, case_by_case(lambda answers: check.judge(cases, answers), right,
                                   lambda i: router.choice_slips(*cases[i][:2]), lambda value, ok: (value, ok[1])))
        count(counts, case_by_case(lambda answers: check.judge(cases, answers), right,
                                   lambda i: router.gate_slips(*cases[i]), lambda value, ok: (ok[0], value)))
    assert_every_slip_refused("ep.router", counts)


def test_every_slots_and_layer_slip_is_refused_on_every_draw():
    for exercise_id, right_of, slips_of in (("ep.slots", moe.assign_slots, layer_checks._slot_slips),
                                            ("ep.moe_layer", moe.moe_layer, layer_checks.layer_slips)):
        check, counts = find_exercise(exercise_id).check, {}
        for seed in DRAWS:
            cases = prepared(exercise_id, seed)
            right = [right_of(*case) for case in cases]
            check.judge(cases, right)
            count(counts, case_by_case(lambda answers: check.judge(cases, answers), right,
                                       lambda i: slips_of(*cases[i])))
        assert_every_slip_refused(exercise_id, counts)


def test_every_balancing_loss_slip_is_refused_on_every_draw():
    check, counts = find_exercise("ep.balancing_loss").check, {}
    for seed in DRAWS:
        cases = prepared("ep.balancing_loss", seed)
        right = [dict(zip(("value", "gradient"), losses._loss_oracle(case))) for case in cases]
        check.judge(cases, right)
        count(counts, case_by_case(
            lambda answers: check.judge(cases, answers), right,
            lambda i: (losses.balancing_slips if cases[i]["indices"] is not None else losses.z_slips)(cases[i]),
            lambda value, ok: {**ok, "value": value}))
    assert_every_slip_refused("ep.balancing_loss", counts)


def test_every_all_to_all_bytes_slip_is_refused_on_every_draw():
    check, counts = find_exercise("ep.all_to_all_bytes").check, {}
    for seed in DRAWS:
        cases = prepared("ep.all_to_all_bytes", seed)
        right = {"capacity": [moe.capacity_all_to_all_bytes(*case) for case in cases["capacity"]],
                 "dropless": [moe.dropless_all_to_all_bytes(*case) for case in cases["dropless"]]}
        check.judge(cases, right)
        count(counts, case_by_case(lambda answers: check.judge(cases, {**right, "capacity": answers}), right["capacity"],
                                   lambda i: all_to_all_bytes.capacity_slips(cases["capacity"][i])))
        count(counts, case_by_case(lambda answers: check.judge(cases, {**right, "dropless": answers}), right["dropless"],
                                   lambda i: all_to_all_bytes._dropless_slips(*cases["dropless"][i]),
                                   lists_are_variants=False))
    assert_every_slip_refused("ep.all_to_all_bytes", counts)


@pytest.mark.parametrize("exercise_id", ["ep.expert_parallel_capacity", "ep.expert_parallel_dropless"])
def test_every_expert_parallel_output_slip_is_refused_on_every_draw(exercise_id):
    """The layer's slips, in every rank's output (judged first, as the check does); the exchanges
    are judged from the recorded all-to-alls of real worlds (test_ep_checks.py)."""
    counts = {}
    for seed in DRAWS:
        refusals = {}
        for n, cases in prepared(exercise_id, seed):
            for case in cases:
                layers = [(case["x"][r], case["router"], case["w_in"], case["w_out"], case["k"], case["capacity"],
                           case["renormalize"]) for r in range(n)]
                right = [moe.moe_layer(*layer_) for layer_ in layers]
                slips = [layer_checks.layer_slips(*layer_) for layer_ in layers]
                for feedback, variant, _ in variants_of(slips[0]):
                    outputs = [variants_of({feedback: slips[r][feedback]})[variant][2] for r in range(n)]
                    refusals[feedback, variant] = refusals.get((feedback, variant), False) or refused_with(
                        lambda: expert_parallel._judge_outputs(case, [{"output": o} for o in outputs], "world"),
                        feedback)
                expert_parallel._judge_outputs(case, [{"output": o} for o in right], "world")
        count(counts, refusals)
    assert_every_slip_refused(exercise_id, counts)
