"""dtp.ep.moe against independent computations: brute-force loops over tokens, torch's own softmax
and top-k, autograd, torch's FlopCounterMode, real models' numel, and all-to-alls run on gloo."""
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from dtp.ep import moe
from dtp.common.traffic import CommunicationLog
from dtp.common.world import run_world


def brute_force_slots(indices, num_experts, capacity):
    """Slots by the chapter's rule, one assignment at a time: first choices in token order, then
    second choices, ...; an expert takes assignments until it holds `capacity`."""
    tokens, k = indices.shape
    filled = [0] * num_experts
    slots = np.full((tokens, k), -1)
    for choice in range(k):
        for token in range(tokens):
            expert = indices[token, choice]
            if capacity is None or filled[expert] < capacity:
                slots[token, choice] = filled[expert]
                filled[expert] += 1
    return slots


def brute_force_layer(x, router, w_in, w_out, k, capacity, renormalize):
    """The layer token by token from torch's softmax and topk (sorted, largest first)."""
    probabilities = torch.softmax(torch.from_numpy(x @ router), dim=-1)
    weights, indices = probabilities.topk(k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    slots = brute_force_slots(indices.numpy(), router.shape[1], capacity)
    output = np.zeros_like(x)
    for token in range(x.shape[0]):
        for choice in range(k):
            if slots[token, choice] >= 0:
                expert = int(indices[token, choice])
                output[token] += float(weights[token, choice]) * (np.maximum(x[token] @ w_in[expert], 0) @ w_out[expert])
    return output


def random_layer(rng, tokens=23, d=6, f=5, experts=4, skew=1.5):
    x = rng.standard_normal((tokens, d))
    router = rng.standard_normal((d, experts)) * skew
    return x, router, rng.standard_normal((experts, d, f)), rng.standard_normal((experts, f, d))


def test_top_k_routing_matches_torch_topk_and_mixtrals_softmax_of_the_top_k_logits():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((50, 8)) * 30  # large logits: the shift by the maximum matters
    for k in (1, 2, 3):
        indices, weights = moe.top_k_routing(logits, k, renormalize=False)
        torch_weights, torch_indices = torch.softmax(torch.from_numpy(logits), -1).topk(k)
        assert np.array_equal(indices, torch_indices.numpy()) and np.allclose(weights, torch_weights.numpy())
        _, renormalized = moe.top_k_routing(logits, k, renormalize=True)
        mixtral = torch.softmax(torch.from_numpy(logits).topk(k).values, -1).numpy()  # Softmax(TopK(logits))
        assert np.allclose(renormalized, mixtral, rtol=1e-12, atol=1e-15)


def test_capacity_is_the_ceiling_of_capacity_factor_tokens_k_over_experts():
    assert moe.expert_capacity(4096, 64, 2, 1.25) == 160
    assert moe.expert_capacity(10, 4, 1, 1.0) == 3  # 2.5 rounds up
    assert moe.expert_capacity(8, 4, 2, 1.0) == 4  # exact: no rounding
    assert moe.expert_capacity(7, 3, 1, 0.5) == 2


@pytest.mark.parametrize("capacity", [None, 0, 1, 3, 7])
def test_assign_slots_matches_the_brute_force_rule(capacity):
    rng = np.random.default_rng(capacity or 99)
    for k in (1, 2, 3):
        indices = np.argsort(rng.standard_normal((31, 5)), axis=1)[:, :k]
        assert np.array_equal(moe.assign_slots(indices, 5, capacity), brute_force_slots(indices, 5, capacity))


@pytest.mark.parametrize("k, capacity, renormalize", [(1, None, False), (2, None, True), (1, 4, False),
                                                      (2, 6, True), (3, 5, False), (2, 0, True)])
def test_numpy_and_torch_layers_match_the_token_by_token_layer(k, capacity, renormalize):
    rng = np.random.default_rng(k * 10 + (capacity or 0))
    x, router, w_in, w_out = random_layer(rng)
    expected = brute_force_layer(x, router, w_in, w_out, k, capacity, renormalize)
    assert np.allclose(moe.moe_layer(x, router, w_in, w_out, k, capacity, renormalize), expected, rtol=1e-12, atol=1e-12)
    in_torch = moe.moe_layer_torch(*map(torch.from_numpy, (x, router, w_in, w_out)), k, capacity, renormalize)
    assert np.allclose(in_torch.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_the_torch_layer_differentiates_everything_but_the_routing():
    rng = np.random.default_rng(5)
    tensors = [torch.from_numpy(a).requires_grad_() for a in random_layer(rng, tokens=9)]
    for k, renormalize in ((1, False), (2, True)):
        torch.autograd.gradcheck(lambda *t: moe.moe_layer_torch(*t, k, 3, renormalize), tensors)


def test_renormalised_top_1_leaves_the_router_without_gradient():
    """Why Switch multiplies by p_i(x): with k = 1 a renormalised gate is 1, and the task loss no
    longer reaches the router."""
    rng = np.random.default_rng(6)
    x, router, w_in, w_out = (torch.from_numpy(a) for a in random_layer(rng))
    router.requires_grad_()
    moe.moe_layer_torch(x, router, w_in, w_out, 1, None, renormalize=True).sum().backward()
    renormalized, router.grad = router.grad.abs().max().item(), None
    moe.moe_layer_torch(x, router, w_in, w_out, 1, None, renormalize=False).sum().backward()
    assert renormalized < 1e-14 < router.grad.abs().max().item()  # w/w = 1: only rounding is left


def test_load_balancing_loss_is_alpha_at_balance_and_its_gradient_reaches_only_p():
    logits = torch.zeros(8, 4, dtype=torch.float64, requires_grad=True)
    indices = np.array([[0, 1], [2, 3]] * 4)
    assert moe.load_balancing_loss(logits, indices, alpha=0.01).item() == pytest.approx(0.01)
    rng = np.random.default_rng(7)
    logits = torch.from_numpy(rng.standard_normal((40, 6)) * 2).requires_grad_()
    indices, _ = moe.top_k_routing(logits.detach().numpy(), 2, True)
    loss = moe.load_balancing_loss(logits, indices, alpha=0.01)
    probabilities = torch.softmax(logits, -1)
    probabilities.retain_grad()
    f = moe.dispatched_fractions(indices, 6)
    # alpha·E·Σ f_i·P_i written on the probabilities: d/dp_i(x) = alpha·E·f_i/T
    (0.01 * 6 * (torch.from_numpy(f) * probabilities.mean(0)).sum()).backward()
    assert np.allclose(probabilities.grad.numpy(), 0.01 * 6 * f / 40)
    gradient, = torch.autograd.grad(loss, logits)
    assert np.allclose(gradient.numpy(), logits.grad.numpy())


@pytest.mark.parametrize("k, offset", [(1, 0.0), (2, 0.0), (2, 800.0)])
def test_closed_form_gradients_of_both_losses_equal_autograd(k, offset):
    rng = np.random.default_rng(k)
    logits = rng.standard_normal((30, 7)) * 2 + rng.standard_normal(7) + offset
    indices, _ = moe.top_k_routing(logits, k, True)
    for closed_form, loss in ((lambda: moe.load_balancing_loss_and_gradient(logits, indices, 0.03),
                               lambda t: moe.load_balancing_loss(t, indices, 0.03)),
                              (lambda: moe.router_z_loss_and_gradient(logits, 0.002),
                               lambda t: moe.router_z_loss(t, 0.002))):
        tensor = torch.from_numpy(logits).requires_grad_()
        value = loss(tensor)
        value.backward()
        expected_value, expected_gradient = closed_form()
        assert value.item() == pytest.approx(expected_value, rel=1e-12)
        assert np.allclose(tensor.grad.numpy(), expected_gradient, rtol=1e-10, atol=1e-15)


def test_router_z_loss_equals_its_definition_without_overflow():
    logits = torch.tensor([[1000.0, 0.0], [1.0, 2.0]], dtype=torch.float64)
    expected = 1e-3 * np.mean([(1000 + math.log1p(math.exp(-1000))) ** 2, (2 + math.log1p(math.exp(-1))) ** 2])
    assert moe.router_z_loss(logits).item() == pytest.approx(expected, rel=1e-12)


def test_dropless_bytes_count_rows_to_and_from_other_ranks():
    # 2 ranks, 4 experts (0, 1 on rank 0; 2, 3 on rank 1), d = 3, 4-byte elements
    indices = [np.array([[0, 2], [3, 1]]), np.array([[2, 3], [0, 0], [1, 2]])]
    # rank 0 sends 2 rows to rank 1 and receives 3; rank 1 the other way round
    assert moe.dropless_all_to_all_bytes(indices, 4, 3, 4) == [2 * (2 + 3) * 12, 2 * (3 + 2) * 12]


def test_parameter_counts_match_a_mixtral_shaped_model_built_on_meta():
    for config in (moe.MIXTRAL_8X7B, moe.MoEConfig(vocab_size=300, hidden=48, n_layers=3, n_heads=6, n_kv_heads=2,
                                                   expert_hidden=80, n_experts=5, top_k=2)):
        with torch.device("meta"):
            model = moe.MoETransformer(config)
        counts = moe.moe_parameter_counts(config)
        assert counts["total"] == sum(p.numel() for p in model.parameters())
        one_expert = sum(p.numel() for p in model.blocks[0].moe.experts[0].parameters())
        assert counts["expert"] == one_expert
        assert counts["active"] == counts["total"] - config.n_layers * (config.n_experts - config.top_k) * one_expert
    counts = moe.moe_parameter_counts(moe.MIXTRAL_8X7B)
    assert round(counts["total"] / 1e9, 1) == 46.7 and round(counts["active"] / 1e9, 1) == 12.9  # Mixtral's 47B / 13B


def test_moe_feed_forward_flops_counted_by_torch_equal_the_closed_form():
    from torch.utils.flop_counter import FlopCounterMode
    torch.manual_seed(0)
    layer = moe.MoEFeedForward(hidden=16, expert_hidden=24, n_experts=6, top_k=2)
    with FlopCounterMode(display=False) as counter:
        layer(torch.randn(37, 16))
    assert counter.get_total_flops() == moe.moe_ffn_forward_flops(37, 16, 24, 6, 2)


def _all_to_alls_on_rank(rank, world_size):
    rows_to = [rank + destination for destination in range(world_size)]  # uneven, one of them empty
    rows_from = [source + rank for source in range(world_size)]
    sent = torch.arange(sum(rows_to) * 3, dtype=torch.float32).reshape(-1, 3) + 100 * rank
    received = torch.empty(sum(rows_from), 3)
    with CommunicationLog() as log, moe.AllToAllLog(payloads=True) as splits:
        dist.all_to_all_single(received, sent, rows_from, rows_to)
        outputs = [torch.empty(2, 3) for _ in range(world_size)]
        dist.all_to_all(outputs, [torch.full((2, 3), float(rank)) for _ in range(world_size)])
        even = torch.empty(world_size * 2, dtype=torch.int64)
        dist.all_to_all_single(even, torch.arange(world_size * 2))
    try:
        dist.all_to_all([torch.empty(1, 3) for _ in range(world_size)],
                        [torch.zeros(destination + 1, 3) for destination in range(world_size)])
        uneven_list = "accepted"
    except RuntimeError as error:
        uneven_list = str(error)
    return {"log": [e["bytes"] for e in log.of("all_to_all")], "calls": splits.calls,
            "payload_ok": all(torch.equal(piece, expected) for piece, expected
                              in zip(splits.calls[0]["payload"], sent.split(rows_to))),
            "uneven_list": uneven_list}


def test_all_to_all_log_records_split_sizes_beside_the_communication_log():
    for rank, outcome in enumerate(run_world(_all_to_alls_on_rank, 3)):
        first, second, third = outcome["calls"][:3]
        assert first["rows_to"] == [rank, rank + 1, rank + 2] and first["bytes_to"] == [12 * r for r in first["rows_to"]]
        assert second["rows_to"] == [2, 2, 2] and third["bytes_to"] == [16, 16, 16] and third["dtype"] == "int64"
        assert outcome["log"][:3] == [sum(first["bytes_to"]), sum(second["bytes_to"]), sum(third["bytes_to"])]
        assert outcome["payload_ok"]
        assert "invalid tensor size" in outcome["uneven_list"]  # gloo's list all_to_all needs equal sizes
