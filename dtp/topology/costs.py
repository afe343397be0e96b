"""The practised step time's computation: matrix-multiply efficiency from a roofline on each
GEMM's shapes, memory-bound elementwise work, the output layer and the optimizer step, per layer
and micro-batch on one GPU (`dtp.topology.step` puts them together with the stages and the
exposed communication).

`dtp.topology.planner.step_time` uses this model when `Training.cost_model == "roofline"`; the
exercise's model (`"fixed"`: a constant share of the peak, all communication exposed) stays
there, simple enough to check by hand. Every assumption is a named parameter here and is stated
on the chapter's pages.

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

from dtp.ep import routing as moe_routing
from dtp.memory import formulas as memory
from dtp.topology.shapes import expert_tokens_per_gpu, parameter_counts

ELEMENTWISE_PASSES = 5  # forward: write + read; backward: read, write the gradient, read it
# flash attention's backward over its forward, in FLOPs (Dao-AILab/flash-attention's benchmarks count 2.5x: the
# backward recomputes the scores and computes dQ, dK and dV)
FLASH_BACKWARD_OVER_FORWARD = 2.5


def gemm_intensity(m: float, n: float, k: float, bytes_per_value: int = 2) -> float:
    """FLOPs per byte of HBM traffic of a product of (m x k) by (k x n): both operands read, the
    result written once."""
    return 2 * m * n * k / (bytes_per_value * (m * k + k * n + m * n))


def gemm_seconds(m: float, n: float, k: float, peak_flops: float, hbm_bytes_per_s: float, ceiling: float,
                 batch: float = 1, bytes_per_value: int = 2) -> float:
    """Roofline time of `batch` products of (m x k) by (k x n)."""
    flops = 2 * m * n * k
    return batch * flops / min(ceiling * peak_flops, gemm_intensity(m, n, k, bytes_per_value) * hbm_bytes_per_s)


def layer_gemms(model, training, layout) -> list[tuple[float, float, float, float]]:
    """(M, N, K, batch) of one layer's forward GEMMs on one GPU for one micro-batch: the QKV and
    output projections and the MLP split t ways over the b·s tokens sequence parallelism gathers
    (Llama blocks: K and V of kv_heads heads, a gated MLP's gate and up projections as one GEMM of
    width 2f); attention's QKᵀ and AV per head (a/t heads per GPU); an MoE layer's experts on the
    rows each GPU receives (E·C from its all-to-all group, times t when the experts are tensor-parallel)."""
    from dtp.ep.moe import expert_capacity

    t, h, s, b = layout.tp, model.hidden, model.seq, training.micro_batch
    c = getattr(layout, "cp", 1)
    tokens, head = b * s // c, h // model.heads
    # attention: each GPU's s/c queries against all s keys (ring attention brings them block by
    # block); with flash attention the causal mask's hidden half is skipped
    keys = s / 2 if training.flash_attention else s
    qkv = h + 2 * model.kv_hidden if model.block == "llama" else 3 * h
    gemms = [(tokens, qkv / t, h, 1), (tokens, h, h / t, 1),
             (s / c, keys, head, b * model.heads / t), (s / c, head, keys, b * model.heads / t)]
    up = 2 if model.gated else 1  # SwiGLU's gate and up projections side by side
    if not model.is_moe:
        width = model.mlp_width
        return gemms + [(tokens, up * width / t, h, 1), (tokens, h, width / t, 1)]
    capacity = expert_capacity(b * s // t, model.experts, model.top_k, model.capacity_factor)
    group = layout.expert_ep
    local_experts = model.experts / group
    # rows per local expert: C from each of the group's GPUs, gathered over the t TP ranks when the
    # experts are tensor-parallel (each then holds 1/t of the expert's width)
    rows = capacity * group * layout.expert_tp
    width = model.expert_width / layout.expert_tp
    return gemms + [(rows, up * width, h, local_experts), (rows, h, width, local_experts)]


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
    # the bytes a layer keeps on this GPU (`layer_activation_bytes`): without sequence parallelism the
    # norms', dropouts' and residuals' work is repeated on every TP rank (Korthikanti et al. 2022's 10sbh)
    kept = layer_activation_bytes(model, training, layout, "selective" if training.flash_attention else "none")
    return {"gemm": sum(times), "attention_core": times[2] + times[3],
            "elementwise": ELEMENTWISE_PASSES * kept / hbm}


def layer_activation_bytes(model, training, layout, recompute: str | None = None) -> float:
    """Bytes one layer keeps for backward on one GPU for one micro-batch. GPT blocks: Korthikanti
    et al. 2022's table 2 (dtp.memory.formulas; with context parallelism the s/c queries' rows
    against all s keys), with what an MoE's or another MLP keeps beyond the 4h GeLU MLP
    (`mlp_extra_bytes_per_token`). Llama blocks, counted the same way for their own tensors (16-bit,
    per token): the two RMSNorms' inputs (4h), the QKV and MLP inputs (2h each), Q (2h), K and V
    (2·2·h_kv), the output projection's input (2h), the SwiGLU's gate, up and product (6f; an MoE:
    cf·k routed copies of 2h + 6f), no dropout masks; the first 8h are what TP cannot split without
    sequence parallelism; without flash attention (and without recomputation) the softmax's
    output, 2as² per sequence. Full recomputation keeps the layer's input, 2h per token."""
    recompute = recompute or training.recompute
    if model.block != "llama":
        kept = memory.activation_bytes_per_layer(model.seq, training.micro_batch, model.hidden, model.heads,
                                                 tensor_parallel=layout.tp,
                                                 sequence_parallel=training.sequence_parallel,
                                                 recompute=recompute, context_parallel=layout.cp)
        return kept + mlp_extra_bytes_per_token(model, recompute) * model.seq * training.micro_batch \
            / (layout.tp * layout.cp)
    h, t, tokens = model.hidden, layout.tp, training.micro_batch * model.seq / layout.cp
    if recompute == "full":
        return 2 * h * tokens
    mlp = (model.capacity_factor * model.top_k * (2 * h + 6 * model.expert_width) if model.is_moe
           else 6 * model.mlp_width)
    split = 4 * h + 4 * model.kv_hidden + mlp
    unsplit = 8 * h
    per_token = (unsplit + split) / t if training.sequence_parallel else unsplit + split / t
    if recompute == "none" and not training.flash_attention:
        per_token += 2 * model.heads * model.seq / t
    return per_token * tokens


def mlp_activation_bytes_per_token(hidden: int, width: int, gated: bool = False) -> int:
    """Bytes an MLP of `width` keeps per token in 16-bit activations (Korthikanti et al. 2022,
    section 4.1): its input (2h), GeLU's input and output (2f each) and a 1-byte dropout mask on
    its output (h): 3h + 4f, the 19h of their 34sbh when f = 4h. A SwiGLU MLP keeps its gate's and
    up projection's outputs and their product's SiLU input (2f each more): 3h + 6f."""
    return 3 * hidden + (6 if gated else 4) * width


def mlp_extra_bytes_per_token(model, recompute: str) -> float:
    """Bytes per token (before the t-way split) that a layer keeps beyond the GPT block whose
    34sbh dtp.memory counts: an MoE's cf·k routed copies' expert activations, or a MLP of another
    width or kind, in place of one 4h GeLU MLP. None with full recomputation (the layer's input only)."""
    if recompute == "full":
        return 0.0
    h = model.hidden
    gpt = mlp_activation_bytes_per_token(h, 4 * h)
    if model.is_moe:
        return model.capacity_factor * model.top_k * mlp_activation_bytes_per_token(h, model.expert_width,
                                                                                     model.gated) - gpt
    return mlp_activation_bytes_per_token(h, model.mlp_width, model.gated) - gpt


def micro_batch_compute(model, cluster, training, layout) -> dict[str, float]:
    """Seconds one GPU computes per micro-batch, per layer: "layer_forward" and "layer_backward"
    (backward's GEMMs take twice forward's: input and weight gradients, recomputation added; flash
    attention's backward recomputes the scores, 2.5 times its forward's FLOPs, as the
    flash-attention repository's benchmarks count them, so selective recomputation adds nothing to
    it), "layer_forward_gemm" (the weight-gradient GEMMs' half of backward, which TP's backward
    collectives can hide under) and "layer_attention" (QKᵀ and AV); and the output layer's
    "logits" GEMM and the loss, forward (backward takes twice that), on the last stage: the
    cross-entropy over the fp32 logits is elementwise work over their bytes, as a layer's is."""
    layer = forward_layer_seconds(model, cluster, training, layout)
    attention = layer["attention_core"]
    recomputed = {"none": 0.0, "selective": 0.0 if training.flash_attention else attention,
                  "full": layer["gemm"] + layer["elementwise"] * 2 / ELEMENTWISE_PASSES}[training.recompute]
    flash_backward = FLASH_BACKWARD_OVER_FORWARD - 2 if training.flash_attention else 0.0
    tokens = training.micro_batch * model.seq // layout.cp
    logits = gemm_seconds(tokens, model.vocab / layout.tp, model.hidden, cluster.peak_flops, cluster.hbm_bytes_per_s,
                          cluster.gemm_ceiling)
    logits += ELEMENTWISE_PASSES / 3 * memory.logits_bytes(model.seq, training.micro_batch, model.vocab, layout.tp,
                                                           layout.cp) / cluster.hbm_bytes_per_s
    return {"layer_forward": layer["gemm"] + layer["elementwise"] * 2 / ELEMENTWISE_PASSES,
            "layer_backward": 2 * layer["gemm"] + flash_backward * attention
            + layer["elementwise"] * 3 / ELEMENTWISE_PASSES + recomputed,
            "layer_forward_gemm": layer["gemm"], "layer_attention": attention,
            "logits": logits / (1 - training.comm_sm_share)}


def stage_compute(compute: dict, layers: int, output: bool, mtp_modules: int = 0) -> dict[str, float]:
    """One stage's seconds per micro-batch: its layers, and the output layer on the last stage,
    with each multi-token-prediction module's block and pass through the output head (the
    embedding's lookup is not computation worth counting)."""
    if output:
        layers += mtp_modules
    logits = compute["logits"] * (1 + mtp_modules) if output else 0.0
    return {"forward": layers * compute["layer_forward"] + logits,
            "backward": layers * compute["layer_backward"] + 2 * logits,
            "weight_gradient": layers * compute["layer_forward_gemm"] + logits}


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


# Adam in mixed precision reads each parameter's fp32 gradient, weight, m and v (16 bytes), writes
# the weight, m and v (12) and the 16-bit copy of the weight (2), and reads the gradient once more
# for the global norm that clips it (4): a pass limited by the memory bandwidth.
OPTIMIZER_BYTES_PER_PARAMETER = 34


def optimizer_seconds(parameters_per_gpu: float, hbm_bytes_per_s: float) -> float:
    """The optimizer step over the parameters a GPU updates (its ZeRO shard), memory bound."""
    return OPTIMIZER_BYTES_PER_PARAMETER * parameters_per_gpu / hbm_bytes_per_s


def updated_parameters(model, layout, stage: dict[str, float] | None = None) -> float:
    """Parameters one GPU's optimizer updates: its stage's (`stage`, {"non_expert", "experts"};
    1/p of all by default) split t ways (t·e for the experts), divided among the ranks that hold
    the same parameters when ZeRO shards the optimizer (stage 1 and up): dp·cp for the
    non-expert ones, dp/e for the experts."""
    if stage is None:
        counts = parameter_counts(model)
        stage = {name: counts[name] / layout.pp for name in ("non_expert", "experts")}
    sharded = layout.zero_stage >= 1
    non_expert = stage["non_expert"] / layout.tp / (layout.dp * layout.cp if sharded else 1)
    experts = stage["experts"] / (layout.tp * layout.ep) / (layout.dp // layout.ep if sharded else 1)
    return non_expert + experts
