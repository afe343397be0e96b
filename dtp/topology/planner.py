"""A layout planner: for a model and a cluster, every layout (tp, pp, dp, ep, ZeRO stage,
micro-batches) the chapter enumerates, its memory per GPU, the bytes each GPU sends per step on
each link class, the pipeline bubble and an estimated step time, best first.

Everything is built from the other chapters' closed forms (one source of truth):
`dtp.memory.calculator.memory_per_gpu` (memory of a dense GPT for a layout, from the memory and ZeRO
chapters), `dtp.zero.formulas` (model states and gradient traffic per GPU), `dtp.tp.tensor_parallel` (ring
traffic of a layer), `dtp.pp.schedules` (bubble, boundary bytes), `dtp.ep.moe` (capacity, all-to-all
bytes) and `dtp.topology.mesh` (which link each dimension's groups ride). This module adds what they
do not cover: MoE layers, whose experts are sharded EP ways inside DP, and the step time.

The model: GPT blocks (`dtp.common.gpt`, untied output layer, no dropout); an MoE model replaces every
block's MLP by E experts of the same shape and adds a router (h·E weights), tokens going to k
experts. Layouts follow `dtp.topology.mesh.COURSE_ORDER` (TP innermost, then EP, PP, DP outermost)
or, with `Training.pp_outermost`, Megatron-Core's default (TP, EP, DP, PP). ZeRO-2/3 accumulate
gradients over micro-batches either way (`reduce_every_micro_batch`); MoE experts are
tensor-parallel or whole (`expert_tp`); each TP rank dispatches its own b·s/t tokens. Two
step-time models: "fixed" (the exercise's: a constant share of the peak, everything exposed) and
"roofline" (`dtp.topology.costs`), both stated in `step_time` and on the chapter's page;
tests/topology/test_topology_planner.py checks the counts against torch models and the traffic against
what gloo runs send.
"""
from __future__ import annotations

import itertools
import math

from dtp.cp import context_parallel
from dtp.ep import moe
from dtp.memory import calculator
from dtp.memory import formulas as memory
from dtp.pp import schedules as pipeline
from dtp.topology import costs as planner_costs
from dtp.topology.mesh import INTER_NODE, INTRA_NODE, dimension_links
from dtp.topology.shapes import (
    LAYOUT_FIELDS,
    SEARCHED_FIELDS,
    Cluster,
    ModelShape,
    PlannedLayout,
    Training,
    expert_tokens_per_gpu,
    parameter_counts,
)
from dtp.tp import tensor_parallel
from dtp.zero import formulas as zero

# --- memory -------------------------------------------------------------------------------------

def mlp_activation_bytes_per_token(hidden: int, width: int) -> int:
    """Bytes an MLP of `width` keeps per token in 16-bit activations (Korthikanti et al. 2022,
    section 4.1): its input (2h), GeLU's input and output (2f each) and a 1-byte dropout mask on
    its output (h): 3h + 4f, the 19h of their 34sbh when f = 4h."""
    return 3 * hidden + 4 * width


def moe_extra_activation_bytes_per_layer(model: ModelShape, training: Training, tp: int) -> float:
    """What an MoE layer keeps beyond the dense layer dtp.memory.calculator counts: the experts' MLP
    activations for the cf·k routed copies of every token, in place of one dense MLP's, split t
    ways (sequence parallel). Nothing with full recomputation, which keeps only the layer's input."""
    if not model.is_moe or training.recompute == "full":
        return 0.0
    h = model.hidden
    moe = model.capacity_factor * model.top_k * mlp_activation_bytes_per_token(h, model.expert_width)
    dense = mlp_activation_bytes_per_token(h, model.mlp_ratio * h)
    return (moe - dense) * model.seq * training.micro_batch / tp


def memory_per_gpu(model: ModelShape, training: Training, layout: PlannedLayout, stage: str) -> dict[str, float]:
    """Bytes by component on a GPU of the first or last pipeline stage: dtp.memory.calculator's dense
    figure (sequence parallelism on unless `training.sequence_parallel` is off; activations and
    logits split c ways by context parallelism), with the model states ZeRO-sharded over the
    Nd·c ranks that hold the same parameters, and an MoE's split in two: the non-expert parameters
    over t·p GPUs, sharded over the Nd DP ranks, and the experts over t·p·e GPUs, sharded over
    the Nd/e ranks holding the same experts."""
    training = layout.training(training)
    cp = {"context_parallel": layout.cp} if layout.cp > 1 else {}
    dense_layout = calculator.Layout(layout.tp, layout.pp, layout.dp, layout.zero_stage,
                                     sequence_parallel=training.sequence_parallel,
                                     recompute=training.recompute, micro_batch=training.micro_batch, **cp)
    breakdown = calculator.memory_per_gpu(model.config, training.recipe, dense_layout, stage)
    counts, model_parallel = parameter_counts(model), layout.tp * layout.pp
    groups = [(counts["non_expert"] / model_parallel, layout.dp * layout.cp)]
    if model.is_moe:  # (a dense model's states, sharded over dp·cp, are dtp.memory.calculator's already)
        groups.append((counts["experts"] / (model_parallel * layout.ep), layout.dp // layout.ep))
        states = [zero.model_state_breakdown_per_gpu(n, d, layout.zero_stage, training.recipe) for n, d in groups]
        for component in zero.COMPONENTS:
            breakdown[component] = sum(state[component] for state in states)
    if layout.zero_stage >= 2 and not layout.reduce_every_micro_batch:
        # Accumulating over micro-batches without reducing keeps a full (unsharded) gradient buffer
        # beside the shard (dtp.zero.formulas.accumulation_gradient_bytes_held).
        per_parameter = zero.bytes_per_parameter_by_component(training.recipe)["gradients"]
        breakdown["gradients"] = sum(zero.accumulation_gradient_bytes_held(n, d, layout.zero_stage, False, per_parameter)
                                     for n, d in groups)
    if not model.is_moe:
        return breakdown
    in_flight = layout.pp if stage == "first" else 1
    breakdown["activations"] += math.ceil(model.layers / layout.pp) * in_flight * \
        moe_extra_activation_bytes_per_layer(model, training, layout.tp)
    return breakdown


def peak_memory_per_gpu(model: ModelShape, training: Training, layout: PlannedLayout) -> tuple[str, dict[str, float]]:
    """The stage ("first" or "last") whose GPUs need the most memory, and its breakdown."""
    stages = {stage: memory_per_gpu(model, training, layout, stage) for stage in ("first", "last")}
    worst = max(stages, key=lambda stage: sum(stages[stage].values()))
    return worst, stages[worst]


# --- traffic ------------------------------------------------------------------------------------

def dp_bytes_per_gpu(n_params: float, replicas: int, layout: PlannedLayout, bytes_per_value: int) -> float:
    """Bytes a GPU sends per step for the data-parallel traffic of its `n_params` parameters over
    `replicas` ranks: dtp.zero.formulas's accumulation formulas. ZeRO-2/3 reducing every micro-batch
    reduce-scatter m times; ZeRO-3 gathers the weights twice per micro-batch whichever way it
    accumulates; stages 0 and 1 reduce once per step."""
    sent = zero.accumulation_bytes_sent_per_gpu(n_params, replicas, layout.micro_batches, layout.zero_stage,
                                                bool(layout.reduce_every_micro_batch), bytes_per_value,
                                                bytes_per_value)
    return sent["gradients"] + sent["weights"]




def cp_bytes_per_layer(model: ModelShape, training: Training, layout: PlannedLayout) -> float:
    """Bytes a GPU sends per layer and micro-batch for context parallelism (dtp.cp.context_parallel's
    formulas); each TP rank passes its own heads' K and V (width kv_hidden/t) of the micro-batch's
    b·s tokens. "ring": K/V blocks around the CP ring in forward (twice with full recomputation)
    and backward, K/V and their gradients; "allgather" (Llama 3): K/V all-gathered before each
    forward's attention (kept for backward), dK/dV reduce-scattered after backward's."""
    tokens, kv_width, c, w = training.micro_batch * model.seq, model.kv_hidden / layout.tp, layout.cp, training.bytes_per_value
    forwards = 2 if training.recompute == "full" else 1
    if training.cp_method == "allgather":
        return (forwards * context_parallel.allgather_kv_bytes_per_layer(tokens, kv_width, c, w)
                + context_parallel.allgather_kv_backward_bytes_per_layer(tokens, kv_width, c, w))
    if training.cp_method != "ring":
        raise ValueError(f"cp_method must be 'ring' or 'allgather', got {training.cp_method!r}")
    return (forwards * context_parallel.ring_bytes_per_layer(tokens, kv_width, c, w)
            + context_parallel.ring_backward_bytes_per_layer(tokens, kv_width, c, w))


def folded_group_link(size: int, gpus_per_node: int) -> str:
    """The link of a group of `size` consecutive ranks (TP and EP, innermost, folded into one)."""
    return INTRA_NODE if gpus_per_node % size == 0 else INTER_NODE


def traffic_per_gpu(model: ModelShape, cluster: Cluster, training: Training, layout: PlannedLayout) -> dict[str, dict]:
    """Bytes one GPU sends per step for each group it belongs to, and the link they ride:
    {"tp": {"bytes": ..., "link": "intra-node"}, "pp": ..., "dp": ..., "ep": ..., "expert_dp": ...}.
    Ring collectives; PP for a GPU of an interior stage (the busiest); "dp" carries the non-expert
    gradients (and weights, with ZeRO) over the dp·cp ranks holding the same parameters,
    "expert_dp" the experts'; "cp" ring attention's K/V (`cp_bytes_per_layer`)."""
    training = layout.training(training)
    t, p, e, m = layout.tp, layout.pp, layout.ep, layout.micro_batches
    b, s, h, w = training.micro_batch, model.seq, model.hidden, training.bytes_per_value
    stage_layers = planner_costs.busiest_stage_layers(model, training, p)
    forwards = 2 if training.recompute == "full" else 1  # full recomputation runs each forward twice
    passes = ("forward",) * forwards + ("backward",)
    counts = parameter_counts(model)
    # With context parallelism every collective but the ring's acts on the GPU's own b·s/c tokens.
    tp_per_layer = tensor_parallel.ring_bytes_per_gpu_per_layer(b * s // layout.cp, h, t, w, passes)
    traffic = {
        "tp": stage_layers * m * tp_per_layer,
        # An interior stage sends each micro-batch's activation forward and its gradient backward; each of
        # the stage's t GPUs sends 1/t of it (sequence parallel).
        # Interleaving (v chunks per stage) sends each micro-batch across v times as many boundaries.
        "pp": pipeline.boundary_bytes_per_step(m, b, s // layout.cp, h, w) * min(2, p - 1) / 2 / t * training.chunks,
        "dp": dp_bytes_per_gpu(counts["non_expert"] / (t * p), layout.dp * layout.cp, layout, w),
    }
    if layout.cp > 1:
        traffic["cp"] = stage_layers * m * cp_bytes_per_layer(model, training, layout)
    if model.is_moe:
        # Each GPU dispatches its own b·s/t tokens (sequence parallel) to the experts of its
        # all-to-all group, with capacity C computed from them; 4 all-to-alls per layer, 6 with
        # full recomputation.
        capacity = moe.expert_capacity(expert_tokens_per_gpu(model, training, layout), model.experts,
                                       model.top_k, model.capacity_factor)
        group = layout.expert_ep
        all_to_alls = moe.capacity_all_to_all_bytes(group, model.experts, capacity, h, w)  # 4 per layer
        # ... of which the shared experts' copies stay home
        routed_share = 1 - model.shared_experts / model.top_k
        traffic["ep"] = stage_layers * m * all_to_alls * (2 * forwards + 2) / 4 * routed_share
        if training.ep_dispatch not in ("capacity", "node_limited"):
            raise ValueError(f"ep_dispatch must be 'capacity' or 'node_limited', got {training.ep_dispatch!r}")
        limited = training.ep_dispatch == "node_limited" and planner_costs.node_limited_ep_bytes(
            model, cluster, training, layout)
        if limited:  # "ep" the inter-node copies, "ep_intra" their forwarding over NVLink
            traffic["ep"], traffic["ep_intra"] = (stage_layers * m * limited[key]
                                                  for key in ("inter_node", "intra_node"))
        mlp_share = tp_per_layer / 2  # half of a layer's TP collectives belong to its MLP
        if layout.expert_tp > 1:
            # Tensor-parallel experts: the E·C rows a GPU received are all-gathered over the TP group
            # before the experts and reduce-scattered after (per pass), in place of the dense MLP's
            # collectives: 2(t-1)·E·C·h·w per pass.
            expert_collectives = 2 * (t - 1) * model.experts * capacity * h * w * len(passes)
        else:
            expert_collectives = 0.0  # whole experts: the tokens stay in their sequence-parallel shards
        traffic["tp"] += stage_layers * m * (expert_collectives - mlp_share)
        traffic["expert_dp"] = dp_bytes_per_gpu(counts["experts"] / (t * p * e), layout.dp // e, layout, w)
    links = dict(dimension_links(layout.sizes(model), layout.order(model, training.pp_outermost),
                                 cluster.gpus_per_node))
    if model.is_moe and layout.expert_tp == 1 and t > 1:
        links["ep"] = folded_group_link(t * e, cluster.gpus_per_node)
    if "ep_intra" in traffic:
        links["ep"], links["ep_intra"] = INTER_NODE, INTRA_NODE
    if layout.cp > 1:  # gradients are reduced over the dp·cp ranks: inside a node only if both groups are
        links["dp"] = INTRA_NODE if links["dp"] == links["cp"] == INTRA_NODE else INTER_NODE
    return {name: {"bytes": float(sent), "link": links[name]} for name, sent in traffic.items()}


def bytes_by_link(traffic: dict[str, dict]) -> dict[str, float]:
    totals = {INTRA_NODE: 0.0, INTER_NODE: 0.0}
    for entry in traffic.values():
        totals[entry["link"]] += entry["bytes"]
    return totals


# --- time -----------------------------------------------------------------------------------------

def step_time(model: ModelShape, cluster: Cluster, training: Training, layout: PlannedLayout,
              traffic: dict[str, dict] | None = None, dp_hidden_under: float | None = None) -> dict[str, float]:
    """Estimated seconds per step, by part. With `training.cost_model == "fixed"` (the exercise's):
    - compute: the hardware FLOPs of the step (dtp.memory.formulas.hardware_flops_per_token of the active
      parameters, recomputation included) spread evenly over the GPUs, at `flops_utilization`
      of the peak;
    - each dimension's traffic takes bytes / bandwidth of its link (per GPU, per direction),
      with no latency term;
    - TP and EP traffic lies inside each micro-batch's forward and backward, so the pipeline
      stretches it with the compute by (m + p - 1)/m (1F1B with equal stages), all exposed; PP
      transfers come on top, exposed;
    - the DP traffic (dp and expert_dp) can hide only under the last micro-batch's backward (the
      one computation left once the step's gradients start to be ready), which takes 2/3 of one
      micro-batch's compute (backward is twice forward): exposed = max(0, dp + expert_dp -
      (2/3)·compute/m), split between dp and expert_dp in proportion.
    total = (compute + tp + ep)·(m + p - 1)/m + pp + max(0, dp + expert_dp - (2/3)·compute/m).
    `dp_hidden_under` replaces (2/3)·compute/m (the check uses it to name a slip).
    With "roofline", dtp.topology.costs.roofline_step_time (its docstring states the model).
    Either way, node-limited dispatch's NVLink forwarding ("ep_intra") runs while its inter-node
    copies arrive (DeepSeek-V3: "fully overlapped"): EP takes the longer of the two."""
    training = layout.training(training)
    traffic = traffic or traffic_per_gpu(model, cluster, training, layout)
    # the roofline model at what NCCL reaches on each link, the exercise's at the link's rate
    rate = cluster.achieved_bandwidth if training.cost_model == "roofline" else cluster.bandwidth
    seconds = {name: entry["bytes"] / rate(entry["link"]) for name, entry in traffic.items()}
    if "ep_intra" in seconds:  # node-limited dispatch: the NVLink forwarding runs while the IB copies arrive
        seconds["ep"] = max(seconds["ep"], seconds.pop("ep_intra"))
    if training.cost_model == "roofline":
        data_parallel = {name: (dp_sent_per_gpu(model, training, layout, name),
                                rate(traffic[name]["link"]))
                         for name in ("dp", "expert_dp") if name in traffic}
        parts = planner_costs.roofline_step_time(model, cluster, training, layout, seconds, data_parallel)
        parts["total"] = sum(parts.values())
        return parts
    counts = parameter_counts(model)
    tokens = training.global_batch * model.seq
    flops = memory.hardware_flops_per_token(counts["active"], model.layers, model.hidden, model.seq,
                                            training.recompute) * tokens
    parts = {"compute": flops / (cluster.gpus * cluster.peak_flops * training.flops_utilization), **seconds}
    in_micro_batches = parts["compute"] + parts["tp"] + parts.get("ep", 0.0)
    parts["bubble"] = in_micro_batches * pipeline.bubble_over_ideal(layout.pp, layout.micro_batches, training.chunks)
    last_backward = 2 / 3 * parts["compute"] / layout.micro_batches if dp_hidden_under is None else dp_hidden_under
    data_parallel = parts["dp"] + parts.get("expert_dp", 0.0)
    if data_parallel:
        share = max(0.0, data_parallel - last_backward) / data_parallel
        for name in ("dp", "expert_dp"):
            if name in parts:
                parts[name] *= share
    parts["total"] = sum(parts.values())
    return parts


def dp_sent_per_gpu(model: ModelShape, training: Training, layout: PlannedLayout, name: str) -> dict[str, float]:
    """{"gradients", "weights"} bytes a GPU sends per step in its "dp" or "expert_dp" group."""
    counts, shards = parameter_counts(model), layout.tp * layout.pp
    n, replicas = ((counts["non_expert"] / shards, layout.dp * layout.cp) if name == "dp"
                   else (counts["experts"] / (shards * layout.ep), layout.dp // layout.ep))
    w = training.bytes_per_value
    return zero.accumulation_bytes_sent_per_gpu(n, replicas, layout.micro_batches, layout.zero_stage,
                                                bool(layout.reduce_every_micro_batch), w, w)


def model_flops_utilization(model: ModelShape, cluster: Cluster, training: Training, seconds: float) -> float:
    """The MFU a step of `seconds` would reach: PaLM's model FLOPs (6N + 12Lhs per token, N the
    active parameters) over what the GPUs could do at peak in that time."""
    flops = memory.model_flops_per_token(parameter_counts(model)["active"], model.layers, model.hidden, model.seq)
    return flops * training.global_batch * model.seq / (cluster.gpus * cluster.peak_flops * seconds)


# --- the planner ------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelShape, cluster: Cluster, training: Training) -> list[PlannedLayout]:
    """Every layout the planner considers, fitting or not:
    - tp divides the GPUs of a node, the heads and the sequence (TP stays inside a node;
      sequence parallelism splits the sequence t ways);
    - pp divides the layers (equal stages), and dp = GPUs / (tp·pp) is a whole number;
    - ep divides dp and the experts (1 for a dense model);
    - ZeRO stage 0 to 3, with or without pipelining (Llama 3 trained FSDP-style sharding with PP;
      DeepSpeed's PipelineEngine refusing stages 2 and 3 is one framework's limit); stages 2 and 3
      both ways of accumulating (reduce every micro-batch, or once from unsharded gradients);
    - MoE: experts tensor-parallel like the attention (expert_tp = t), or whole with their
      all-to-all group folded over TP and EP (expert_tp = 1, when t·e divides the experts);
    - micro-batches m = global batch / (dp · micro-batch size), a whole number, at least pp.
    The roofline model searches further (none of it in the exercise's "fixed" model):
    - the micro-batch size b over `training.micro_batch_choices` and the interleaved schedule's v
      over `training.chunk_choices` (v > 1 only with pp > 1 and m a multiple of pp, as Megatron
      requires);
    - context parallelism c up to `training.max_context_parallel` for a dense model: c divides the
      GPUs left by tp·pp and the sequence into 2c chunks (zigzag), dp = GPUs / (tp·cp·pp)."""
    roofline = training.cost_model == "roofline"
    sizes = (training.micro_batch_choices or (training.micro_batch,)) if roofline else (training.micro_batch,)
    chunk_choices = (training.chunk_choices or (training.chunks,)) if roofline else (training.chunks,)
    searched = roofline and (training.micro_batch_choices or training.chunk_choices)
    layouts = []
    for tp in divisors(cluster.gpus_per_node):
        if model.heads % tp or model.seq % tp:
            continue
        for pp in divisors(model.layers):
            if cluster.gpus % (tp * pp):
                continue
            for cp in divisors(min(cluster.gpus // (tp * pp), training.max_context_parallel if roofline else 1)):
                if (cluster.gpus // (tp * pp)) % cp or (cp > 1 and (model.is_moe or model.seq % (2 * cp * tp))):
                    continue
                dp = cluster.gpus // (tp * cp * pp)
                for b, v in itertools.product(sizes, chunk_choices):
                    if training.global_batch % (dp * b):
                        continue
                    micro_batches = training.global_batch // (dp * b)
                    if micro_batches < pp or (searched and v > 1 and (pp == 1 or micro_batches % pp)):
                        continue
                    extra = dict(cp=cp, micro_batch=b, chunks=v) if searched or cp > 1 else {}
                    for ep in (divisors(math.gcd(dp, model.experts)) if model.is_moe else [1]):
                        expert_tps = [tp] + ([1] if model.is_moe and tp > 1 and model.experts % (tp * ep) == 0 else [])
                        for expert_tp in expert_tps:
                            for stage in zero.STAGES:
                                for every in ((0, 1) if stage >= 2 else (0,)):
                                    layouts.append(PlannedLayout(tp, pp, dp, ep, stage, micro_batches, every, expert_tp,
                                                                 **extra))
    return layouts


def evaluate(model: ModelShape, cluster: Cluster, training: Training, layout: PlannedLayout) -> dict:
    """One row of the planner's table for `layout`, whether it fits or not (with the layout's
    searched micro-batch size and chunks, where it has them)."""
    training = layout.training(training)
    stage, breakdown = peak_memory_per_gpu(model, training, layout)
    traffic = traffic_per_gpu(model, cluster, training, layout)
    times = step_time(model, cluster, training, layout, traffic)
    links = bytes_by_link(traffic)
    return {**{field: getattr(layout, field) for field in LAYOUT_FIELDS},
            "memory_bytes": sum(breakdown.values()), "memory_stage": stage,
            "activation_bytes": breakdown["activations"], "fits": sum(breakdown.values()) <= cluster.memory_bytes,
            "intra_node_bytes": links[INTRA_NODE], "inter_node_bytes": links[INTER_NODE],
            "bubble": pipeline.bubble_fraction(layout.pp, layout.micro_batches, training.chunks), "step_time_s": times["total"],
            "mfu": model_flops_utilization(model, cluster, training, times["total"]), "times": times,
            "traffic": traffic, "cp": layout.cp, "micro_batch": training.micro_batch, "chunks": training.chunks,
            "pp_outermost": training.pp_outermost}


def plan(model: ModelShape, cluster: Cluster, training: Training) -> list[dict]:
    """The layouts of `candidate_layouts` that fit in a GPU's memory, fastest estimated step first."""
    rows = [evaluate(model, cluster, training, layout) for layout in candidate_layouts(model, cluster, training)]
    return sorted((row for row in rows if row["fits"]),
                  key=lambda row: (row["step_time_s"], *[row[field] for field in LAYOUT_FIELDS + SEARCHED_FIELDS]))


# --- the chapter's clusters and models ----------------------------------------------------------

# NVIDIA A100 SXM datasheet: NVLink 3 "600GB/s" is both directions over 12 links (25 GB/s each
# way per link), so 300 GB/s leave a GPU; 312 TFLOP/s of dense bf16 (624 with 2:4 sparsity).
# DGX A100: one InfiniBand HDR port per GPU, 200 Gb/s per direction.
NVLINK3_PER_DIRECTION_BYTES_PER_S = 600e9 / 2
INFINIBAND_HDR_GBIT_PER_S = 200
A100_BF16_DENSE_FLOPS = 312e12
A100_80GB_HBM_BYTES_PER_S = 2039e9  # A100 80GB SXM datasheet: 2,039 GB/s of HBM2e
H100_SXM_HBM_BYTES_PER_S = 3.35e12  # H100 SXM datasheet: 3.35 TB/s of HBM3

# Measured shares of those rates, for the roofline model (each on the chapter's page with its source):
# - cuBLAS bf16 matmul: the best of a scan over large shapes (Bekman's "maximum achievable matmul
#   FLOPS", ml-engineering): 267.9 of 312 TFLOP/s on an A100 SXM, 792.1 of 989 on an H100 SXM;
# - NCCL over NVLink: "with the protocol overhead (~20%) NCCL can get an effective NVLink
#   bandwidth of 370GB/s" of NVLink 4's 450 (S. Jeaugey, NVIDIA, nccl-tests issue 212);
# - NCCL over InfiniBand: "24GB/s is the peak performance per 200G NIC" (nccl-tests issue 119),
#   "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per NIC" (nccl-tests issue 267).
# - FlashAttention-2: "50-73% of the theoretical maximum FLOPs/s on A100" (Dao 2023), "only 35%
#   utilization on the H100 GPU" (Shah et al. 2024, FlashAttention-3's abstract).
A100_MAMF_FLOPS, H100_MAMF_FLOPS = 267.9e12, 792.1e12
A100_FLASH_ATTENTION_SHARE, H100_FLASH_ATTENTION_SHARE = 0.50, 0.35
NVLINK_NCCL_EFFICIENCY = 370 / 450
HDR_NCCL_EFFICIENCY, NDR_NCCL_EFFICIENCY = 24 / 25, 48 / 50

A100_CLUSTER = Cluster(nodes=128, gpus_per_node=8, memory_bytes=memory.GPU_MEMORY_MIB["A100 80GB"] * 2**20,
                       intra_node_bytes_per_s=NVLINK3_PER_DIRECTION_BYTES_PER_S,
                       inter_node_bytes_per_s=tensor_parallel.gigabits_to_bytes_per_s(INFINIBAND_HDR_GBIT_PER_S),
                       peak_flops=A100_BF16_DENSE_FLOPS, name="128 nodes of 8 A100 80GB",
                       hbm_bytes_per_s=A100_80GB_HBM_BYTES_PER_S, gemm_ceiling=A100_MAMF_FLOPS / A100_BF16_DENSE_FLOPS,
                       attention_ceiling=A100_FLASH_ATTENTION_SHARE,
                       intra_node_efficiency=NVLINK_NCCL_EFFICIENCY, inter_node_efficiency=HDR_NCCL_EFFICIENCY)
H100_CLUSTER = Cluster(nodes=128, gpus_per_node=8, memory_bytes=memory.GPU_MEMORY_MIB["H100 80GB"] * 2**20,
                       intra_node_bytes_per_s=tensor_parallel.NVLINK4_PER_DIRECTION_BYTES_PER_S,
                       inter_node_bytes_per_s=tensor_parallel.gigabits_to_bytes_per_s(
                           tensor_parallel.INFINIBAND_NDR_GBIT_PER_S),
                       peak_flops=tensor_parallel.H100_BF16_DENSE_FLOPS, name="128 nodes of 8 H100 80GB",
                       hbm_bytes_per_s=H100_SXM_HBM_BYTES_PER_S,
                       gemm_ceiling=H100_MAMF_FLOPS / tensor_parallel.H100_BF16_DENSE_FLOPS,
                       attention_ceiling=H100_FLASH_ATTENTION_SHARE,
                       intra_node_efficiency=NVLINK_NCCL_EFFICIENCY, inter_node_efficiency=NDR_NCCL_EFFICIENCY)

# Llama 2 70B's depth and width (80 layers, h = 8192, 64 heads, 32000 tokens, 4096 positions)
# with GPT-2 blocks; and the same backbone with 16 experts of width 2.25h per block, top-2:
# the source notes' "409B MoE", whose shape they do not give.
DENSE_70B = ModelShape(layers=80, hidden=8192, heads=64, vocab=32000, seq=4096, name="70B-class dense GPT")
MOE_409B = ModelShape(layers=80, hidden=8192, heads=64, vocab=32000, seq=4096, experts=16, top_k=2,
                      expert_hidden=18432, name="409B MoE GPT (16 experts, top-2)")
FOUR_MILLION_TOKENS = Training(global_batch=1024)  # 1024 sequences of 4096 tokens per step
