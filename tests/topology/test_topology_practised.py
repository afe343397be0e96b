"""The practised planner's cost model (`cost_model="roofline"`): GEMMs on a roofline, each
dimension's exposure from the overlap chapter's model, NCCL's latencies and contention, the
stages' own work, and the practices of the runs the validation models (DeepSeek-V3's dispatch and
FP8, Llama 3's CP and balanced stages, DualPipe)."""
import dataclasses
import math

import pytest
import torch

from dtp.overlap import model as overlap
from dtp.topology import collectives, costs as planner_costs, planner
from dtp.topology.stage_memory import layers_per_stage
from dtp.tp import tensor_parallel


def quiet(cluster):
    """The cluster without NCCL's latencies and without contention: the exposure model alone."""
    return dataclasses.replace(cluster, alpha_s=(), collective_base_s=0.0, contention=0.0)


def test_a_gemm_runs_at_the_ceiling_or_at_its_intensity_times_the_memory_bandwidth():
    peak, hbm = 312e12, 2039e9
    big = planner_costs.gemm_seconds(8192, 8192, 8192, peak, hbm, 0.8)
    assert big == pytest.approx(2 * 8192**3 / (0.8 * peak), rel=1e-12)  # compute bound
    # attention's QKᵀ with 64-wide heads: intensity 2·s·s·64 / (2(s·64 + 64·s + s·s)) < 0.8·peak / hbm
    s = 2048
    intensity = 2 * s * s * 64 / (2 * (2 * s * 64 + s * s))
    assert intensity * hbm < 0.8 * peak
    assert planner_costs.gemm_seconds(s, s, 64, peak, hbm, 0.8) == pytest.approx(2 * s * s * 64 / (intensity * hbm))


def test_tp_exposure_is_the_overlap_chapter_s_and_can_be_switched_off():
    model, cluster = planner.DENSE_70B, quiet(planner.A100_CLUSTER)
    layout = planner.PlannedLayout(8, 8, 16, 1, 1, 64)
    hidden = planner.Training(1024, cost_model="roofline")
    exposed = planner.Training(1024, cost_model="roofline", tp_overlap=False)
    # the roofline model's links run at what NCCL achieves: the rate times the measured efficiency
    tp = planner.traffic_per_gpu(model, cluster, hidden, layout)["tp"]["bytes"] / (
        cluster.intra_node_bytes_per_s * cluster.intra_node_efficiency)
    compute = planner_costs.micro_batch_compute(model, cluster, hidden, layout)
    per_collective = tp / (64 * 10 * 4)
    expected = 64 * 10 * overlap.tp_layer_exposed(per_collective, compute["layer_forward_gemm"] / 2)
    assert planner.step_time(model, cluster, hidden, layout)["tp"] == pytest.approx(expected, rel=1e-12)
    assert planner.step_time(model, cluster, exposed, layout)["tp"] == pytest.approx(tp, rel=1e-12)
    assert expected < tp


def test_interleaving_divides_the_fill_and_drain_by_v():
    """Equal stages of 10 layers, the last with the output layer: the fill and drain is the seven
    other stages' time per micro-batch, divided by v (Narayanan et al. 2021's (p-1)/v)."""
    model, cluster, layout = planner.DENSE_70B, quiet(planner.A100_CLUSTER), planner.PlannedLayout(8, 8, 16, 1, 1, 64)
    for v in (1, 4):
        training = planner.Training(1024, cost_model="roofline", chunks=v)
        parts = planner.step_time(model, cluster, training, layout)
        logits = planner_costs.micro_batch_compute(model, cluster, training, layout)["logits"]
        interior = (parts["compute"] + parts["tp"]) / 64 - 3 * logits  # the last stage's, less the output layer
        assert parts["bubble"] == pytest.approx(7 * interior / v, rel=1e-12)


def test_the_roofline_s_measured_constants_and_switches():
    """Each assumption of the practised model is a parameter with its measured value: NCCL's share
    of the link rate, cuBLAS's and flash attention's shares of the peak; Megatron-LM 2021's
    gradient all-reduce after backward is all exposed; the optimizer step is a memory-bound pass
    of 34 bytes per parameter the busiest stage's GPU updates (the first stage: its layers and the
    embedding)."""
    a100, h100 = planner.A100_CLUSTER, planner.H100_CLUSTER
    assert a100.gemm_ceiling == pytest.approx(267.9 / 312) and h100.gemm_ceiling == pytest.approx(792.1 / 989.4)
    assert a100.achieved_bandwidth("intra-node") == pytest.approx(300e9 * 370 / 450)
    assert a100.achieved_bandwidth("inter-node") == pytest.approx(24e9)
    assert h100.achieved_bandwidth("inter-node") == pytest.approx(48e9)
    model, layout, cluster = planner.DENSE_70B, planner.PlannedLayout(8, 8, 16, 1, 1, 64), quiet(a100)
    after = planner.Training(1024, cost_model="roofline", dp_overlap=False)
    sent = sum(planner.dp_sent_per_gpu(model, after, layout, "dp").values())  # ZeRO-1's weight gather exposed too
    link = planner.traffic_per_gpu(model, cluster, after, layout)["dp"]["link"]
    times = planner.step_time(model, cluster, after, layout)
    assert times["dp"] == pytest.approx(sent / cluster.achieved_bandwidth(link), rel=1e-12)
    assert planner.step_time(model, cluster, planner.Training(1024, cost_model="roofline"), layout)["dp"] < times["dp"]
    counts = planner.parameter_counts(model)
    first_stage = (counts["total"] - 80 * 12 * 8192**2 * (1 + 13 / (12 * 8192))) / 2 + 10 * (12 * 8192**2 + 13 * 8192)
    per_gpu = max(first_stage, counts["total"] / 8) / (8 * 16)  # ZeRO-1 shards the optimizer over DP
    assert times["optimizer"] == pytest.approx(34 * per_gpu / a100.hbm_bytes_per_s, rel=1e-2)
    assert planner.step_time(model, cluster, dataclasses.replace(after, optimizer_step=False), layout)["optimizer"] == 0


def test_context_parallelism_splits_activations_and_passes_k_v_around_a_ring():
    """CP c: tp·cp·pp·dp = GPUs; each GPU keeps 1/c of the activations; the ring's K/V bytes per
    layer are dtp.cp.context_parallel's (forward + backward, K/V widths kv_hidden/t); the gradients
    are reduced over dp·cp; TP's collectives carry the GPU's s/c tokens."""
    from dtp.cp import context_parallel

    model = planner.ModelShape(layers=8, hidden=1024, heads=16, vocab=1000, seq=32768, kv_heads=4)
    cluster = planner.Cluster(4, 8, 80 * 2**30, 300e9, 25e9, 312e12, hbm_bytes_per_s=2e12)
    training = planner.Training(8, cost_model="roofline", max_context_parallel=4, flash_attention=True)
    one = planner.PlannedLayout(tp=2, pp=1, dp=16, ep=1, zero_stage=1, micro_batches=1, cp=1)
    four = planner.PlannedLayout(tp=2, pp=1, dp=4, ep=1, zero_stage=1, micro_batches=2, cp=4)
    traffic = planner.traffic_per_gpu(model, cluster, training, four)
    tokens, kv = 32768, 4 * 64 / 2
    ring = context_parallel.ring_bytes_per_layer(tokens, kv, 4) + context_parallel.ring_backward_bytes_per_layer(
        tokens, kv, 4)
    assert traffic["cp"]["bytes"] == pytest.approx(8 * 2 * ring)
    assert traffic["cp"]["link"] == "intra-node" and traffic["dp"]["link"] == "inter-node"
    assert traffic["tp"]["bytes"] == pytest.approx(
        8 * 2 * tensor_parallel.ring_bytes_per_gpu_per_layer(tokens // 4, 1024, 2, 2, ("forward", "backward")))
    assert traffic["dp"]["bytes"] == pytest.approx(
        planner.dp_bytes_per_gpu(planner.parameter_counts(model)["total"] / 2, 16, four, 2))
    first = {layout.cp: planner.memory_per_gpu(model, training, layout, "first")["activations"] for layout in (one, four)}
    assert first[4] == pytest.approx(first[1] / 4)
    from dtp.topology import search

    pipelines = list(search.configurations(model, cluster, training))
    assert {cp for _, cp, *_ in pipelines} == {1, 2, 4}
    assert all(tp * cp * pp * dp == 32 for tp, cp, pp, _, _, dp, *_ in pipelines)
    assert planner.step_time(model, cluster, training, four)["cp"] >= 0



def test_the_planner_s_dispatch_bytes_are_what_a_tp_x_ep_world_sends_on_gloo():
    """Item 2 of issue 24, pinned to a measurement: on a gloo world of 4 (TP 2 x EP 2, sequence
    parallel, dtp.ep.tp_ep) each rank's forward dispatch sends what the planner charges per
    all-to-all; without sequence parallelism the ranks send twice that (the old planner's count)."""
    from dtp.ep import tp_ep as moe_tp_ep

    seq, hidden, experts, k = 48, 16, 8, 2
    runs = moe_tp_ep.measure_tp_ep(seq_tokens=seq, hidden=hidden, expert_hidden=24, num_experts=experts, k=k)
    model = planner.ModelShape(layers=1, hidden=hidden, heads=2, vocab=100, seq=seq, experts=experts, top_k=k,
                               capacity_factor=experts / k)  # the measurement's capacity: nothing dropped
    training = planner.Training(global_batch=2, bytes_per_value=8)  # float64 on gloo
    cluster = planner.Cluster(1, 4, 80 * 2**30, 100e9, 10e9, 1e12)
    layout = planner.PlannedLayout(tp=2, pp=1, dp=2, ep=2, zero_stage=0, micro_batches=1)
    per_all_to_all = planner.traffic_per_gpu(model, cluster, training, layout)["ep"]["bytes"] / 4
    assert runs["sp"]["bytes"] == [per_all_to_all] * 4
    assert runs["no_sp"]["bytes"] == [2 * per_all_to_all] * 4


@pytest.mark.parametrize("expert_tp", [8, 1])
def test_the_roofline_s_expert_gemms_do_the_active_experts_flops(expert_tp):
    """Whichever way the experts are split, one GPU's expert GEMMs do cf·k/t of a micro-batch's
    tokens through an expert's two matrices (a check on the shapes the roofline is fed)."""
    model, training = planner.MOE_409B, planner.Training(1024, micro_batch=2, cost_model="roofline")
    layout = planner.PlannedLayout(8, 1, 128, 2, 1, 4, 0, expert_tp)
    experts = planner_costs.layer_gemms(model, training, layout)[4:]
    flops = sum(2 * m * n * k * batch for m, n, k, batch in experts)
    tokens = 2 * 4096 * 2 / 8  # b·s top-2 copies, split over t = 8 GPUs (capacity factor 1, C exact here)
    assert flops == pytest.approx(tokens * 2 * 2 * 8192 * 18432, rel=1e-12)


# --- practices the validation models (DeepSeek-V3's dispatch, Llama 3's CP) ---------------------

def test_node_limited_dispatch_copies_closed_form_and_against_the_routing_rule():
    """DeepSeek-V3's k = 8 of 256 experts on 8 nodes of 8 GPUs, M = 4: the closed form sends
    M·(N-1)/N = 3.5 copies per token over InfiniBand (not one per expert: 8·7/8 = 7) and
    M·D·(G-1)/G over NVLink, D = 8(1 - C(28,2)/C(32,2)); dtp.ep.routing's node_limited_routing on
    independent scores (a balanced router) agrees: a token's experts fill 4 nodes, its remote nodes
    (cross_node_dispatch_bytes, averaged over the source node) and its forwarded GPUs."""
    import numpy as np

    from dtp.ep import routing as moe_routing

    copies = moe_routing.node_limited_dispatch_copies(8, 256, 8, 8, 4)
    gpus_per_node = 8 * (1 - math.comb(28, 2) / math.comb(32, 2))
    assert copies["inter_node"] == pytest.approx(3.5) and copies["nodes"] == 4
    assert copies["intra_node"] == pytest.approx(4 * gpus_per_node * 7 / 8)
    indices, _ = moe_routing.node_limited_routing(np.random.default_rng(0).standard_normal((2048, 256)), 8, 32, 4, False)
    nodes = np.mean([len(set(row)) for row in (indices // 32).tolist()])
    remote = np.mean([moe_routing.cross_node_dispatch_bytes(indices, 32, source, 1, 1) / 2048 for source in range(8)])
    forwarded = np.mean([len(set(row)) for row in (indices // 4).tolist()]) * 7 / 8
    assert nodes == pytest.approx(copies["nodes"], rel=0.02)
    assert remote == pytest.approx(copies["inter_node"], rel=0.02) and remote < 0.6 * 8 * 7 / 8
    assert forwarded == pytest.approx(copies["intra_node"], rel=0.03)
    with pytest.raises(ValueError, match="divisible"):
        moe_routing.node_limited_dispatch_copies(6, 256, 8, 8, 4)


def _deepseek_like():
    model = planner.ModelShape(layers=4, hidden=256, heads=4, vocab=1000, seq=512, experts=256, top_k=9,
                               expert_hidden=128, shared_experts=1, max_nodes=4)
    cluster = planner.Cluster(16, 8, 80 * 2**30, 200e9, 50e9, 989e12, hbm_bytes_per_s=3.35e12)
    layout = planner.PlannedLayout(tp=1, pp=2, dp=64, ep=64, zero_stage=1, micro_batches=4)
    return model, cluster, layout


def test_node_limited_ep_traffic_fp8_dispatch_and_the_longer_link():
    """Per MoE layer and micro-batch a GPU sends its b·s/t tokens' expected copies in a dispatch
    (FP8 with a float32 scale per 128 values) and a combine (bf16) per pass, forward twice with
    full recomputation: IB bytes on "ep", NVLink forwarding on "ep_intra", and EP takes the longer
    of the two; with capacity accounting the shared expert's copies are not sent."""
    from dtp.ep import routing as moe_routing

    model, cluster, layout = _deepseek_like()
    training = planner.Training(8, recompute="full", ep_dispatch="node_limited", fp8_dispatch=True)
    traffic = planner.traffic_per_gpu(model, cluster, training, layout)
    copies = moe_routing.node_limited_dispatch_copies(8, 256, 8, 8, 4)
    per_copy = 256 * (1 + 4 / 128 + 2)
    for name, key, link in (("ep", "inter_node", "inter-node"), ("ep_intra", "intra_node", "intra-node")):
        assert traffic[name]["bytes"] == pytest.approx(2 * 4 * 3 * 512 * copies[key] * per_copy)
        assert traffic[name]["link"] == link
    times = planner.step_time(model, cluster, training, layout, traffic)
    assert "ep_intra" not in times
    assert times["ep"] == pytest.approx(max(traffic["ep"]["bytes"] / 50e9, traffic["ep_intra"]["bytes"] / 200e9))
    bf16 = planner.traffic_per_gpu(model, cluster, dataclasses.replace(training, fp8_dispatch=False), layout)
    assert bf16["ep"]["bytes"] == pytest.approx(traffic["ep"]["bytes"] * 4 / (1 + 4 / 128 + 2))
    capacity = planner.traffic_per_gpu(model, cluster, planner.Training(8, recompute="full"), layout)["ep"]["bytes"]
    unshared = planner.traffic_per_gpu(dataclasses.replace(model, shared_experts=0), cluster,
                                       planner.Training(8, recompute="full"), layout)["ep"]["bytes"]
    assert capacity == pytest.approx(unshared * 8 / 9)
    inside = dataclasses.replace(layout, dp=32, pp=4, ep=8)  # one node: no node limit to apply
    assert "ep_intra" not in planner.traffic_per_gpu(model, cluster, training, inside)
    with pytest.raises(ValueError, match="ep_dispatch"):
        planner.traffic_per_gpu(model, cluster, dataclasses.replace(training, ep_dispatch="dropless"), layout)


def test_fp8_linear_gemms_bf16_attention_and_the_sms_communication_holds():
    """With fp8_gemms the linear layers' GEMMs run at the FP8 ceiling of the FP8 peak with 1-byte
    operands; attention keeps the bf16 peak; comm_sm_share slows every product by 1/(1 - share)."""
    model, cluster, layout = _deepseek_like()
    cluster = dataclasses.replace(cluster, fp8_peak_flops=1979e12, fp8_gemm_ceiling=0.7, attention_ceiling=0.35)
    bf16 = planner.Training(8, cost_model="roofline", flash_attention=True)
    fp8 = dataclasses.replace(bf16, fp8_gemms=True)
    gemms = planner_costs.layer_gemms(model, bf16, layout)
    layer = planner_costs.forward_layer_seconds(model, cluster, fp8, layout)
    linear = [planner_costs.gemm_seconds(m, n, k, 1979e12, 3.35e12, 0.7, batch, bytes_per_value=1)
              for m, n, k, batch in gemms[:2] + gemms[4:]]
    attention = sum(2 * m * n * k * batch / (0.35 * 989e12) for m, n, k, batch in gemms[2:4])
    assert layer["gemm"] == pytest.approx(sum(linear) + attention, rel=1e-12)
    assert layer["attention_core"] == pytest.approx(attention, rel=1e-12)
    held = planner_costs.forward_layer_seconds(model, cluster, dataclasses.replace(fp8, comm_sm_share=0.25), layout)
    assert held["gemm"] == pytest.approx(layer["gemm"] / 0.75, rel=1e-12)
    with pytest.raises(ValueError, match="fp8_peak_flops"):
        planner_costs.forward_layer_seconds(model, dataclasses.replace(cluster, fp8_peak_flops=0.0), fp8, layout)


def test_dualpipe_bubble_and_the_costliest_stage():
    """DualPipe's bubble is DeepSeek-V3's Table 2, (p/2 - 1)(F&B + B - 3W) with F&B = F + B, below
    1F1B's; with balanced stages (the embedding and output layer as one layer each) the costliest
    stage is an interior one when the output layer costs less than a layer, the last one when it
    costs more."""
    model, cluster, layout = _deepseek_like()
    cluster = quiet(cluster)
    training = planner.Training(8, cost_model="roofline", flash_attention=True)
    dual = dataclasses.replace(training, pipeline_schedule="dualpipe")
    compute = planner_costs.micro_batch_compute(model, cluster, dual, layout)
    busiest = planner_costs.stage_compute(compute, 2, False)
    f, b, w = busiest["forward"], busiest["backward"], busiest["weight_gradient"]
    parts = planner.step_time(model, cluster, dual, layout)
    assert parts["bubble"] == pytest.approx((2 / 2 - 1) * (f + 2 * b - 3 * w))  # p = 2: no bubble at all
    deep = dataclasses.replace(layout, pp=4, dp=32, ep=32)
    parts = planner.step_time(model, cluster, dual, deep)
    one = planner_costs.stage_compute(planner_costs.micro_batch_compute(model, cluster, dual, deep), 1, False)
    f, b, w = one["forward"], one["backward"], one["weight_gradient"]
    assert parts["bubble"] == pytest.approx((4 / 2 - 1) * (f + 2 * b - 3 * w + (parts["tp"] + parts["ep"]) / 4))
    assert parts["bubble"] < planner.step_time(model, cluster, training, deep)["bubble"]
    with pytest.raises(ValueError, match="DualPipe"):
        planner.step_time(model, cluster, dual, dataclasses.replace(deep, micro_batches=5))
    llama = planner.ModelShape(layers=126, hidden=1024, heads=8, vocab=1000, seq=512)
    balanced = dataclasses.replace(training, balanced_stages=True)
    stage = planner.PlannedLayout(tp=1, pp=16, dp=4, ep=1, zero_stage=1, micro_batches=16)
    assert layers_per_stage(llama, balanced, stage) == (7,) + (8,) * 14 + (7,)
    # a small vocabulary: the output layer costs less than a layer, so an interior stage of 8 decides
    parts = planner.step_time(llama, cluster, balanced, stage)
    per_layer = planner_costs.micro_batch_compute(llama, cluster, balanced, stage)
    assert parts["compute"] == pytest.approx(16 * 8 * (per_layer["layer_forward"] + per_layer["layer_backward"]))
    wide = dataclasses.replace(llama, vocab=64000)  # now the last stage's 7 layers and output layer cost more
    parts = planner.step_time(wide, cluster, balanced, stage)
    per_layer = planner_costs.micro_batch_compute(wide, cluster, balanced, stage)
    last = planner_costs.stage_compute(per_layer, 7, True)
    assert 3 * per_layer["logits"] > per_layer["layer_forward"] + per_layer["layer_backward"]
    assert parts["compute"] == pytest.approx(16 * (last["forward"] + last["backward"]))


def _allgather_key_gradients(c, seq, heads, d):
    """Each rank's dK and dV for the whole gathered sequence (its queries' attention backward,
    zigzag layout, causal mask), and the full attention's."""
    from dtp.cp import context_parallel as cp

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(heads, seq, d, dtype=torch.float64, generator=generator) for _ in range(3))
    layout = cp.zigzag_positions(seq, c)
    buffers = []
    for rank in range(c):
        keys, values = k.clone().requires_grad_(), v.clone().requires_grad_()
        cp.masked_block(q[:, layout[rank]], keys, values, layout[rank], torch.arange(seq), True)[0].sum().backward()
        buffers.append(torch.stack([keys.grad, values.grad]))
    keys, values = k.clone().requires_grad_(), v.clone().requires_grad_()
    cp.attention_torch(q, keys, values, True).sum().backward()
    return buffers, torch.stack([keys.grad, values.grad]), layout


def test_allgather_cp_bytes_exposure_and_the_backward_reduce_scatter():
    """Llama 3's CP: per layer and micro-batch K/V all-gathered for each forward and dK/dV
    reduce-scattered in backward: every rank's attention backward fills a full-sequence dK/dV
    buffer, and summing them onto each token's owner gives the full attention's gradients (checked
    with autograd), so the backward moves what the gather moved, (c-1)/c of the full K/V; all of it
    exposed, where the ring's steps hide under attention."""
    from dtp.cp import context_parallel as cp

    c, seq, heads, d = 4, 16, 2, 3
    buffers, full, layout = _allgather_key_gradients(c, seq, heads, d)
    for rank in range(c):  # the reduce-scatter: each owner's share of the summed buffers
        torch.testing.assert_close(sum(buffer[:, :, layout[rank]] for buffer in buffers), full[:, :, layout[rank]])
    assert any(buffer[:, :, layout[(r + 1) % c]].abs().sum() > 0 for r, buffer in enumerate(buffers))
    assert cp.allgather_kv_backward_bytes_per_layer(seq, heads * d, c, grad_bytes=8) == \
        (c - 1) / c * full.numel() * 8 == cp.allgather_kv_bytes_per_layer(seq, heads * d, c, dtype_bytes=8)
    model = planner.ModelShape(layers=8, hidden=1024, heads=16, vocab=1000, seq=32768, kv_heads=4)
    cluster = planner.Cluster(4, 8, 80 * 2**30, 300e9, 25e9, 312e12, hbm_bytes_per_s=2e12)
    ring = planner.Training(8, cost_model="roofline", flash_attention=True, recompute="full")
    latency = collectives.collective_latency_s(cluster, "all_gather", 4, 1)
    assert latency == 0.0  # a cluster without NCCL's constants: bytes alone
    gather = dataclasses.replace(ring, cp_method="allgather")
    layout = planner.PlannedLayout(tp=2, pp=1, dp=4, ep=1, zero_stage=1, micro_batches=2, cp=4)
    tokens, kv = 32768, 4 * 64 / 2
    sent = planner.traffic_per_gpu(model, cluster, gather, layout)["cp"]["bytes"]
    assert sent == pytest.approx(8 * 2 * (2 * cp.allgather_kv_bytes_per_layer(tokens, kv, 4)
                                          + cp.allgather_kv_backward_bytes_per_layer(tokens, kv, 4)))
    assert planner.step_time(model, cluster, gather, layout)["cp"] == pytest.approx(sent / 300e9)  # TP·CP in a node
    assert planner.step_time(model, cluster, ring, layout)["cp"] < \
        planner.traffic_per_gpu(model, cluster, ring, layout)["cp"]["bytes"] / 300e9
    with pytest.raises(ValueError, match="cp_method"):
        planner.traffic_per_gpu(model, cluster, dataclasses.replace(ring, cp_method="ulysses"), layout)
