"""The planner's closed forms: parameter counts against torch models built on the meta device,
memory against dtp.memory.calculator (the dense case) and by hand (MoE), the step time by hand, the
enumeration against a brute force, and the ranked table's invariants."""
import itertools
import math

import pytest
import torch
from torch import nn

from dtp.memory import calculator, formulas as memory
from dtp.ep import moe
from dtp.pp import schedules as pipeline
from dtp.tp import tensor_parallel
from dtp.zero import formulas as zero
from dtp.topology import planner
from dtp.common.gpt import GPT

SMALL_MOE = planner.ModelShape(layers=4, hidden=64, heads=4, vocab=100, seq=32, experts=8, top_k=2,
                               expert_hidden=96, capacity_factor=1.25)


class ExpertMLPs(nn.Module):
    """What the planner counts in place of a block's MLP: a bias-free router and E GPT MLPs of width f."""

    def __init__(self, hidden: int, width: int, experts: int):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(hidden, width), nn.GELU(), nn.Linear(width, hidden))
                                     for _ in range(experts))


def meta_numel(model: planner.ModelShape) -> tuple[int, int]:
    """(all parameters, one expert's) of the model built on the meta device."""
    with torch.device("meta"):
        gpt = GPT(model.config)
        if model.is_moe:
            for block in gpt.blocks:
                block.mlp = ExpertMLPs(model.hidden, model.expert_width, model.experts)
    expert = sum(p.numel() for p in gpt.blocks[0].mlp.experts[0].parameters()) if model.is_moe else 0
    return sum(p.numel() for p in gpt.parameters()), expert


@pytest.mark.parametrize("model", [planner.DENSE_70B, planner.MOE_409B, SMALL_MOE,
                                   planner.ModelShape(6, 128, 8, 500, 64, experts=4, top_k=1)],
                         ids=["dense-70B", "moe-409B", "small-moe", "moe-top-1"])
def test_parameter_counts_are_the_torch_model_s(model):
    counts = planner.parameter_counts(model)
    total, expert = meta_numel(model)
    assert counts["total"] == total
    assert counts["experts"] == model.layers * model.experts * expert * model.is_moe
    assert counts["active"] == total - model.layers * (model.experts - model.top_k) * expert * model.is_moe
    assert counts["non_expert"] + counts["experts"] == total


def test_the_chapter_s_models_have_the_sizes_the_page_names():
    assert round(planner.parameter_counts(planner.MOE_409B)["total"] / 1e9) == 409
    assert round(planner.parameter_counts(planner.DENSE_70B)["total"] / 1e9) == 65
    assert planner.A100_CLUSTER.memory_bytes == 80 * 2**30 and planner.A100_CLUSTER.gpus == 1024


def test_an_mlp_keeps_korthikanti_s_19_sbh_when_its_width_is_4h():
    assert planner.mlp_activation_bytes_per_token(1000, 4000) == 19 * 1000


LAYOUTS = [planner.PlannedLayout(8, 8, 16, 1, 1, 64), planner.PlannedLayout(4, 1, 256, 1, 3, 4, 1),
           planner.PlannedLayout(2, 4, 128, 1, 0, 8)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_dense_model_s_memory_is_the_calculator_s(layout, recompute):
    training = planner.Training(global_batch=1024, recompute=recompute)
    stage, breakdown = planner.peak_memory_per_gpu(planner.DENSE_70B, training, layout)
    expected = calculator.peak_memory_per_gpu(planner.DENSE_70B.config, "mixed_adam", calculator.Layout(
        layout.tp, layout.pp, layout.dp, layout.zero_stage, True, recompute, 1))
    assert (stage, breakdown) == expected


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_an_moe_model_s_memory_by_hand(recompute):
    model, training = SMALL_MOE, planner.Training(global_batch=64, micro_batch=2, recompute=recompute)
    layout = planner.PlannedLayout(tp=2, pp=2, dp=8, ep=4, zero_stage=1, micro_batches=4)
    counts = planner.parameter_counts(model)
    h, f, s, b, t, p, d, e = 64, 96, 32, 2, 2, 2, 8, 4
    # mixed-precision Adam, ZeRO-1: 2 + 2 bytes per parameter kept, 12 sharded over the group holding the same copy
    states = (4 * counts["non_expert"] + 12 * counts["non_expert"] / d) / (t * p) + \
        (4 * counts["experts"] + 12 * counts["experts"] / (d // e)) / (t * p * e)
    dense_activations = memory.activation_bytes_per_layer(s, b, h, 4, tensor_parallel=t, sequence_parallel=True,
                                                          recompute=recompute)
    extra = 0 if recompute == "full" else (1.25 * 2 * (3 * h + 4 * f) - 19 * h) * s * b / t
    first = planner.memory_per_gpu(model, training, layout, "first")
    assert sum(first[c] for c in zero.COMPONENTS) == pytest.approx(states, rel=1e-12)
    assert first["activations"] == pytest.approx(2 * p * (dense_activations + extra), rel=1e-12)  # 2 layers, p held
    last = planner.memory_per_gpu(model, training, layout, "last")
    assert last["activations"] == pytest.approx(2 * (dense_activations + extra), rel=1e-12)
    assert last["logits"] == 4 * s * b * 100 / t


def test_the_step_time_by_hand():
    """One MoE layout on four nodes of 4: every term computed here from the definitions."""
    model, training = SMALL_MOE, planner.Training(global_batch=64, micro_batch=1, flops_utilization=0.4)
    cluster = planner.Cluster(nodes=4, gpus_per_node=4, memory_bytes=80 * 2**30, intra_node_bytes_per_s=200e9,
                              inter_node_bytes_per_s=20e9, peak_flops=100e12)
    layout = planner.PlannedLayout(tp=2, pp=2, dp=4, ep=2, zero_stage=1, micro_batches=16)
    counts = planner.parameter_counts(model)
    s, h, w, L, m = 32, 64, 2, 4, 16
    message = s * h * w
    capacity = math.ceil(1.25 * (s // 2) * 2 / 8)  # each TP rank routes its own s/t tokens (sequence parallel)
    # 4 all-reduces per layer, 2(t-1)/t = 1 for t = 2; the MLP's two become the tensor-parallel experts'
    # all-gather and reduce-scatter of the E·C rows a GPU received, forward and backward: 2·2(t-1)·E·C·h·w
    tp_bytes = (L // 2) * m * (2 * message + 2 * 2 * 8 * capacity * h * w)
    pp_bytes = 1 * m * message / 2  # two stages: one direction, 1/t of each activation
    dp_bytes = 2 * (3 / 4) * counts["non_expert"] / 4 * w  # ring: 2(d-1)/d of the GPU's non-expert parameters
    expert_dp_bytes = 2 * (1 / 2) * counts["experts"] / 8 * w  # over d/e = 2 ranks, experts split t·p·e = 8 ways
    ep_bytes = (L // 2) * m * 4 * (1 / 2) * 8 * capacity * h * w  # each all-to-all sends (e-1)/e of E·C rows
    # Rank strides: tp 1, ep 2, pp 4, expert_dp 8. Nodes of 4: TP ([0, 1]) and EP ([0, 2]) inside; PP ([0, 4]),
    # expert_dp ([0, 8]) and DP ([0, 2, 8, 10]) across.
    compute = memory.hardware_flops_per_token(counts["active"], L, h, s, "selective") * 64 * s / (16 * 100e12 * 0.4)
    in_micro_batches = compute + tp_bytes / 200e9 + ep_bytes / 200e9
    # DP traffic hides under the last micro-batch's backward only: 2/3 of one micro-batch's compute
    exposed_dp = max(0.0, (dp_bytes + expert_dp_bytes) / 20e9 - 2 / 3 * compute / m)
    assert exposed_dp > 0
    total = in_micro_batches * (m + 1) / m + pp_bytes / 20e9 + exposed_dp
    times = planner.step_time(model, cluster, training, layout)
    assert times["total"] == pytest.approx(total, rel=1e-12)
    assert times["dp"] + times["expert_dp"] == pytest.approx(exposed_dp, rel=1e-12)
    row = planner.evaluate(model, cluster, training, layout)
    assert row["intra_node_bytes"] == pytest.approx(tp_bytes + ep_bytes, rel=1e-12)
    assert row["inter_node_bytes"] == pytest.approx(pp_bytes + dp_bytes + expert_dp_bytes, rel=1e-12)
    assert row["bubble"] == pipeline.bubble_fraction(2, 16) == 1 / 17


def test_tp_traffic_is_the_tensor_chapter_s_and_full_recomputation_repeats_the_forward():
    model = planner.DENSE_70B
    layout = planner.PlannedLayout(8, 4, 32, 1, 1, 32)
    selective = planner.traffic_per_gpu(model, planner.A100_CLUSTER, planner.Training(1024), layout)["tp"]["bytes"]
    full = planner.traffic_per_gpu(model, planner.A100_CLUSTER, planner.Training(1024, recompute="full"),
                                   layout)["tp"]["bytes"]
    per_layer = tensor_parallel.ring_bytes_per_gpu_per_layer(4096, 8192, 8)
    assert selective == 20 * 32 * per_layer
    assert full == selective * 6 / 4
    # the page's formula, L/p · m · n · 2(t-1)/t · S with S = b·s·h·w: n = 4 all-reduces per layer (two
    # forward, two backward), 6 with full recomputation (the forward runs twice)
    message = 4096 * 8192 * 2
    for training, collectives in ((planner.Training(1024), 4), (planner.Training(1024, recompute="full"), 6)):
        assert planner.traffic_per_gpu(model, planner.A100_CLUSTER, training, layout)["tp"]["bytes"] == \
            pytest.approx(80 / 4 * 32 * collectives * 2 * 7 / 8 * message, rel=1e-12)


def test_ep_dispatches_each_tp_rank_s_own_tokens():
    """Item 2 of issue 24: with sequence parallelism each of the t GPUs of a TP group dispatches its
    b·s/t tokens, not the whole micro-batch (the slip the planner made before)."""
    layout = planner.PlannedLayout(8, 8, 16, 8, 1, 64)
    traffic = planner.traffic_per_gpu(planner.MOE_409B, planner.H100_CLUSTER, planner.FOUR_MILLION_TOKENS, layout)
    capacity = moe.expert_capacity(4096 // 8, 16, 2, 1.0)
    assert traffic["ep"]["bytes"] == 10 * 64 * moe.capacity_all_to_all_bytes(8, 16, capacity, 8192, 2)
    whole = 10 * 64 * moe.capacity_all_to_all_bytes(8, 16, moe.expert_capacity(4096, 16, 2, 1.0), 8192, 2)
    assert traffic["ep"]["bytes"] == whole / 8
    assert traffic["ep"]["link"] == "inter-node"  # TP fills the node: the EP group spans 8 nodes


def test_whole_experts_fold_their_all_to_all_over_tp_and_ep():
    """expert_tp = 1: the all-to-all group is the t·e GPUs of TP and EP (inside a node when t·e
    divides it), and the MLP's TP collectives are gone."""
    model, cluster, training = planner.MOE_409B, planner.H100_CLUSTER, planner.FOUR_MILLION_TOKENS
    folded = planner.PlannedLayout(8, 8, 16, 1, 1, 64, 0, expert_tp=1)
    split = planner.PlannedLayout(8, 8, 16, 1, 1, 64)
    a, b = (planner.traffic_per_gpu(model, cluster, training, layout) for layout in (folded, split))
    capacity = moe.expert_capacity(4096 // 8, 16, 2, 1.0)
    assert a["ep"]["bytes"] == 10 * 64 * moe.capacity_all_to_all_bytes(8, 16, capacity, 8192, 2)
    assert a["ep"]["link"] == "intra-node" and b["ep"]["bytes"] == 0
    attention_only = 10 * 64 * tensor_parallel.ring_bytes_per_gpu_per_layer(4096, 8192, 8) / 2
    assert a["tp"]["bytes"] == pytest.approx(attention_only, rel=1e-12)
    assert b["tp"]["bytes"] > attention_only


def test_zero_2_and_3_reduce_every_micro_batch_or_hold_unsharded_gradients():
    """Item 1 of issue 24: the issue's 70B example (TP 8 x DP 128, m = 8), ZeRO-3 reducing every
    micro-batch sends about 387 GB per GPU per step, not the 48 GB of once per step; accumulating
    unsharded gradients saves the gradient traffic (not the weights') and holds 2Ψ more bytes.
    The formulas are dtp.zero.formulas's, which tests/zero/test_zero_mixed.py pins to the bytes dtp.zero.sharded's
    runs send on gloo (reduce-scatter per micro-batch and the per-micro-batch gathers)."""
    model, cluster, training = planner.DENSE_70B, planner.A100_CLUSTER, planner.FOUR_MILLION_TOKENS
    psi = planner.parameter_counts(model)["non_expert"] / 8
    ring = 127 / 128 * psi * 2
    every = planner.PlannedLayout(8, 1, 128, 1, 3, 8, 1)
    once = planner.PlannedLayout(8, 1, 128, 1, 3, 8, 0)
    sent = {layout.reduce_every_micro_batch: planner.traffic_per_gpu(model, cluster, training, layout)["dp"]["bytes"]
            for layout in (every, once)}
    assert sent[1] == pytest.approx(3 * 8 * ring, rel=1e-12) and round(sent[1] / 1e9) == 387
    assert sent[0] == pytest.approx((1 + 2 * 8) * ring, rel=1e-12)
    for stage in (2, 3):
        rows = {every: planner.evaluate(model, cluster, training, planner.PlannedLayout(8, 1, 128, 1, stage, 8, every))
                for every in (0, 1)}
        assert rows[0]["memory_bytes"] - rows[1]["memory_bytes"] == pytest.approx(2 * psi, rel=1e-12)
    two = {every: planner.traffic_per_gpu(model, cluster, training, planner.PlannedLayout(8, 1, 128, 1, 2, 8, every))
           for every in (0, 1)}
    assert two[1]["dp"]["bytes"] == pytest.approx((8 + 1) * ring, rel=1e-12)
    assert two[0]["dp"]["bytes"] == pytest.approx(2 * ring, rel=1e-12)


def test_zero_with_pipelining_is_planned():
    """Item 3 of issue 24: ZeRO-2/3 with PP > 1 (Llama 3 405B's FSDP-style sharding with PP), with
    the per-micro-batch traffic of ZeRO-3 gathering its stage's weights for every micro-batch."""
    model, cluster, training = planner.DENSE_70B, planner.A100_CLUSTER, planner.FOUR_MILLION_TOKENS
    candidates = planner.candidate_layouts(model, cluster, training)
    assert {(c.zero_stage, c.reduce_every_micro_batch) for c in candidates if c.pp > 1} == \
        {(0, 0), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1)}
    layout = planner.PlannedLayout(8, 8, 16, 1, 3, 64, 1)
    psi = planner.parameter_counts(model)["non_expert"] / 64
    assert planner.traffic_per_gpu(model, cluster, training, layout)["dp"]["bytes"] == \
        pytest.approx(3 * 64 * 15 / 16 * psi * 2, rel=1e-12)


def brute_force_candidates(model, cluster, training):
    found = []
    for tp, pp, ep, stage, every, etp in itertools.product(range(1, 9), range(1, model.layers + 1), range(1, 17),
                                                           range(4), (0, 1), range(1, 9)):
        dp, rest = divmod(cluster.gpus, tp * pp)
        if rest or cluster.gpus_per_node % tp or model.heads % tp or model.seq % tp or model.layers % pp:
            continue
        if dp % ep or model.experts % ep or (not model.is_moe and ep > 1) or (every and stage < 2):
            continue
        if etp != tp and not (etp == 1 and model.is_moe and model.experts % (tp * ep) == 0):
            continue
        m, rest = divmod(training.global_batch, dp * training.micro_batch)
        if not rest and m >= pp:
            found.append(planner.PlannedLayout(tp, pp, dp, ep, stage, m, every, etp))
    return found


@pytest.mark.parametrize("model", [planner.DENSE_70B, planner.MOE_409B], ids=["dense", "moe"])
def test_the_enumeration_and_the_ranked_table(model):
    cluster, training = planner.A100_CLUSTER, planner.FOUR_MILLION_TOKENS
    candidates = planner.candidate_layouts(model, cluster, training)
    assert sorted(candidates, key=str) == sorted(brute_force_candidates(model, cluster, training), key=str)
    rows = planner.plan(model, cluster, training)
    fitting = [planner.evaluate(model, cluster, training, c) for c in candidates]
    assert len(rows) == sum(row["fits"] for row in fitting) > 0
    assert all(row["memory_bytes"] <= cluster.memory_bytes for row in rows)
    assert [row["step_time_s"] for row in rows] == sorted(row["step_time_s"] for row in rows)
    assert 0 < rows[0]["mfu"] < planner.FOUR_MILLION_TOKENS.flops_utilization


def test_both_rank_orders_are_evaluated_and_differ_where_tp_leaves_room_in_the_node():
    """TP 2 on nodes of 8: DP outermost keeps a PP group of 4 inside the node; PP outermost keeps
    a DP group of 4 inside it instead."""
    model, cluster = planner.DENSE_70B, planner.A100_CLUSTER
    layout = planner.PlannedLayout(2, 4, 128, 1, 1, 8)
    dp_out = planner.traffic_per_gpu(model, cluster, planner.Training(1024), layout)
    pp_out = planner.traffic_per_gpu(model, cluster, planner.Training(1024, pp_outermost=True), layout)
    assert (dp_out["pp"]["link"], dp_out["dp"]["link"]) == ("intra-node", "inter-node")
    assert (pp_out["pp"]["link"], pp_out["dp"]["link"]) == ("inter-node", "inter-node")
    small = planner.PlannedLayout(2, 4, 2, 1, 1, 8)
    tiny = planner.Cluster(2, 8, 80 * 2**30, 300e9, 25e9, 312e12)
    assert planner.traffic_per_gpu(model, tiny, planner.Training(16, pp_outermost=True), small)["dp"]["link"] == \
        "intra-node"
