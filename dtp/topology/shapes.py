"""The planner's vocabulary: a model's shape (dense GPT or MoE), a cluster, a training set-up and a
layout, with the parameter counts and per-GPU expert tokens that the planner (dtp.topology.planner)
and its step-time model (dtp.topology.costs) both use."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from dtp.common.gpt import GPTConfig
from dtp.memory import formulas as memory
from dtp.topology.mesh import INTRA_NODE

# The layout's fields, in the order the planner's rows list them. `reduce_every_micro_batch` (0 or 1)
# says how ZeRO-2/3 accumulate gradients over micro-batches; `expert_tp` is the TP degree of the
# experts (t, or 1 with the experts' EP group folded over the TP ranks).
LAYOUT_FIELDS = ("tp", "pp", "dp", "ep", "zero_stage", "micro_batches", "reduce_every_micro_batch", "expert_tp")
# What the roofline model searches beyond them (rows of the "fixed" model have cp = 1 and Training's b and v).
SEARCHED_FIELDS = ("cp", "micro_batch", "chunks")


@dataclass(frozen=True)
class ModelShape:
    """A GPT (experts = 1) or an MoE GPT with `experts` experts per block, `top_k` per token."""
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    experts: int = 1
    top_k: int = 1
    mlp_ratio: int = 4  # a dense block's MLP width, in multiples of the hidden size
    expert_hidden: int = 0  # an expert's MLP width; 0: the dense MLP's, mlp_ratio·hidden
    capacity_factor: float = 1.0
    name: str = ""
    kv_heads: int = 0  # grouped-query attention's K/V heads (0: as many as heads); only CP's K/V traffic uses it
    shared_experts: int = 0  # of the top_k experts a token uses, those it uses on its own GPU (never dispatched)
    max_nodes: int = 0  # node-limited routing: a token's routed experts on at most this many nodes (0: no limit)
    # "gpt": the course's GPT blocks (LayerNorm, biases, learned positions, a GeLU MLP of width
    # mlp_ratio·h); "llama": RMSNorm, no biases, no position table, grouped-query attention (K and V
    # projections of kv_heads heads) and a gated SwiGLU MLP of width ffn_hidden (three matrices)
    block: str = "gpt"
    ffn_hidden: int = 0  # the dense MLP's width (0: mlp_ratio·hidden)
    tied_embeddings: bool = False  # the output layer reuses the embedding (on the first and last stages)
    # DeepSeek-V3's multi-token prediction (its section 2.2): each module, on the last stage, runs one more block
    # (and an h x 2h projection) and the output head once more
    mtp_modules: int = 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 1

    @property
    def kv_hidden(self) -> int:
        """The width of K (and of V): kv_heads · h/a."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def mlp_width(self) -> int:
        """The dense MLP's width."""
        return self.ffn_hidden or self.mlp_ratio * self.hidden

    @property
    def expert_width(self) -> int:
        return self.expert_hidden or self.mlp_width

    @property
    def gated(self) -> bool:
        """SwiGLU MLPs (three matrices: gate, up, down) rather than GeLU's two."""
        return self.block == "llama"

    @property
    def config(self) -> GPTConfig:
        """The dense GPT with one MLP per block, as dtp.memory.calculator takes it."""
        return GPTConfig(vocab_size=self.vocab, n_positions=self.seq, n_layers=self.layers, hidden=self.hidden,
                         n_heads=self.heads, mlp_ratio=self.mlp_ratio, tied_embeddings=self.tied_embeddings,
                         dropout=0.0)


@dataclass(frozen=True)
class Cluster:
    """Bandwidths are per GPU and per direction (a GPU sends at this rate while it receives)."""
    nodes: int
    gpus_per_node: int
    memory_bytes: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    peak_flops: float
    name: str = ""
    hbm_bytes_per_s: float = 0.0  # memory bandwidth, for the roofline cost model
    # The roofline model's measured shares (1.0: the vendor's figures, as the exercise's model takes them):
    gemm_ceiling: float = 0.8  # of the peak, the largest GEMMs (cuBLAS) reach
    attention_ceiling: float = 0.8  # of the peak, a fused (flash) attention kernel reaches
    intra_node_efficiency: float = 1.0  # of the link rate, NCCL's collectives reach inside a node
    inter_node_efficiency: float = 1.0  # ... and between nodes
    fp8_peak_flops: float = 0.0  # dense FP8 tensor-core peak (0: none), for Training.fp8_gemms
    fp8_gemm_ceiling: float = 0.0  # of the FP8 peak, the best measured FP8 GEMMs with fine-grained scaling reach
    # The practised model's latency and contention (dtp.topology.collectives; none in the exercise's model):
    # alpha_s: seconds per ring step of a collective on each link class, ((link, seconds), ...), and
    # collective_base_s: a collective's fixed start-up, both from NCCL's own tuning model;
    # contention ε: computation that runs beside communication takes f·(1 + ε).
    alpha_s: tuple = ()
    collective_base_s: float = 0.0
    contention: float = 0.0

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def bandwidth(self, link: str) -> float:
        return self.intra_node_bytes_per_s if link == INTRA_NODE else self.inter_node_bytes_per_s

    def alpha(self, link: str) -> float:
        """Seconds per ring step of a collective on `link` (0 where the cluster gives none)."""
        return dict(self.alpha_s).get(link, 0.0)

    def achieved_bandwidth(self, link: str) -> float:
        """What NCCL reaches on the link: its rate times the measured efficiency (roofline model)."""
        return self.bandwidth(link) * (self.intra_node_efficiency if link == INTRA_NODE else self.inter_node_efficiency)


@dataclass(frozen=True)
class Training:
    global_batch: int  # sequences per step
    micro_batch: int = 1  # sequences per micro-batch
    recompute: str = "selective"
    recipe: str = "mixed_adam"
    flops_utilization: float = 0.5  # share of the peak the GPUs reach while they compute ("fixed" model)
    bytes_per_value: int = 2  # activations, gradients and weights on the wire (bf16)
    # "fixed": compute at flops_utilization, all communication exposed (the exercise's model);
    # "roofline": dtp.topology.costs (GEMM roofline, elementwise work, dtp.overlap.model's exposure)
    cost_model: str = "fixed"
    chunks: int = 1  # interleaved 1F1B: model chunks per pipeline stage (v)
    pp_outermost: bool = False  # rank order TP, (EP,) DP, PP (Megatron-Core's default) instead of TP, (EP,) PP, DP
    flash_attention: bool = False  # roofline: attention scores stay on chip (no s² activations in HBM); the
    # causal mask's hidden half of the scores is skipped
    sequence_parallel: bool = True  # roofline: norms, dropout and residuals split t ways (False: Megatron-LM 2021)
    dp_overlap: bool = True  # roofline: DP gradients reduced in buckets during backward (False: after it)
    optimizer_step: bool = True  # roofline: the optimizer's memory-bound pass over the GPU's parameters
    # roofline search dimensions (empty: the single micro_batch and chunks above)
    micro_batch_choices: tuple = ()
    chunk_choices: tuple = ()
    max_context_parallel: int = 1  # roofline: CP sizes up to this are planned (dense models)
    overlap_param_gather: bool = False  # roofline: ZeRO-1/2's weight all-gather under the next forward
    ep_overlap: bool = False  # roofline: two micro-batches' all-to-alls each under the other's compute
    tp_overlap: bool = True  # roofline: TP's backward collectives under the weight-gradient GEMMs
    pp_overlap: bool = False  # roofline: interleaved 1F1B's sends and receives under the next chunk's compute
    # (Megatron-Core's overlap_p2p_comm); off, the course's 1F1B simulator says what stays exposed
    # How each practice is modelled (named, switchable; the chapter's page gives each one's source):
    ep_dispatch: str = "capacity"  # "capacity": every routed copy, at capacity C, over the EP group's link;
    # "node_limited": DeepSeek-V3's (model.max_nodes): one copy per chosen remote node over the inter-node
    # link, forwarded over NVLink inside it (`moe_routing.node_limited_dispatch_copies`), both links at once
    fp8_dispatch: bool = False  # EP: dispatch-direction all-to-alls in FP8 (with a float32 scale per 128 values)
    fp8_gemms: bool = False  # roofline: the linear layers' GEMMs in FP8 (Cluster.fp8_*); attention, output in bf16
    comm_sm_share: float = 0.0  # roofline: share of the SMs the communication kernels hold, lost to computation
    cp_method: str = "ring"  # "ring" (K/V blocks passed under attention) or "allgather" (Llama 3: K/V gathered first)
    balanced_stages: bool = False  # Llama 3, BLOOM: the embedding and the output layer count as one layer each
    # when the layers are split over the stages (dtp.topology.stages.split_layers); without it the
    # stages hold L/p layers each (p must divide L), the first and last stages the embedding and output on top
    pipeline_schedule: str = "1f1b"  # roofline: Megatron's 1F1B (interleaved when v > 1); "deepspeed" (DeepSpeed's
    # PipelineEngine: no interleaving, its instructions run one after the other, so every send and receive waits,
    # and the gradients are reduced after the last micro-batch); "dualpipe" (DeepSeek-V3's bubble and PP overlap)
    gradient_reduce_bytes: int = 0  # bytes per gradient value in the DP reduction (0: bytes_per_value; Megatron's
    # --accumulate-allreduce-grads-in-fp32 and DeepSpeed's BF16 optimizer reduce fp32 gradients: 4)
    max_zero_stage_with_pp: int = 3  # the highest ZeRO stage the framework runs with PP > 1 (DeepSpeed: 1)


@dataclass(frozen=True)
class PlannedLayout:
    tp: int
    pp: int
    dp: int
    ep: int
    zero_stage: int
    micro_batches: int
    # ZeRO-2/3 only: 1 reduce-scatters every micro-batch's gradients into sharded ones, 0 accumulates
    # unsharded gradients (their full memory) and reduces once per step. Stages 0 and 1 reduce once: 0.
    reduce_every_micro_batch: int = 0
    # The experts' TP degree: 0 means "the attention's", t (Megatron-Core's expert TP = TP); 1 folds
    # the experts' EP group over the t·e GPUs of the TP and EP groups (MoE parallel folding).
    expert_tp: int = 0
    # Context parallelism (the sequence split c ways; dense models): tp·cp·pp·dp = GPUs, order TP, CP, PP, DP.
    cp: int = 1
    # The roofline model's searched choices: the micro-batch size b and the interleaved schedule's v
    # (0: Training's micro_batch and chunks).
    micro_batch: int = 0
    chunks: int = 0
    # Layers on each pipeline stage, first to last (empty: as Training's split rule gives them).
    stage_layers: tuple = ()

    def __post_init__(self):
        if not self.expert_tp:
            object.__setattr__(self, "expert_tp", self.tp)

    @property
    def expert_ep(self) -> int:
        """GPUs of one expert all-to-all group: e, or t·e when the experts are not tensor-parallel."""
        return self.ep * self.tp // self.expert_tp

    def sizes(self, model: ModelShape) -> dict[str, int]:
        """The layout as `dtp.topology.mesh` takes it (EP only for an MoE model)."""
        sizes = {"tp": self.tp, "pp": self.pp, "dp": self.dp}
        if self.cp > 1:
            sizes["cp"] = self.cp
        return {**sizes, "ep": self.ep} if model.is_moe else sizes

    def order(self, model: ModelShape, pp_outermost: bool = False) -> tuple[str, ...]:
        inner = ("tp", "ep") if model.is_moe else ("tp", "cp") if self.cp > 1 else ("tp",)
        return inner + (("dp", "pp") if pp_outermost else ("pp", "dp"))

    def training(self, training: "Training") -> "Training":
        """`training` with this layout's searched micro-batch size and chunks, where it has them."""
        changes = {name: getattr(self, name) for name in ("micro_batch", "chunks") if getattr(self, name)}
        return dataclasses.replace(training, **changes) if changes else training


# --- parameters -------------------------------------------------------------------------------

def mlp_parameters(hidden: int, width: int, gated: bool = False) -> int:
    """A GPT MLP's two Linear layers with biases, or a SwiGLU MLP's three bias-free matrices."""
    return 3 * hidden * width if gated else hidden * width + width + width * hidden + hidden


@functools.lru_cache(maxsize=256)
def block_parameter_counts(model: ModelShape) -> dict[str, int]:
    """One block's "attention" (with its norms; and an MoE block's router), "mlp" (the dense MLP)
    and "expert" (one expert; 0 for a dense model); "embedding" (token table, and the GPT's
    position table) and "output" (the final norm and, untied, the output layer)."""
    h, v = model.hidden, model.vocab
    if model.block == "gpt":
        attention = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h)
        embedding, output = v * h + model.seq * h, 2 * h
    elif model.block == "llama":
        attention = 2 * h + h * (h + 2 * model.kv_hidden) + h * h
        embedding, output = v * h, h
    else:
        raise ValueError(f"block must be 'gpt' or 'llama', got {model.block!r}")
    if not model.tied_embeddings:
        output += v * h
    return {"attention": attention + (h * model.experts if model.is_moe else 0),
            "mlp": mlp_parameters(h, model.mlp_width, model.gated),
            "expert": mlp_parameters(h, model.expert_width, model.gated) if model.is_moe else 0,
            "embedding": embedding, "output": output}


@functools.lru_cache(maxsize=256)
def parameter_counts(model: ModelShape) -> dict[str, int]:
    """"total", "active" (per token: k experts per block), "experts" (all experts' parameters,
    0 for a dense model) and "non_expert" (everything else: attention, norms, routers,
    embeddings, and a dense model's MLPs). A dense GPT's is dtp.memory's count of the torch model."""
    if model.block == "gpt" and not model.is_moe and model.mlp_width == model.mlp_ratio * model.hidden \
            and not model.mtp_modules:
        dense = memory.gpt_parameter_count(model.config)
        return {"total": dense, "active": dense, "experts": 0, "non_expert": dense}
    block = block_parameter_counts(model)
    mlps = model.experts * block["expert"] if model.is_moe else block["mlp"]
    blocks = model.layers + model.mtp_modules
    total = block["embedding"] + block["output"] + blocks * (block["attention"] + mlps) \
        + model.mtp_modules * 2 * model.hidden**2
    experts = blocks * model.experts * block["expert"]
    return {"total": total, "active": total - blocks * (model.experts - model.top_k) * block["expert"],
            "experts": experts, "non_expert": total - experts}


def expert_tokens_per_gpu(model: ModelShape, training: Training, layout: PlannedLayout) -> int:
    """Tokens of a micro-batch each GPU routes: with sequence parallelism (which Megatron-Core
    requires with TP + EP) each TP rank holds and dispatches its own b·s/t tokens."""
    return training.micro_batch * model.seq // layout.tp
