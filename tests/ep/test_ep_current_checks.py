"""The checks of the chapter's current-practice exercises (auxiliary-loss-free balancing, ...)
reject plausible wrong answers with feedback that names the mistake, and accept correct answers
written differently from the course's."""
import pytest

from conftest import assert_fails, assert_verdict, graded


def variants(exercise_id: str, cases: list, ids: list) -> list:
    """Parameters of test_template_variant: the exercise, and each case's (changes, feedback)."""
    return [pytest.param(exercise_id, changes, feedback, id=f"{exercise_id}-{name}")
            for (changes, feedback), name in zip(cases, ids, strict=True)]


# --- exercise 7: auxiliary-loss-free balancing ---

BIAS_TEMPLATE = '''
def biased_router(logits, bias, k, renormalize):
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = probabilities / probabilities.sum(axis=1, keepdims=True)
    expert_indices = np.argsort(-({CHOICE}), axis=1, kind="stable")[:, :k]
    gate_weights = np.take_along_axis({GATES}, expert_indices, axis=1)
    if renormalize:
        gate_weights = gate_weights / gate_weights.sum(axis=1, keepdims=True)
    return expert_indices, gate_weights


def update_bias(bias, expert_indices, rate):
    loads = np.bincount(expert_indices.reshape(-1), minlength=len(bias))
    return {UPDATE}
'''
BIAS_RIGHT = dict(CHOICE="probabilities + bias", GATES="probabilities", UPDATE="bias + rate * np.sign(loads.mean() - loads)")


BIAS_VARIANTS = variants("ep.bias_balancing", [
    (dict(), None),
    (dict(CHOICE="probabilities"), "the bias is ignored"),
    (dict(CHOICE="logits + bias"), "added to the logits"),
    (dict(GATES="probabilities + bias"), "the gate weights include the bias"),
    (dict(UPDATE="bias + rate * (loads.mean() - loads)"), "by the size of the error"),
    (dict(UPDATE="bias - rate * np.sign(loads.mean() - loads)"), "signs are reversed"),
    (dict(UPDATE="bias + rate * np.where(loads > loads.mean(), -1.0, 1.0)"), "exactly at the mean load"),
    (dict(UPDATE="rate * np.sign(loads.mean() - loads)"), "add it to the current bias"),
], ids=["template-is-right", "bias-ignored", "bias-on-logits", "bias-in-gates", "error-size-step", "reversed-sign",
        "mean-counted-as-underloaded", "step-only"])


BIAS_IN_TORCH = '''
def biased_router(logits, bias, k, renormalize):
    # DeepSeek-V3's gate in torch: choose on the biased scores, gather the unbiased ones
    probabilities = torch.softmax(torch.from_numpy(logits), dim=-1)
    chosen = (probabilities + torch.from_numpy(bias)).topk(k, dim=-1).indices
    weights = probabilities.gather(1, chosen)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return chosen.numpy(), weights.numpy()


def update_bias(bias, expert_indices, rate):
    mean = expert_indices.size / len(bias)
    new = bias.copy()
    for expert in range(len(bias)):
        load = int((expert_indices == expert).sum())
        if load > mean:
            new[expert] -= rate
        elif load < mean:
            new[expert] += rate
    return new
'''


def test_bias_balancing_accepts_a_torch_router_and_a_loop(tmp_notebook):
    assert graded(tmp_notebook, "ep.bias_balancing", {"biased_router": BIAS_IN_TORCH}).status == "passed"


def test_bias_update_refuses_a_load_count_without_a_fixed_length(tmp_notebook):
    """np.bincount without minlength is short when the last experts got no token: no draw left an
    expert idle, so it scored full marks; every grading now has idle experts, the last among them."""
    short = BIAS_TEMPLATE.format(**BIAS_RIGHT).replace("np.bincount(expert_indices.reshape(-1), minlength=len(bias))",
                                                       "np.bincount(expert_indices.reshape(-1))")
    assert_fails(graded(tmp_notebook, "ep.bias_balancing", {"biased_router": short}), "received no token")


def test_bias_update_names_idle_experts_left_out_of_the_count(tmp_notebook):
    counted = BIAS_TEMPLATE.format(**BIAS_RIGHT).replace(
        "    loads = np.bincount(expert_indices.reshape(-1), minlength=len(bias))\n    return bias + rate * np.sign(loads.mean() - loads)",
        "    chosen, loads = np.unique(expert_indices, return_counts=True)\n    new = bias.copy()\n"
        "    new[chosen] += rate * np.sign(loads.mean() - loads)\n    return new")
    assert "np.unique" in counted
    assert_fails(graded(tmp_notebook, "ep.bias_balancing", {"biased_router": counted}), "its bias rises by the rate too")


# --- exercise 8: shared and fine-grained experts ---

SHARED_TEMPLATE = '''
def moe_total_parameters(hidden, expert_hidden, routed, shared, k):
    return {TOTAL}


def moe_active_parameters(hidden, expert_hidden, routed, shared, k):
    return {ACTIVE}


def moe_flops_per_token(hidden, expert_hidden, routed, shared, k):
    return {FLOPS}
'''
SHARED_RIGHT = dict(TOTAL="(routed + shared) * 3 * hidden * expert_hidden + hidden * routed",
                    ACTIVE="(k + shared) * 3 * hidden * expert_hidden + hidden * routed",
                    FLOPS="2 * moe_active_parameters(hidden, expert_hidden, routed, shared, k)")


SHARED_VARIANTS = variants("ep.shared_experts", [
    (dict(), None),
    (dict(TOTAL="(routed + shared) * (3 * hidden * expert_hidden + hidden)"), "the router scores only the routed"),
    (dict(ACTIVE="k * 3 * hidden * expert_hidden + hidden * routed"), "every shared expert besides its k routed"),
    (dict(ACTIVE="(k + shared) * 2 * hidden * expert_hidden + hidden * routed"), "three h×f matrices"),
    (dict(FLOPS="moe_active_parameters(hidden, expert_hidden, routed, shared, k)"), "a multiply-add is 2 FLOPs"),
    (dict(FLOPS="2 * moe_total_parameters(hidden, expert_hidden, routed, shared, k)"), "counts every expert's FLOPs"),
    (dict(TOTAL="routed * (1 + shared) * 3 * hidden * expert_hidden + hidden * routed"), "once per routed expert"),
    (dict(ACTIVE="k * (1 + shared) * 3 * hidden * expert_hidden + hidden * routed"), "once per routed expert"),
], ids=["template-is-right", "shared-in-router", "shared-left-out-of-active", "two-matrices", "flops-not-doubled",
        "flops-of-all-experts", "total-shared-per-routed-expert", "active-shared-per-routed-expert"])


def test_shared_experts_refuses_numbers_copied_from_the_page(tmp_notebook):
    cell = "moe_total_parameters = 3775940608\nmoe_active_parameters = 42009600\nmoe_flops_per_token = 84019200\n"
    result = graded(tmp_notebook, "ep.shared_experts", {"moe_total_parameters": cell})
    assert result.points == 0 and "should be a function" in result.feedback, result


# --- exercise 9: node-limited routing ---

NODE_TEMPLATE = '''
def node_limited_router(logits, k, experts_per_node, max_nodes, renormalize):
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities = probabilities / probabilities.sum(axis=1, keepdims=True)
    tokens, experts = probabilities.shape
    by_node = np.sort(probabilities.reshape(tokens, experts // experts_per_node, experts_per_node), axis=2)
    node_scores = {NODE_SCORE}
    kept_nodes = np.argsort(-node_scores, axis=1, kind="stable")[:, :max_nodes]
    kept = np.zeros(node_scores.shape, dtype=bool)
    np.put_along_axis(kept, kept_nodes, True, axis=1)
    masked = {MASKED}
    expert_indices = np.argsort(-masked, axis=1, kind="stable")[:, :k]
    gate_weights = np.take_along_axis(probabilities, expert_indices, axis=1)
    if renormalize:
        gate_weights = gate_weights / gate_weights.sum(axis=1, keepdims=True)
    return expert_indices, gate_weights


def cross_node_bytes(expert_indices, experts_per_node, source_node, hidden, bytes_per_element):
    return {CROSSING} * hidden * bytes_per_element


def max_cross_node_bytes(tokens, k, max_nodes, hidden, bytes_per_element):
    return tokens * {BOUND} * hidden * bytes_per_element
'''
NODE_RIGHT = dict(NODE_SCORE="by_node[:, :, -(k // max_nodes):].sum(axis=2)",
                  MASKED="np.where(np.repeat(kept, experts_per_node, axis=1), probabilities, -np.inf)",
                  CROSSING="sum(len(set((row // experts_per_node).tolist()) - {source_node}) for row in expert_indices)",
                  BOUND="max_nodes")
NODE_VARIANTS = variants("ep.node_limited", [
    (dict(), None),
    (dict(MASKED="probabilities"), "the node limit is ignored"),
    (dict(NODE_SCORE="by_node[:, :, -1]"), "scored by their single best expert"),
    (dict(NODE_SCORE="by_node.sum(axis=2)"), "sum of all their experts' probabilities"),
    (dict(CROSSING="int(np.sum(expert_indices // experts_per_node != source_node))"), "one copy per expert"),
    (dict(CROSSING="sum(len(set((row // experts_per_node).tolist())) for row in expert_indices)"),
     "own node is reached without crossing"),
    (dict(BOUND="k"), "the bound without the limit"),
    # the slip the issue names: the top-k over all experts first, its best M nodes (each scored by its
    # experts among the k), then k experts from those nodes
    (dict(NODE_SCORE="np.where(np.argsort(np.argsort(-probabilities, axis=1, kind='stable'), axis=1) < k, "
                     "probabilities, 0.0).reshape(tokens, -1, experts_per_node).sum(axis=2)"),
     "the limit is applied after the top-k"),
], ids=["template-is-right", "limit-ignored", "node-by-best-expert", "node-by-all-experts", "copy-per-expert",
        "own-node-counted", "bound-per-expert", "limit-after-top-k"])




# --- exercise 10: EP beside TP with sequence parallelism (a gloo world of 4) ---

TP_EP_TEMPLATE = '''
def tp_ep_moe(x_sequence, router_weight, w_in, w_out, k, capacity, ep_group, tp_rank, tp):
    tokens = {TOKENS}
    num_experts, hidden = router_weight.shape[1], tokens.shape[1]
    ep, local = dist.get_world_size(ep_group), w_in.shape[0]
    expert_indices, gate_weights = top_k_router((tokens @ router_weight).numpy(), k, True)
    slots = assign_slots(expert_indices, num_experts, capacity)
    token, choice = np.nonzero(slots >= 0)
    rows = torch.from_numpy(expert_indices[token, choice] * capacity + slots[token, choice])
    buffers = torch.zeros(num_experts * capacity, hidden, dtype=tokens.dtype)
    buffers[rows] = tokens[torch.from_numpy(token)]
    received = list(torch.empty_like(buffers).chunk(ep))
    dist.all_to_all(received, list(buffers.chunk(ep)), group=ep_group)
    by_expert = torch.cat(received).view(ep, local, capacity, hidden)
    results = torch.stack([torch.relu(by_expert[:, e] @ w_in[e]) @ w_out[e] for e in range(local)], dim=1)
    returned = list(torch.empty_like(buffers).chunk(ep))
    dist.all_to_all(returned, list(results.reshape(-1, hidden).chunk(ep)), group=ep_group)
    gates = torch.from_numpy(gate_weights[token, choice]).to(tokens.dtype).unsqueeze(1)
    return torch.zeros_like(tokens).index_add(0, torch.from_numpy(token), gates * torch.cat(returned)[rows])


def tp_ep_dispatch_bytes(seq_tokens, tp, ep, num_experts, k, capacity_factor, hidden, bytes_per_element,
                         sequence_parallel=True):
    tokens = {FORMULA_TOKENS}
    return (ep - 1) * (num_experts // ep) * expert_capacity(tokens, num_experts, k, capacity_factor) * hidden * bytes_per_element
'''
TP_EP_RIGHT = dict(TOKENS="x_sequence.chunk(tp)[tp_rank]",
                   FORMULA_TOKENS="seq_tokens // tp if sequence_parallel else seq_tokens")



TP_EP_VARIANTS = variants("ep.tp_ep", [
    (dict(), None),  # the list form of all_to_all: a correct alternative
    (dict(TOKENS="x_sequence"), "every TP rank dispatched the whole sequence"),
    (dict(FORMULA_TOKENS="seq_tokens"), "only its s/t tokens, so its capacity"),
], ids=["list-all-to-all-is-right", "whole-sequence-from-every-tp-rank", "formula-without-sp"])


def test_tp_ep_names_the_whole_sequence_dispatched_and_the_ranks_rows_kept(tmp_notebook):
    """Every TP rank routes all s tokens and returns only its rows: the output has the right shape,
    and its values (other tokens dropped) were told only how far off they were."""
    whole = TP_EP_TEMPLATE.format(**{**TP_EP_RIGHT, "TOKENS": "x_sequence"}).replace(
        "gates * torch.cat(returned)[rows])", "gates * torch.cat(returned)[rows]).chunk(tp)[tp_rank]")
    assert_fails(graded(tmp_notebook, "ep.tp_ep", {"tp_ep_moe": whole}), "kept its own rows of the output")


# --- every exercise's template, with the changes above ---

# exercise -> (the name its cell defines, the cell's template, the right code for each open place)
TEMPLATES = {"ep.bias_balancing": ("biased_router", BIAS_TEMPLATE, BIAS_RIGHT),
             "ep.shared_experts": ("moe_total_parameters", SHARED_TEMPLATE, SHARED_RIGHT),
             "ep.node_limited": ("node_limited_router", NODE_TEMPLATE, NODE_RIGHT),
             "ep.tp_ep": ("tp_ep_moe", TP_EP_TEMPLATE, TP_EP_RIGHT)}


@pytest.mark.parametrize("exercise_id, changes, feedback", BIAS_VARIANTS + SHARED_VARIANTS + NODE_VARIANTS + TP_EP_VARIANTS)
def test_template_variant(tmp_notebook, exercise_id, changes, feedback):
    """The template as it is passes (changes {}); each change fails with the feedback that names it."""
    name, template, right = TEMPLATES[exercise_id]
    assert_verdict(graded(tmp_notebook, exercise_id, {name: template.format(**{**right, **changes})}), feedback)


def test_every_bias_update_draw_separates_the_sign_from_the_size_of_the_error():
    """Loads one off the mean make a step by the error's size equal to the rule's step by its
    sign: every drawn update has an expert at least 2 off the mean, and one exactly at it."""
    import numpy as np

    from grader.registry import find_exercise

    check = find_exercise("ep.bias_balancing").check
    for seed in range(300):
        for update in check.prepare(np.random.default_rng(seed))["updates"]:
            loads = np.bincount(np.asarray(update["indices"]).reshape(-1), minlength=len(update["bias"]))
            errors = loads - loads.mean()
            assert np.abs(errors).max() >= 2 and np.any(errors == 0), (seed, loads)
