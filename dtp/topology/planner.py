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
"roofline", the practised one (`dtp.topology.costs` and `dtp.topology.step`: its layers' work, the
stages as practised, NCCL's latencies, the overlap chapter's exposure, with each stage's own memory
from `dtp.topology.stage_memory`; `dtp.topology.search` searches its layouts), both stated in
`step_time` and on the chapter's pages; tests/topology/test_topology_planner.py checks the counts
against torch models and the traffic against what gloo runs send, test_topology_practised.py the
practised model.
"""
from __future__ import annotations

import math

from dtp.cp import context_parallel
from dtp.ep import moe
from dtp.memory import calculator
from dtp.memory import formulas as memory
from dtp.pp import schedules as pipeline
from dtp.topology import costs as planner_costs
from dtp.topology import stage_memory
from dtp.topology import step as planner_step
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

mlp_activation_bytes_per_token = planner_costs.mlp_activation_bytes_per_token


def moe_extra_activation_bytes_per_layer(model: ModelShape, training: Training, tp: int) -> float:
    """What an MoE layer keeps beyond the dense layer dtp.memory.calculator counts: the experts' MLP
    activations for the cf·k routed copies of every token, in place of one dense MLP's, split t
    ways (sequence parallel). Nothing with full recomputation, which keeps only the layer's input."""
    if not model.is_moe:
        return 0.0
    return planner_costs.mlp_extra_bytes_per_token(model, training.recompute) * model.seq * training.micro_batch / tp


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

def dp_bytes_per_gpu(n_params: float, replicas: int, layout: PlannedLayout, bytes_per_value: int,
                     gradient_bytes: int = 0) -> float:
    """Bytes a GPU sends per step for the data-parallel traffic of its `n_params` parameters over
    `replicas` ranks: dtp.zero.formulas's accumulation formulas. ZeRO-2/3 reducing every micro-batch
    reduce-scatter m times; ZeRO-3 gathers the weights twice per micro-batch whichever way it
    accumulates; stages 0 and 1 reduce once per step. Gradients travel in `gradient_bytes` per
    value (0: as the weights)."""
    sent = zero.accumulation_bytes_sent_per_gpu(n_params, replicas, layout.micro_batches, layout.zero_stage,
                                                bool(layout.reduce_every_micro_batch), bytes_per_value,
                                                gradient_bytes or bytes_per_value)
    return sent["gradients"] + sent["weights"]


def dp_parameters(model: ModelShape, training: Training, layout: PlannedLayout) -> dict[str, float]:
    """{"non_expert", "experts"} parameters of one pipeline stage, before the TP split: 1/p of all
    in the exercise's model; in the practised one, the stage holding the most (its layers, and the
    embedding or the output layer at the ends: dtp.topology.stage_memory)."""
    counts = parameter_counts(model)
    if training.cost_model != "roofline":
        return {"non_expert": counts["non_expert"] / layout.pp, "experts": counts["experts"] / layout.pp}
    return stage_memory.largest_stage_parameters(model, stage_memory.layers_per_stage(model, training, layout))




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
    # the stage of the most layers: the practised model's split (dtp.topology.stage_memory), L/p in the exercise's
    stage_layers = (max(stage_memory.layers_per_stage(model, training, layout)) if training.cost_model == "roofline"
                    else math.ceil(model.layers / p))
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
        "dp": dp_bytes_per_gpu(dp_parameters(model, training, layout)["non_expert"] / t, layout.dp * layout.cp,
                               layout, w, training.gradient_reduce_bytes),
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
        traffic["expert_dp"] = dp_bytes_per_gpu(dp_parameters(model, training, layout)["experts"] / (t * e),
                                                layout.dp // e, layout, w, training.gradient_reduce_bytes)
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
        split = stage_memory.layers_per_stage(model, training, layout)
        latency = planner_step.latency_seconds(model, cluster, training, layout, max(split))
        for name in ("tp", "pp", "cp", "ep"):
            if name in seconds:
                seconds[name] += latency.get(name, 0.0)
        data_parallel = {name: (dp_sent_per_gpu(model, training, layout, name), rate(traffic[name]["link"]))
                         for name in ("dp", "expert_dp") if name in traffic}
        parts = planner_step.roofline_step_time(model, cluster, training, layout, seconds, data_parallel, split,
                                                planner_costs.updated_parameters(model, layout,
                                                                                 dp_parameters(model, training, layout)),
                                                latency)
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
    stage = dp_parameters(model, training, layout)
    n, replicas = ((stage["non_expert"] / layout.tp, layout.dp * layout.cp) if name == "dp"
                   else (stage["experts"] / (layout.tp * layout.ep), layout.dp // layout.ep))
    w = training.bytes_per_value
    return zero.accumulation_bytes_sent_per_gpu(n, replicas, layout.micro_batches, layout.zero_stage,
                                                bool(layout.reduce_every_micro_batch), w,
                                                training.gradient_reduce_bytes or w)


def model_flops_utilization(model: ModelShape, cluster: Cluster, training: Training, seconds: float) -> float:
    """The MFU a step of `seconds` would reach: PaLM's model FLOPs (6N + 12Lhs per token, N the
    active parameters) over what the GPUs could do at peak in that time."""
    flops = memory.model_flops_per_token(parameter_counts(model)["active"], model.layers, model.hidden, model.seq)
    return flops * training.global_batch * model.seq / (cluster.gpus * cluster.peak_flops * seconds)


# --- the planner ------------------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelShape, cluster: Cluster, training: Training) -> list[PlannedLayout]:
    """Every layout the exercise's planner considers, fitting or not:
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
    The micro-batch size and the interleaving's v are the training's. The practised model
    searches far more (dtp.topology.search: uneven stages, CP, b, v, recomputation, and only
    what the framework runs)."""
    layouts = []
    for tp in divisors(cluster.gpus_per_node):
        if model.heads % tp or model.seq % tp:
            continue
        for pp in divisors(model.layers):
            if cluster.gpus % (tp * pp):
                continue
            dp = cluster.gpus // (tp * pp)
            if training.global_batch % (dp * training.micro_batch):
                continue
            micro_batches = training.global_batch // (dp * training.micro_batch)
            if micro_batches < pp:
                continue
            for ep in (divisors(math.gcd(dp, model.experts)) if model.is_moe else [1]):
                expert_tps = [tp] + ([1] if model.is_moe and tp > 1 and model.experts % (tp * ep) == 0 else [])
                for expert_tp in expert_tps:
                    for stage in zero.STAGES:
                        for every in ((0, 1) if stage >= 2 else (0,)):
                            layouts.append(PlannedLayout(tp, pp, dp, ep, stage, micro_batches, every, expert_tp))
    return layouts


def evaluate(model: ModelShape, cluster: Cluster, training: Training, layout: PlannedLayout) -> dict:
    """One row of the planner's table for `layout`, whether it fits or not (with the layout's
    searched micro-batch size and chunks, where it has them). Memory: the memory chapter's
    calculator in the exercise's model; each stage's own in the practised one (dtp.topology.stage_memory)."""
    training = layout.training(training)
    if training.cost_model == "roofline":
        split = stage_memory.layers_per_stage(model, training, layout)
        index, breakdown = stage_memory.peak_stage_memory(model, training, layout, split)
        stage = "first" if index == 0 else "last" if index == layout.pp - 1 else f"stage {index}"
    else:
        split = ()
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
            "pp_outermost": training.pp_outermost, "stage_layers": split}


def plan(model: ModelShape, cluster: Cluster, training: Training) -> list[dict]:
    """The layouts of `candidate_layouts` that fit in a GPU's memory, fastest estimated step first
    (with the training's cost model; the practised planner's wider search is dtp.topology.search.plan)."""
    rows = [evaluate(model, cluster, training, layout) for layout in candidate_layouts(model, cluster, training)]
    return sorted((row for row in rows if row["fits"]),
                  key=lambda row: (row["step_time_s"], *[row[field] for field in LAYOUT_FIELDS + SEARCHED_FIELDS]))


# --- the chapter's clusters and models ----------------------------------------------------------

# The chapter's clusters, re-exported for the notebook and the grader (dtp.topology.clusters: datasheets and
# measured shares, each with its source)
from dtp.topology.clusters import A100_CLUSTER, H100_CLUSTER, NVLINK3_PER_DIRECTION_BYTES_PER_S  # noqa: E402,F401

# Llama 2 70B's depth and width (80 layers, h = 8192, 64 heads, 32000 tokens, 4096 positions)
# with GPT-2 blocks; and the same backbone with 16 experts of width 2.25h per block, top-2:
# the source notes' "409B MoE", whose shape they do not give.
DENSE_70B = ModelShape(layers=80, hidden=8192, heads=64, vocab=32000, seq=4096, name="70B-class dense GPT")
MOE_409B = ModelShape(layers=80, hidden=8192, heads=64, vocab=32000, seq=4096, experts=16, top_k=2,
                      expert_hidden=18432, name="409B MoE GPT (16 experts, top-2)")
FOUR_MILLION_TOKENS = Training(global_batch=1024)  # 1024 sequences of 4096 tokens per step
