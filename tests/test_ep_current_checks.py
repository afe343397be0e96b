"""The checks of the chapter's current-practice exercises (auxiliary-loss-free balancing, ...)
reject plausible wrong answers with feedback that names the mistake, and accept correct answers
written differently from the course's."""
import pytest

from conftest import grade


def graded(tmp_notebook, exercise_id, replacements):
    return grade(tmp_notebook("ep", replacements), exercise_id)[exercise_id]


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


def bias_cell(**changes) -> str:
    return BIAS_TEMPLATE.format(**{**BIAS_RIGHT, **changes})


@pytest.mark.parametrize("changes, feedback", [
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
def test_bias_balancing(tmp_notebook, changes, feedback):
    result = graded(tmp_notebook, "ep.bias_balancing", {"biased_router": bias_cell(**changes)})
    if feedback is None:
        assert result.status == "passed", result
    else:
        assert result.status == "failed" and result.points == 0, result
        assert feedback in result.feedback, result


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


@pytest.mark.parametrize("changes, feedback", [
    (dict(), None),
    (dict(TOTAL="(routed + shared) * (3 * hidden * expert_hidden + hidden)"), "the router scores only the routed"),
    (dict(ACTIVE="k * 3 * hidden * expert_hidden + hidden * routed"), "every shared expert besides its k routed"),
    (dict(ACTIVE="(k + shared) * 2 * hidden * expert_hidden + hidden * routed"), "three h×f matrices"),
    (dict(FLOPS="moe_active_parameters(hidden, expert_hidden, routed, shared, k)"), "a multiply-add is 2 FLOPs"),
    (dict(FLOPS="2 * moe_total_parameters(hidden, expert_hidden, routed, shared, k)"), "counts every expert's FLOPs"),
], ids=["template-is-right", "shared-in-router", "shared-left-out-of-active", "two-matrices", "flops-not-doubled",
        "flops-of-all-experts"])
def test_shared_experts(tmp_notebook, changes, feedback):
    result = graded(tmp_notebook, "ep.shared_experts",
                    {"moe_total_parameters": SHARED_TEMPLATE.format(**{**SHARED_RIGHT, **changes})})
    if feedback is None:
        assert result.status == "passed", result
    else:
        assert result.status == "failed" and result.points == 0, result
        assert feedback in result.feedback, result


def test_shared_experts_refuses_numbers_copied_from_the_page(tmp_notebook):
    cell = "moe_total_parameters = 3775940608\nmoe_active_parameters = 42009600\nmoe_flops_per_token = 84019200\n"
    result = graded(tmp_notebook, "ep.shared_experts", {"moe_total_parameters": cell})
    assert result.points == 0 and "should be a function" in result.feedback, result
