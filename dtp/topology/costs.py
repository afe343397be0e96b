"""The layout planner's step time as practised: matrix-multiply efficiency from a roofline on each
GEMM's shapes, memory-bound elementwise work, and communication exposed only where the overlap
chapter's model (`dtp.overlap.model`) says nothing hides it.

`dtp.topology.planner.step_time` uses this model when `Training.cost_model == "roofline"`; the
exercise's model (`"fixed"`: a constant share of the peak, all communication exposed) stays
there, simple enough to check by hand. Every assumption is a named parameter here and is stated
on the chapter's page.

GEMM time (a roofline, Williams et al. 2009): a product of an (M x K) and a (K x N) bf16 matrix
does 2MNK FLOPs and moves at least 2(MK + KN + MN) bytes through HBM, so its arithmetic
intensity is I = FLOPs / bytes and it runs at min(ceiling · peak, I · HBM bandwidth). The
`ceiling` is the share of the peak that the largest GEMMs reach (an assumption, stated with its
value on the page). Elementwise work (LayerNorm, GeLU, dropout, softmax, residuals) is memory
bound: its time is the bytes it moves over the HBM bandwidth, taken as `ELEMENTWISE_PASSES`
times the activation bytes a layer keeps (Korthikanti et al. 2022): each kept byte is written and
read once in forward, and read, its gradient written and read in backward.
"""
from __future__ import annotations

import functools
import math

from dtp.ep import routing as moe_routing
from dtp.memory import formulas as memory
from dtp.overlap import model as overlap
from dtp.topology.shapes import expert_tokens_per_gpu, parameter_counts

ELEMENTWISE_PASSES = 5  # forward: write + read; backward: read, write the gradient, read it
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb (gradient buckets reduced during backward)


def gemm_seconds(m: float, n: float, k: float, peak_flops: float, hbm_bytes_per_s: float, ceiling: float,
                 batch: float = 1, bytes_per_value: int = 2) -> float:
    """Roofline time of `batch` products of (m x k) by (k x n)."""
    flops = 2 * m * n * k
    intensity = flops / (bytes_per_value * (m * k + k * n + m * n))
    return batch * flops / min(ceiling * peak_flops, intensity * hbm_bytes_per_s)


def layer_gemms(model, training, layout) -> list[tuple[float, float, float, float]]:
    """(M, N, K, batch) of one layer's forward GEMMs on one GPU for one micro-batch: the QKV and
    output projections and the MLP split t ways over the b·s tokens sequence parallelism gathers;
    attention's QKᵀ and AV per head (a/t heads per GPU); an MoE layer's experts on the rows each
    GPU receives (E·C from its all-to-all group, times t when the experts are tensor-parallel)."""
    from dtp.ep.moe import expert_capacity

    t, h, s, b = layout.tp, model.hidden, model.seq, training.micro_batch
    c = getattr(layout, "cp", 1)
    tokens, head = b * s // c, h // model.heads
    # attention: each GPU's s/c queries against all s keys (ring attention brings them block by
    # block); with flash attention the causal mask's hidden half is skipped
    keys = s / 2 if training.flash_attention else s
    gemms = [(tokens, 3 * h / t, h, 1), (tokens, h, h / t, 1),
             (s / c, keys, head, b * model.heads / t), (s / c, head, keys, b * model.heads / t)]
    if not model.is_moe:
        width = model.mlp_ratio * h
        return gemms + [(tokens, width / t, h, 1), (tokens, h, width / t, 1)]
    capacity = expert_capacity(b * s // t, model.experts, model.top_k, model.capacity_factor)
    group = layout.expert_ep
    local_experts = model.experts / group
    # rows per local expert: C from each of the group's GPUs, gathered over the t TP ranks when the
    # experts are tensor-parallel (each then holds 1/t of the expert's width)
    rows = capacity * group * layout.expert_tp
    width = model.expert_width / layout.expert_tp
    return gemms + [(rows, width, h, local_experts), (rows, h, width, local_experts)]


def linear_gemm_seconds(m, n, k, batch, cluster, training) -> float:
    """A linear layer's GEMM: bf16 at `gemm_ceiling` of the peak, or with `training.fp8_gemms`
    (DeepSeek-V3, section 3.3.1: forward, input- and weight-gradient GEMMs of the linear layers in
    FP8) 1-byte operands at `fp8_gemm_ceiling` of the FP8 peak."""
    if not training.fp8_gemms:
        return gemm_seconds(m, n, k, cluster.peak_flops, cluster.hbm_bytes_per_s, cluster.gemm_ceiling, batch)
    if not cluster.fp8_peak_flops or not cluster.fp8_gemm_ceiling:
        raise ValueError(f"fp8_gemms needs the cluster's fp8_peak_flops and fp8_gemm_ceiling "
                         f"({cluster.name!r} has none)")
    return gemm_seconds(m, n, k, cluster.fp8_peak_flops, cluster.hbm_bytes_per_s, cluster.fp8_gemm_ceiling, batch,
                        bytes_per_value=1)


def forward_layer_seconds(model, cluster, training, layout) -> dict[str, float]:
    """One layer's forward on one GPU for one micro-batch: "gemm" (roofline) and "elementwise"
    (memory bound), and "attention_core" (QKᵀ and AV: what selective recomputation repeats).
    Attention stays in bf16 whatever the linear layers use; with `training.comm_sm_share`, the
    matrix products run on the SMs that communication kernels leave (DeepSeek-V3: 20 of 132)."""
    hbm = cluster.hbm_bytes_per_s

    def attention_seconds(m, n, k, batch):  # QKᵀ and AV: bf16, or one fused kernel at its measured share
        if training.flash_attention:
            return 2 * m * n * k * batch / (cluster.attention_ceiling * cluster.peak_flops)
        return gemm_seconds(m, n, k, cluster.peak_flops, hbm, cluster.gemm_ceiling, batch)

    gemms = layer_gemms(model, training, layout)  # the projections, QKᵀ and AV, then the MLP or experts
    times = [attention_seconds(*gemm) if index in (2, 3) else linear_gemm_seconds(*gemm, cluster, training)
             for index, gemm in enumerate(gemms)]
    times = [time / (1 - training.comm_sm_share) for time in times]
    # the bytes a layer keeps on this GPU: without sequence parallelism the norms', dropouts' and
    # residuals' work is repeated on every TP rank (Korthikanti et al. 2022's 10sbh); with context
    # parallelism the s/c queries' rows against all s keys (dtp.memory.formulas's formula)
    kept = memory.activation_bytes_per_layer(model.seq, training.micro_batch, model.hidden, model.heads,
                                             tensor_parallel=layout.tp, sequence_parallel=training.sequence_parallel,
                                             recompute="selective" if training.flash_attention else "none",
                                             context_parallel=layout.cp)
    return {"gemm": sum(times), "attention_core": times[2] + times[3],
            "elementwise": ELEMENTWISE_PASSES * kept / hbm}


def micro_batch_compute(model, cluster, training, layout) -> dict[str, float]:
    """Seconds one GPU of the slowest stage computes per micro-batch: "forward" and "backward"
    (backward's GEMMs take twice forward's: input and weight gradients; "weight_gradient" is the
    half of it that TP's backward all-reduces can hide under), recomputation added to backward,
    and the output layer's logits GEMM on the last stage (the busiest: `busiest_stage_layers`)."""
    layer = forward_layer_seconds(model, cluster, training, layout)
    layers = busiest_stage_layers(model, training, layout.pp)
    recomputed = {"none": 0.0, "selective": layer["attention_core"],
                  "full": layer["gemm"] + layer["elementwise"] * 2 / ELEMENTWISE_PASSES}[training.recompute]
    forward_gemm = layer["gemm"]
    elementwise = layer["elementwise"]
    logits = gemm_seconds(training.micro_batch * model.seq // layout.cp, model.vocab / layout.tp, model.hidden,
                          cluster.peak_flops, cluster.hbm_bytes_per_s, cluster.gemm_ceiling)
    logits /= 1 - training.comm_sm_share
    if training.balanced_stages and layout.pp > 1:
        logits = 0.0  # the output layer sits on the last stage in place of a layer: the busiest has none
    forward = layers * (forward_gemm + elementwise * 2 / ELEMENTWISE_PASSES)
    backward = layers * (2 * forward_gemm + elementwise * 3 / ELEMENTWISE_PASSES + recomputed)
    # the last stage also runs the output layer (forward, and twice that backward)
    return {"forward": forward + logits, "backward": backward + 2 * logits, "layer_forward_gemm": forward_gemm,
            "layer_forward": forward / layers, "layer_backward": backward / layers,
            "weight_gradient": layers * forward_gemm, "layer_attention": layer["attention_core"]}


def busiest_stage_layers(model, training, pp: int) -> int:
    """Layers on the busiest pipeline stage: ceil(L/p) (L/p when p divides L), or, with
    `training.balanced_stages` (Llama 3, section 3.3.2), ceil((L + 2)/p): the first and last
    stages give up a layer each to the embedding and the output layer."""
    if pp == 1:
        return model.layers
    return math.ceil((model.layers + (2 if training.balanced_stages else 0)) / pp)


# DeepSeek-V3's FP8 dispatch (section 3.3.3): E4M3 values with one float32 scaling factor per 128 of
# them (DeepGEMM's SM90 activation format), 1 + 4/128 bytes per value; the combine stays in bf16.
FP8_DISPATCH_BYTES_PER_VALUE = 1 + 4 / 128


def node_limited_ep_bytes(model, cluster, training, layout) -> dict[str, float] | None:
    """Bytes one GPU sends per MoE layer and micro-batch with DeepSeek-V3's node-limited dispatch:
    {"inter_node": ..., "intra_node": ...}, or None where it does not apply (the EP group not whole
    nodes, or no more nodes than the limit M: then `capacity` accounting). Its b·s/t tokens, each
    with the expected copies of `moe_routing.node_limited_dispatch_copies` (k routed experts: the
    shared ones are computed at home), in each pass a dispatch-direction all-to-all (FP8 with
    `training.fp8_dispatch`) and a combine-direction one (the forward's combine, and in backward
    the dispatch's gradient, in bf16); forward passes twice with full recomputation."""

    g, group, routed = cluster.gpus_per_node, layout.expert_ep, model.top_k - model.shared_experts
    nodes = group // g
    if not model.max_nodes or group % g or nodes <= model.max_nodes or routed % model.max_nodes:
        return None
    copies = moe_routing.node_limited_dispatch_copies(routed, model.experts, nodes, g, model.max_nodes)
    w = training.bytes_per_value
    per_copy = model.hidden * ((FP8_DISPATCH_BYTES_PER_VALUE if training.fp8_dispatch else w) + w)
    passes = (2 if training.recompute == "full" else 1) + 1
    tokens = expert_tokens_per_gpu(model, training, layout)
    return {link: passes * tokens * copies[link] * per_copy for link in ("inter_node", "intra_node")}


@functools.lru_cache(maxsize=4096)
def _pp_exposed(stages: int, micro_batches: int, message_over_forward: float) -> float:
    """dtp.overlap.model.pp_exposed in units of one forward (backward = 2 forwards), cached."""
    return overlap.pp_exposed(stages, micro_batches, message_over_forward, 1.0, 2.0)


def pp_exposed_seconds(stages: int, micro_batches: int, message_s: float, forward_s: float, chunks: int = 1) -> float:
    """Exposed time of the pipeline's activation and gradient messages, from the course's 1F1B
    simulator (dtp.overlap.model.pp_exposed); beyond 2p micro-batches the steady state adds the same
    per micro-batch, so it is extrapolated linearly from 2p. Interleaving sends v times as many
    messages, each between smaller chunks: the exposure of v pipelines' messages."""
    if stages == 1 or message_s == 0:
        return 0.0
    ratio = float(f"{message_s / forward_s:.3g}")
    cap = 2 * stages
    if micro_batches <= cap:
        exposed = _pp_exposed(stages, micro_batches, ratio)
    else:
        slope = (_pp_exposed(stages, cap, ratio) - _pp_exposed(stages, cap - stages, ratio)) / stages
        exposed = _pp_exposed(stages, cap, ratio) + slope * (micro_batches - cap)
    return exposed * forward_s * chunks


def dp_exposed_seconds(layout, training, sent: dict[str, float], bandwidth: float, compute: dict) -> float:
    """Exposed data-parallel time per step for `sent` = {"gradients": bytes, "weights": bytes}
    (dtp.zero.formulas.accumulation_bytes_sent_per_gpu) on a link of `bandwidth`, from dtp.overlap.model:
    - gradients reduced in buckets during the backward they come from (dtp.overlap.model.ddp_exposed,
      torch DDP's 25 MiB buckets): once per step under the last micro-batch's backward, or, with
      ZeRO-2/3 reducing every micro-batch, each micro-batch's share under its own backward;
    - ZeRO-3 gathers each layer's weights before its forward and again before its backward, the
      next layer's gather prefetched under this one's compute (fsdp_forward_exposed and
      fsdp_backward_exposed, one unit per layer);
    - ZeRO-1/2 all-gather the updated weights after the optimizer step: exposed, or hidden under
      the next forward when `training.overlap_param_gather` (Megatron's distributed optimizer);
    - without `training.dp_overlap`, the gradients are reduced after the step's last backward, all
      of it exposed (Megatron-LM 2021's own DistributedDataParallel all-reduced its gradient
      buffer in one call after backward)."""
    m = layout.micro_batches
    reductions = m if layout.zero_stage >= 2 and layout.reduce_every_micro_batch else 1
    exposed = 0.0
    if sent["gradients"] and not training.dp_overlap:  # reduced after backward (Megatron-LM 2021's DDP)
        exposed += sent["gradients"] / bandwidth
    elif sent["gradients"]:
        per_reduction = sent["gradients"] / reductions
        buckets = max(1, round(per_reduction / DDP_BUCKET_BYTES))
        exposed += reductions * overlap.ddp_exposed(per_reduction / bandwidth, compute["backward"], buckets)
    weight_s = sent["weights"] / bandwidth
    if layout.zero_stage == 3:
        units = compute["units"]
        gather = weight_s / (2 * m * units)
        exposed += m * (overlap.fsdp_forward_exposed(units, gather, compute["layer_forward"])
                        + overlap.fsdp_backward_exposed(units, gather, 0.0, compute["layer_backward"]))
    elif weight_s:
        exposed += overlap.exposed(weight_s, compute["forward"]) if training.overlap_param_gather else weight_s
    return exposed


def tp_exposed_seconds(tp_s: float, layout, training, compute: dict) -> float:
    """Exposed TP time per step (dtp.overlap.model.tp_layer_exposed): per layer and micro-batch, forward's
    two all-reduce-sized collectives are on the critical path; backward's two each run under
    half the layer's weight-gradient GEMMs (with full recomputation the repeated forward's two
    are exposed too). Without `training.tp_overlap` all of it is exposed."""
    if not tp_s or not training.tp_overlap:
        return tp_s
    layers = compute["units"]
    passes = 3 if training.recompute == "full" else 2
    per_collective = tp_s / (layout.micro_batches * layers * 2 * passes)
    per_layer = overlap.tp_layer_exposed(per_collective, compute["layer_forward_gemm"] / 2)
    if training.recompute == "full":
        per_layer += 2 * per_collective
    return layout.micro_batches * layers * per_layer


def ep_exposed_seconds(ep_s: float, layout, training, compute: dict) -> float:
    """Exposed EP time per step (dtp.overlap.model.ep_exposed): serial, all of it; with
    `training.ep_overlap` (two micro-batches interleaved, as DeepSeek-V3's DualPipe does), each
    micro-batch's all-to-alls under the other's compute."""
    if not ep_s:
        return 0.0
    if not training.ep_overlap:
        return ep_s
    pairs = layout.micro_batches / 2
    per_pair = ep_s / pairs / 2
    return pairs * overlap.ep_exposed(per_pair, compute["forward"] + compute["backward"], overlapped=True)


def cp_exposed_seconds(cp_s: float, layout, training, compute: dict) -> float:
    """Exposed context-parallel time per step: all of it with `cp_method="allgather"` (K/V
    gathered before attention starts, dK/dV reduced after it ends). Ring attention: per layer and
    micro-batch, forward takes c - 1 ring steps, each passing one K/V block while the GPU computes
    attention on the block it holds (1/c of the layer's attention); backward takes c steps that
    carry 2c - 1 blocks (K/V again, and their gradients) under 2/c of it each. A step's transfer
    sticks out by max(0, transfer - that compute) (dtp.overlap.model.exposed)."""
    c = layout.cp
    if c == 1 or not cp_s:
        return 0.0
    if training.cp_method == "allgather":  # Llama 3: "the all-gather communication latency is exposed"
        return cp_s
    per_layer = cp_s / (layout.micro_batches * compute["units"])
    forwards = 2 if training.recompute == "full" else 1
    # forward passes send K/V once each, backward K/V again and their gradients (dtp.cp.context_parallel)
    shares = {"forward": forwards * (c - 1), "backward": (c - 1) + c}
    unit = per_layer / (shares["forward"] + shares["backward"])
    attention = compute["layer_attention"]
    exposed = forwards * (c - 1) * overlap.exposed(unit, attention / c)
    exposed += c * overlap.exposed(unit * (2 * c - 1) / c, 2 * attention / c)  # c steps carry 2c - 1 blocks
    return layout.micro_batches * compute["units"] * exposed


# Adam in mixed precision reads each parameter's fp32 gradient, weight, m and v (16 bytes), writes
# the weight, m and v (12) and the 16-bit copy of the weight (2), and reads the gradient once more
# for the global norm that clips it (4): a pass limited by the memory bandwidth.
OPTIMIZER_BYTES_PER_PARAMETER = 34


def optimizer_seconds(parameters_per_gpu: float, hbm_bytes_per_s: float) -> float:
    """The optimizer step over the parameters a GPU updates (its ZeRO shard), memory bound."""
    return OPTIMIZER_BYTES_PER_PARAMETER * parameters_per_gpu / hbm_bytes_per_s


def roofline_step_time(model, cluster, training, layout, seconds: dict[str, float],
                       data_parallel: dict[str, tuple[dict, float]]) -> dict[str, float]:
    """`seconds`: each dimension's communication time, all of it; `data_parallel`: for "dp" (and
    "expert_dp") the bytes sent as gradients and weights and the link's bandwidth. The step's parts: "compute" (m micro-batches on the slowest stage), the exposed part of
    each dimension's communication, and "bubble": (p-1)/v of a micro-batch's compute and
    in-micro-batch communication (interleaved 1F1B with v chunks per stage). With
    `training.pipeline_schedule == "dualpipe"` (DeepSeek-V3, section 3.2.1 and its Table 2), the
    bubble is (p/2 - 1)(F&B + B - 3W), the overlapped forward-and-backward pair F&B taken as F + B
    and W the weight-gradient GEMMs, plus (p/2 - 1) micro-batches' exposed TP, EP and CP time; each
    micro-batch's two PP messages run under a forward-and-backward pair (dtp.overlap.model.exposed)."""
    compute = micro_batch_compute(model, cluster, training, layout)
    compute["units"] = busiest_stage_layers(model, training, layout.pp)
    m, p, v = layout.micro_batches, layout.pp, training.chunks
    parts = {"compute": m * (compute["forward"] + compute["backward"])}
    parts["tp"] = tp_exposed_seconds(seconds.get("tp", 0.0), layout, training, compute)
    parts["ep"] = ep_exposed_seconds(seconds.get("ep", 0.0), layout, training, compute)
    message = seconds.get("pp", 0.0) / (2 * m) if p > 1 else 0.0
    parts["pp"] = pp_exposed_seconds(p, m, message, compute["forward"] / v, v) if p > 1 else 0.0
    parts["cp"] = cp_exposed_seconds(seconds.get("cp", 0.0), layout, training, compute)
    for name, (sent, bandwidth) in data_parallel.items():
        parts[name] = dp_exposed_seconds(layout, training, sent, bandwidth, compute)
    parts["bubble"] = (parts["compute"] + parts["tp"] + parts["ep"] + parts["cp"]) / m * (p - 1) / v
    if training.pipeline_schedule == "dualpipe" and p > 1:
        if p % 2 or m % 2 or v > 1:
            raise ValueError(f"DualPipe needs even stages and micro-batches and no interleaving (p={p}, m={m}, v={v})")
        f, b, w = compute["forward"], compute["backward"], compute["weight_gradient"]
        parts["pp"] = m * overlap.exposed(2 * message, f + b)
        parts["bubble"] = (p / 2 - 1) * (f + 2 * b - 3 * w + (parts["tp"] + parts["ep"] + parts["cp"]) / m)
    elif training.pipeline_schedule != "1f1b":
        raise ValueError(f"pipeline_schedule must be '1f1b' or 'dualpipe', got {training.pipeline_schedule!r}")
    parts["optimizer"] = optimizer_seconds(updated_parameters(model, layout), cluster.hbm_bytes_per_s) \
        if training.optimizer_step else 0.0
    return parts


def updated_parameters(model, layout) -> float:
    """Parameters one GPU's optimizer updates: its t·p share, divided among the ranks that hold
    the same parameters when ZeRO shards the optimizer (stage 1 and up): dp·cp for the
    non-expert ones, dp/e for the experts."""

    counts, shards = parameter_counts(model), layout.tp * layout.pp
    sharded = layout.zero_stage >= 1
    non_expert = counts["non_expert"] / shards / (layout.dp * layout.cp if sharded else 1)
    experts = counts["experts"] / (shards * layout.ep) / (layout.dp // layout.ep if sharded else 1)
    return non_expert + experts
