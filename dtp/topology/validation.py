"""The planner's roofline model against published training runs: each run's model, hardware and
layout as published, the planner's predicted throughput beside the published one.

The published figures below are data, typed in with their source; everything else is computed.
A run's free choices that its paper does not state (micro-batch size b, interleaving v, the rank
order) are searched: the prediction is the planner's fastest fitting choice for the published
(t, p, d) and ZeRO stage.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

from dtp.memory import formulas as memory
from dtp.topology import planner
from dtp.topology.planner import Cluster, ModelShape, PlannedLayout, Training, evaluate, parameter_counts
from dtp.tp import tensor_parallel


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: ModelShape
    cluster: Cluster
    training: Training
    tp: int
    pp: int
    zero_stage: int
    # "megatron_tflops" (Narayanan et al.'s formula, recomputation counted), "model_tflops" (PaLM's model
    # FLOPs, dtp.memory.formulas.model_flops_per_token: 6N + 12·L·h·s per token), "causal_tflops" (the same with
    # attention's causal half: 6N + 6·L·h·s), "tokens"
    metric: str
    published: float  # TFLOP/s per GPU, MFU, or tokens per second per GPU
    source: str  # a references.bib key
    ep: int = 1
    cp: int = 1


def megatron_flops_per_step(model: ModelShape, batch: int) -> float:
    """Narayanan et al. 2021's FLOPs per iteration (their eq. 3, with activation recomputation):
    96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))."""
    s, l, h, v = model.seq, model.layers, model.hidden, model.vocab
    return 96 * batch * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))


def selene(nodes: int) -> Cluster:
    """DGX A100 80GB nodes as in Narayanan et al. 2021 (Selene: 8 A100s per node over NVLink 3,
    8 HDR InfiniBand ports of 200 Gb/s per node)."""
    return dataclasses.replace(planner.A100_CLUSTER, nodes=nodes, name=f"{nodes} DGX A100")


def h100_cluster(nodes: int, nvlink_per_direction: float = tensor_parallel.NVLINK4_PER_DIRECTION_BYTES_PER_S,
                 peak_flops: float = tensor_parallel.H100_BF16_DENSE_FLOPS, name: str = "H100") -> Cluster:
    return dataclasses.replace(planner.H100_CLUSTER, nodes=nodes, intra_node_bytes_per_s=nvlink_per_direction,
                               peak_flops=peak_flops, name=f"{nodes} nodes of 8 {name}")


# Narayanan et al. 2021, Table 1: (parameters in billions, heads, hidden, layers, TP, PP, GPUs, batch,
# achieved TFLOP/s per GPU). GPT models with a vocabulary of 51,200 and 2048-token sequences,
# mixed precision, activation recomputation, no ZeRO; measured end to end on Selene.
# Checked against the table Megatron-LM's README showed from 2021 to 2024 (images/cases_april2021.png
# in github.com/NVIDIA/Megatron-LM, added in commit 50a4b5fa02): hidden size, layers, GPUs, batch,
# model-parallel size t·p and achieved TFLOP/s per GPU agree on every row (the heads are the paper's).
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]

# Megatron-LM 2021 as its paper and code describe it: full activation recomputation; TP's backward
# all-reduces on the critical path (overlapping them with the weight-gradient GEMMs came later, as
# Megatron-Core's tp_comm_overlap); no sequence parallelism (Korthikanti et al. 2022 introduced it),
# so norms, dropout and residuals run whole on every TP rank; its own DistributedDataParallel
# all-reducing the gradient buffer after backward; no flash attention (2022): the scores, softmax and
# dropout over b·a·s² go through HBM; the optimizer step counted, as the throughput was "measured for
# end-to-end training, i.e., includes all operations including data loading, optimization, and even
# logging" (Megatron-LM's README).
MEGATRON_2021 = dict(recompute="full", cost_model="roofline", tp_overlap=False, sequence_parallel=False,
                     dp_overlap=False, flash_attention=False, optimizer_step=True)
ROOFLINE = Training(global_batch=1, **MEGATRON_2021)


def megatron_runs() -> list[PublishedRun]:
    runs = []
    for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON_TABLE_1:
        model = ModelShape(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048, name=f"GPT {billions}B")
        runs.append(PublishedRun(f"GPT {billions:g}B", model, selene(gpus // 8),
                                 dataclasses.replace(ROOFLINE, global_batch=batch), tp, pp, 0, "megatron_tflops",
                                 tflops, "narayanan2021efficient"))
    return runs


# Llama 3 405B (Llama Team 2024, Table 4; the same three rows were shown by Balaji, SC'24): H100s,
# TP 8, PP 16, 16M tokens per batch: 8,192 GPUs (CP 1, DP 64) at 430 TFLOP/s per GPU (43 % bf16
# MFU), 16,384 GPUs (CP 1, DP 128) at 400 (41 %), and 16,384 GPUs (CP 16, DP 8, 131,072-token
# sequences) at 380 (38 %); 8192-token sequences otherwise; FSDP-style sharding of optimizer
# states and gradients with PP. The TFLOP/s are the "BF16 Model FLOPs Utilization (MFU;
# Chowdhery et al.)" times the peak (section 3.3.2): PaLM's model FLOPs, 6N + 12·L·h·s per token.
# Its pipeline gives the first and last stages one layer fewer (126 + 2 = 16 x 8), and its context
# parallelism all-gathers K and V before attention, "exposed in the critical path" (section 3.3.2).
# Modelled with GPT blocks of its width and depth (126 layers, h = 16384, 128 heads, MLP 4h: 406B
# parameters, as many as Llama 3's with SwiGLU and GQA), its 8 K/V heads (for CP's K/V traffic)
# and its 128,256-token vocabulary; flash attention (the causal half skipped); selective
# recomputation.
LLAMA3_405B = ModelShape(layers=126, hidden=16384, heads=128, vocab=128256, seq=8192, kv_heads=8,
                         name="Llama 3 405B (GPT blocks)")
LLAMA3_TABLE_4 = [  # (GPUs, TP, CP, PP, sequence, TFLOP/s per GPU)
    (8192, 8, 1, 16, 8192, 430), (16384, 8, 1, 16, 8192, 400), (16384, 8, 16, 16, 131072, 380)]

# DeepSeek-V3 (DeepSeek-AI 2024, sections 3.1-3.3 and 4.2): 2048 H800s (NVLink 400 GB/s both ways,
# one 400 Gb/s InfiniBand port per GPU), PP 16, EP 64 over 8 nodes, ZeRO-1 DP, no TP; 180K H800
# GPU hours per trillion tokens; 4096-token sequences, batch 15,360 sequences. Each token's 8 routed
# experts (of 256) lie on at most M = 4 nodes; the shared expert runs on the token's own GPU; a
# token crosses InfiniBand once per chosen node and is forwarded over NVLink there ("NVLink offers
# a bandwidth of 160 GB/s, roughly 3.2 times that of IB (50 GB/s)", IB and NVLink "fully
# overlapped"), by kernels on 20 of the H800's 132 SMs (sections 3.2.2, 3.5.1); the linear layers'
# GEMMs in FP8, attention, embedding and output head in bf16 (3.3.1); dispatch in FP8, combine in
# bf16 (3.3.3); DualPipe overlaps the all-to-alls with computation. Modelled: 61 GPT-attention layers
# of h = 7168 (MLA not modelled), 256 routed experts top-8 plus the shared expert as a ninth active
# one, each expert an MLP of width 3072 (SwiGLU's three 7168 x 2048 matrices hold as many parameters).
DEEPSEEK_V3 = ModelShape(layers=61, hidden=7168, heads=128, vocab=129280, seq=4096, experts=256, top_k=9,
                         expert_hidden=3072, shared_experts=1, max_nodes=4, name="DeepSeek-V3 (approximated)")
H800_NVLINK_PER_DIRECTION = 400e9 / 2
H800_FP8_DENSE_FLOPS = 2 * tensor_parallel.H100_BF16_DENSE_FLOPS
H800_SMS, DEEPSEEK_V3_COMMUNICATION_SMS = 132, 20
# The best FP8 GEMM with DeepSeek-V3's fine-grained (1x128, 128x128) scaling in DeepGEMM's first
# release, measured on an H800 over the shapes DeepSeek-V3 uses: 1358 TFLOP/s (M = 4096, N = 7168,
# K = 16384; its README of 2025-02-25, 1.2x the "internally and carefully optimized implementation
# based on CUTLASS 3.6" it replaced). The bf16 ceiling's counterpart: the best measured on good shapes.
DEEPGEMM_BEST_FP8_FLOPS = 1358e12
# How DeepSeek-V3 is run, each switchable (the page shows what each contributes)
DEEPSEEK_V3_PRACTICE = dict(ep_dispatch="node_limited", fp8_dispatch=True, fp8_gemms=True,
                            comm_sm_share=DEEPSEEK_V3_COMMUNICATION_SMS / H800_SMS, pipeline_schedule="dualpipe")


# How Llama 3 is run, each switchable (the page shows what each contributes)
LLAMA3_PRACTICE = dict(cp_method="allgather", balanced_stages=True)


def llama_runs() -> list[PublishedRun]:
    runs = []
    for gpus, tp, cp, pp, seq, tflops in LLAMA3_TABLE_4:
        model = dataclasses.replace(LLAMA3_405B, seq=seq)
        training = Training(global_batch=16 * 2**20 // seq, recompute="selective", cost_model="roofline",
                            flash_attention=True, overlap_param_gather=True, **LLAMA3_PRACTICE)
        name = f"Llama 3 405B, {gpus:,} GPUs" + (f", CP {cp}, {seq // 1024}K tokens" if cp > 1 else "")
        runs.append(PublishedRun(name, model, h100_cluster(gpus // 8), training, tp=tp, pp=pp, zero_stage=2,
                                 metric="model_tflops", published=tflops, source="dubey2024llama3", cp=cp))
    return runs


def other_runs() -> list[PublishedRun]:
    tokens_per_gpu_s = 1e12 / (180e3 * 3600)
    h800 = dataclasses.replace(h100_cluster(256, H800_NVLINK_PER_DIRECTION, name="H800"),
                               fp8_peak_flops=H800_FP8_DENSE_FLOPS,
                               fp8_gemm_ceiling=DEEPGEMM_BEST_FP8_FLOPS / H800_FP8_DENSE_FLOPS)
    deepseek = PublishedRun("DeepSeek-V3 (MoE)", DEEPSEEK_V3, h800,
                            Training(global_batch=15360, recompute="full", cost_model="roofline", flash_attention=True,
                                     overlap_param_gather=True, ep_overlap=True, **DEEPSEEK_V3_PRACTICE),
                            tp=1, pp=16, zero_stage=1, ep=64, metric="tokens", published=tokens_per_gpu_s,
                            source="deepseekai2024v3")
    return [deepseek]


def published_runs() -> list[PublishedRun]:
    return megatron_runs() + llama_runs() + other_runs()


def causal_model_flops_per_token(model: ModelShape) -> float:
    """Model FLOPs per token with a causal mask: 6N for the weights, and half of PaLM's 12·L·h·s for
    attention's QKᵀ and AV (the masked half is neither needed nor, with flash attention, computed).
    Llama 3 counts PaLM's (its MFU cites Chowdhery et al.); the page shows its 128K row both ways."""
    return 6 * parameter_counts(model)["active"] + 6 * model.layers * model.hidden * model.seq


def predict(run: PublishedRun, micro_batches=(1, 2, 4, 8), chunks=(1, 2, 4), orders=(False, True),
            gemm_share: float = 1.0) -> dict:
    """The planner's fastest fitting choice of (b, v, order) for the run's published layout, and
    its prediction in the run's metric, beside the published figure. `gemm_share` scales the
    cluster's measured GEMM ceiling (1: as measured; `calibrated_gemm_share()`: fitted)."""
    if gemm_share != 1.0:  # the measured best of bf16 and of FP8 GEMMs alike
        run = dataclasses.replace(run, cluster=dataclasses.replace(
            run.cluster, gemm_ceiling=run.cluster.gemm_ceiling * gemm_share,
            fp8_gemm_ceiling=run.cluster.fp8_gemm_ceiling * gemm_share))
    dp = run.cluster.gpus // (run.tp * run.cp * run.pp)
    best = None
    for b in micro_batches:
        if run.training.global_batch % (dp * b):
            continue
        m = run.training.global_batch // (dp * b)
        if m < run.pp:
            continue
        for v in chunks:
            if v > 1 and (run.pp == 1 or m % run.pp or run.training.pipeline_schedule == "dualpipe"):
                continue  # Megatron: m a multiple of p; DualPipe does not interleave
            for pp_outermost, every in itertools.product(orders, (0, 1) if run.zero_stage >= 2 else (0,)):
                training = dataclasses.replace(run.training, micro_batch=b, chunks=v, pp_outermost=pp_outermost)
                layout = PlannedLayout(run.tp, run.pp, dp, run.ep, run.zero_stage, m, every, cp=run.cp)
                row = evaluate(run.model, run.cluster, training, layout)
                if row["fits"] and (best is None or row["step_time_s"] < best["step_time_s"]):
                    best = dict(row, micro_batch=b, chunks=v, pp_outermost=pp_outermost)
    if best is None:
        raise ValueError(f"{run.name}: no choice of micro-batch size fits")
    seconds = best["step_time_s"]
    gpus = run.cluster.gpus
    predicted = {"megatron_tflops": megatron_flops_per_step(run.model, run.training.global_batch) / (gpus * seconds) / 1e12,
                 "mfu": best["mfu"],
                 "model_tflops": memory.model_flops_per_token(parameter_counts(run.model)["active"], run.model.layers,
                                                              run.model.hidden, run.model.seq)
                 * run.training.global_batch * run.model.seq / (gpus * seconds) / 1e12,
                 "causal_tflops": causal_model_flops_per_token(run.model) * run.training.global_batch * run.model.seq
                 / (gpus * seconds) / 1e12,
                 "tokens": run.training.global_batch * run.model.seq / (gpus * seconds)}[run.metric]
    return {"run": run, "row": best, "predicted": predicted, "ratio": predicted / run.published,
            "tflops_per_gpu": best["mfu"] * run.cluster.peak_flops / 1e12,
            "parameters": parameter_counts(run.model)["total"]}


def _log_mean_ratio(share: float, runs) -> float:
    ratios = [predict(run, (result["row"]["micro_batch"],), (result["row"]["chunks"],),
                      (result["row"]["pp_outermost"],), gemm_share=share)["ratio"] for run, result in runs]
    return sum(math.log(ratio) for ratio in ratios) / len(ratios)


@functools.lru_cache(maxsize=1)
def calibrated_gemm_share() -> float:
    """The one calibrated constant: the share of the measured GEMM ceiling (cuBLAS's best, on the
    best shapes) that a training run's GEMMs reach, fitted so that the geometric mean of the
    predicted/published ratios over Megatron-LM 2021's Table 1 is 1 (the choices of b, v and order
    kept from the uncalibrated prediction; secant steps on the log of the mean ratio). Llama 3 and
    DeepSeek-V3 are not fitted: they test it."""
    runs = [(run, predict(run)) for run in megatron_runs()]
    a, b = 1.0, 0.8
    fa, fb = _log_mean_ratio(a, runs), _log_mean_ratio(b, runs)
    for _ in range(6):
        if abs(fb) < 1e-4 or fb == fa:
            break
        a, b, fa = b, b - fb * (b - a) / (fb - fa), fb
        fb = _log_mean_ratio(b, runs)
    return b
