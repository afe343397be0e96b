"""dtp.ep.routing against brute-force loops, and its bias balancing inside the book's model."""
import numpy as np
import pytest
import torch

from dtp.ep import moe, routing as moe_routing


def test_biased_routing_chooses_by_biased_score_and_weighs_by_probability():
    rng = np.random.default_rng(0)
    logits, bias = rng.standard_normal((30, 6)), rng.standard_normal(6) * 0.2
    indices, weights = moe_routing.biased_top_k_routing(logits, bias, 2, renormalize=True)
    probabilities = moe.softmax(logits)
    for t in range(30):
        order = sorted(range(6), key=lambda e: -(probabilities[t, e] + bias[e]))[:2]
        assert indices[t].tolist() == order
        chosen = probabilities[t, order]
        assert np.allclose(weights[t], chosen / chosen.sum())
    # a zero bias is the plain router
    plain = moe.top_k_routing(logits, 2, True)
    assert all(np.array_equal(a, b) for a, b in zip(moe_routing.biased_top_k_routing(logits, np.zeros(6), 2, True), plain))


def test_bias_update_is_a_fixed_step_by_the_sign_of_the_error():
    indices = np.array([[0, 1], [0, 2], [0, 1], [3, 1]])  # loads 3, 3, 1, 1; mean 2
    new = moe_routing.update_choice_bias(np.array([0.1, 0.0, 0.0, -0.1]), indices, 0.01)
    assert np.allclose(new, [0.09, -0.01, 0.01, -0.09])
    balanced = np.array([[0, 1], [2, 3]])
    assert np.array_equal(moe_routing.update_choice_bias(np.ones(4), balanced, 0.5), np.ones(4))


def test_imbalance_ceiling_is_e_over_k():
    assert moe_routing.load_imbalance(np.array([[0, 1]] * 5), 8, 2) == 4.0
    assert moe_routing.load_imbalance(np.array([[0, 1], [2, 3], [4, 5], [6, 7]]), 8, 2) == 1.0


def test_the_models_choice_bias_steers_choices_not_gates():
    torch.manual_seed(0)
    layer = moe.MoEFeedForward(8, 12, 4, 2)
    x = torch.randn(20, 8)
    plain = layer(x)
    layer.choice_bias[:] = torch.tensor([10.0, 10.0, 0.0, 0.0])  # experts 0 and 1 for every token
    biased = layer(x)
    assert set(layer.last_indices.reshape(-1).tolist()) == {0, 1}
    probabilities = torch.softmax(layer.router(x), dim=-1)[:, :2]
    weights = probabilities / probabilities.sum(dim=-1, keepdim=True)
    expected = sum(weights[:, e:e + 1] * layer.experts[e](x) for e in (0, 1))
    assert torch.allclose(biased, expected, atol=1e-6) and not torch.allclose(biased, plain)


def test_moe_ffn_counts_match_torch_modules_and_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    from dtp.ep import experts as moe_experts
    hidden, width, routed, shared, k = 16, 12, 6, 2, 2
    router = torch.nn.Linear(hidden, routed, bias=False)
    experts = [moe.SwiGLUExpert(hidden, width) for _ in range(routed + shared)]
    counted = sum(p.numel() for m in [router, *experts] for p in m.parameters())
    assert moe_experts.moe_ffn_parameters(hidden, width, routed, shared, k)["total"] == counted
    x = torch.randn(1, hidden)
    with FlopCounterMode(display=False) as counter:  # one token: router, k routed and the shared experts
        router(x)
        for expert in experts[:k] + experts[routed:]:
            expert(x)
    assert moe_experts.moe_ffn_flops_per_token(hidden, width, routed, shared, k) == counter.get_total_flops()


def test_deepseek_v3_totals_are_the_reports():
    from dtp.ep import experts as moe_experts
    counts = moe_experts.deepseek_parameter_counts()
    assert round(counts["total"] / 1e9) == 671  # DeepSeek-AI 2024: 671B total, 37B activated per token
    assert int(counts["active"] / 1e9) == 37


def test_node_limited_routing_against_a_loop():
    rng = np.random.default_rng(1)
    logits, k, per_node, max_nodes = rng.standard_normal((40, 12)) * 2, 4, 3, 2
    indices, weights = moe_routing.node_limited_routing(logits, k, per_node, max_nodes, renormalize=False)
    probabilities = moe.softmax(logits)
    for t in range(40):
        score = {n: sorted(probabilities[t, n * per_node:(n + 1) * per_node])[-2:] for n in range(4)}
        nodes = sorted(range(4), key=lambda n: -sum(score[n]))[:max_nodes]
        allowed = [e for e in range(12) if e // per_node in nodes]
        assert indices[t].tolist() == sorted(allowed, key=lambda e: -probabilities[t, e])[:k]
        assert len(set(indices[t] // per_node)) <= max_nodes
    assert np.allclose(weights, np.take_along_axis(probabilities, indices, axis=1))
    dispatched = moe_routing.cross_node_dispatch_bytes(indices, per_node, 0, 8, 2)
    assert dispatched <= 40 * max_nodes * 8 * 2
    assert dispatched == sum(len(set((indices[t] // per_node).tolist()) - {0}) for t in range(40)) * 16


def test_expert_capacity_uses_the_decimal_value_of_the_factor():
    from decimal import Decimal
    assert moe.expert_capacity(80, 8, 2, 1.1) == 22  # the binary 1.1 would give 23
    for factor in (0.3, 0.7, 1.1, 1.2, 1.3, 2.2):
        for tokens in range(1, 200, 7):
            for experts, k in ((8, 2), (6, 1), (64, 8)):
                exact = Decimal(str(factor)) * tokens * k / experts
                assert moe.expert_capacity(tokens, experts, k, factor) == int(exact.to_integral_value(rounding="ROUND_CEILING"))


def _crossings(indices, experts_per_node, source_node):
    """Per token: the other nodes its experts lie on (one copy each)."""
    return [len(set((row // experts_per_node).tolist()) - {source_node}) for row in indices]


def test_max_cross_node_copies_bounds_the_routers_and_is_reached():
    """min(k, M, N - 1): never exceeded by node-limited or plain top-k routing on random draws, and
    reached by some token in each, so no smaller bound holds (k alone overstates it once k >= N)."""
    rng = np.random.default_rng(7)
    for _ in range(40):
        nodes, per_node = int(rng.integers(2, 7)), int(rng.integers(1, 5))
        max_nodes = int(rng.integers(1, nodes + 1))
        k = max_nodes * int(rng.integers(1, per_node + 1))
        source = int(rng.integers(nodes))
        logits = rng.standard_normal((2000, nodes * per_node)) * 2
        routed = {max_nodes: moe_routing.node_limited_routing(logits, k, per_node, max_nodes, False)[0],
                  None: moe.top_k_routing(logits, k, False)[0]}
        for limit, indices in routed.items():
            bound = moe_routing.max_cross_node_copies(k, nodes, limit)
            crossings = _crossings(indices, per_node, source)
            assert max(crossings) == bound, (nodes, per_node, k, limit, source)
            assert moe_routing.cross_node_dispatch_bytes(indices, per_node, source, 8, 2) <= \
                moe_routing.max_cross_node_dispatch_bytes(len(logits), k, nodes, 8, 2, limit)


def test_max_cross_node_bytes_of_the_pages_example():
    """DeepSeek-V3's k = 8 on 8 nodes: a token crosses at most 7 times, not 8, so limiting it to
    M = 4 nodes saves 7/4 = 1.75x of the bound, not k/M = 2x."""
    plain = moe_routing.max_cross_node_dispatch_bytes(4096, 8, 8, 7168, 2)
    limited = moe_routing.max_cross_node_dispatch_bytes(4096, 8, 8, 7168, 2, max_nodes=4)
    assert plain == 4096 * 7 * 7168 * 2 == 411_041_792 and limited == 4096 * 4 * 7168 * 2
    assert plain / limited == 1.75


def test_max_cross_node_copies_refuses_impossible_limits():
    for k, nodes, max_nodes in ((0, 8, None), (8, 0, None), (8, 4, 5), (8, 4, 0)):
        with pytest.raises(ValueError, match="max_nodes"):
            moe_routing.max_cross_node_copies(k, nodes, max_nodes)


def test_deepseek_v3_sequence_wise_balance_loss_is_the_switch_loss_on_one_sequence():
    """The page's reading of DeepSeek-V3's equations 17 to 20: with f_i = N_r/(K_r·T)·(times i is
    among a token's K_r top affinities) and P_i the mean of the affinities normalised per token,
    α·Σ f_i·P_i is the course's Switch loss α·E·Σ f_i·P_i of one sequence, fed log-affinities as
    logits (softmax(log s) = s / Σ s)."""
    rng = np.random.default_rng(3)
    for tokens, routed, per_token in ((64, 16, 4), (200, 8, 2), (33, 12, 3)):
        affinities = 1 / (1 + np.exp(-rng.standard_normal((tokens, routed)) * 2))  # sigmoid scores
        chosen = np.argsort(-affinities, axis=1, kind="stable")[:, :per_token]
        counts = np.bincount(chosen.reshape(-1), minlength=routed)
        f = routed / (per_token * tokens) * counts
        normalised = affinities / affinities.sum(axis=1, keepdims=True)
        alpha = 1e-4
        deepseek = alpha * float(f @ normalised.mean(axis=0))
        course, _ = moe.load_balancing_loss_and_gradient(np.log(affinities), chosen, alpha)
        assert np.isclose(deepseek, course, rtol=1e-12, atol=0)
    balanced = np.tile(np.eye(4), (2, 1)) + 1.0  # every expert chosen equally, equal mean affinity
    f = 4 / (1 * 8) * np.bincount(np.argmax(balanced, axis=1), minlength=4)
    assert np.isclose(alpha * f @ (balanced / balanced.sum(axis=1, keepdims=True)).mean(axis=0), alpha)
