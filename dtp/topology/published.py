"""Published training runs, as their papers, launch scripts and logs give them: model, hardware,
layout, framework and throughput. The figures are data, typed in with their source (a
references.bib key) and how they were read: "paper" (the paper's own table or text, or the
authors' README), "code" (the authors' launch script, configuration or training log), "copy" (a
transcription of the paper's table, not the PDF itself). What a source leaves unsaid (a
micro-batch size, the interleaving, recomputation) is 0 or empty here, and the validation searches
it. Derived figures (DP = GPUs / (TP·CP·PP)) are computed, never typed.

Megatron-LM 2021's Table 1 is the one table the calibrated constant is fitted on (`fitted`); every
other row is held out.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtp.topology import clusters, frameworks
from dtp.topology.shapes import Cluster, ModelShape, Training


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: ModelShape
    cluster: Cluster
    training: Training  # the framework's switches, and what the source says of recomputation and batch
    tp: int
    pp: int
    # "megatron_tflops" (Narayanan et al. 2021's eq. 3), "megatron_core_tflops" (what Megatron-LM logs),
    # "model_tflops" (PaLM's 6N + 12Lhs), "seconds" (per iteration), "tokens" (per second per GPU)
    metric: str
    published: float
    source: str  # a references.bib key
    read_from: str  # "paper", "code" or "copy" (module docstring)
    framework: str
    zero_stages: tuple = (0,)  # the stages the run may have used (searched when more than one)
    ep: int = 1
    cp: int = 1
    micro_batch: int = 0  # 0: not published
    chunks: int = 0  # interleaving's v; 0: not published
    recompute: str = ""  # "": not published
    stage_layers: tuple = ()
    fitted: bool = False
    note: str = ""

    @property
    def dp(self) -> int:
        return self.cluster.gpus // (self.tp * self.cp * self.pp)


def _run(name, model, cluster, framework, global_batch, **fields) -> PublishedRun:
    training_fields = {key: fields.pop(key) for key in list(fields)
                       if key in Training.__dataclass_fields__ and key not in PublishedRun.__dataclass_fields__}
    training = frameworks.practised(Training(global_batch=global_batch), framework, **training_fields)
    return PublishedRun(name, model, cluster, training, framework=framework, **fields)


def gpt(layers, hidden, heads, vocab=51200, seq=2048, name="", **shape) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, name=name, **shape)


def llama(layers, hidden, heads, ffn, seq, kv_heads=8, vocab=128256, name="") -> ModelShape:
    """A Llama 3 shape (Dubey et al. 2024, Table 3): grouped-query attention with 8 K/V heads,
    SwiGLU, a vocabulary of 128K (128,256 in the released tokenizer)."""
    return ModelShape(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, kv_heads=kv_heads,
                      block="llama", ffn_hidden=ffn, name=name)


def selene(gpus: int) -> Cluster:
    """DGX A100 80GB nodes (Selene: NVLink 3, 8 HDR InfiniBand ports of 200 Gb/s per node)."""
    return clusters.cluster("a100-80gb", gpus, name=f"{gpus} A100 (Selene)")


# --- Megatron-LM 2021 (Narayanan et al. 2021): Table 1, the fitted table, and Table 2 ------------------

# (billions, heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU), Table 1 (three transcriptions agree; the
# table Megatron-LM's README showed from 2021 to 2024 agrees on every row); micro-batch, layers per virtual stage
# and DDP from the authors' script (examples/sc21/run_table_1.sh): torch's DDP up to 18.4B, Megatron's "local" above
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 0), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 0),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 0), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 0),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 0), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 0),
]


def megatron_table_1() -> list[PublishedRun]:
    runs = []
    for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops, micro_batch, per_chunk in MEGATRON_TABLE_1:
        chunks = layers // pp // per_chunk if per_chunk else 1
        runs.append(_run(f"GPT {billions:g}B", gpt(layers, hidden, heads, name=f"GPT {billions:g}B"), selene(gpus),
                         "megatron-2021", batch, tp=tp, pp=pp, metric="megatron_tflops", published=tflops,
                         source="narayanan2021efficient", read_from="copy", micro_batch=micro_batch, chunks=chunks,
                         recompute="full", dp_overlap=billions < 20, fitted=True))
    return runs


def megatron_table_2() -> list[PublishedRun]:
    """Table 2's PTD-P rows: GPT-3 175B (TP 8 x PP 12: model parallel 96) and 530B (TP 8 x PP 35), micro-batch 1;
    the interleaving is not stated."""
    rows = [(96, 12288, 96, 12, 1536, 384, 153), (96, 12288, 96, 12, 1536, 768, 149),
            (96, 12288, 96, 12, 1536, 1536, 141), (105, 20480, 128, 35, 2240, 560, 171),
            (105, 20480, 128, 35, 2240, 1120, 167), (105, 20480, 128, 35, 2240, 2240, 159)]
    return [_run(f"GPT {'175' if layers == 96 else '530'}B (Table 2), {gpus:,} GPUs", gpt(layers, hidden, heads),
                 selene(gpus), "megatron-2021", batch, tp=8, pp=pp, metric="megatron_tflops", published=tflops,
                 source="narayanan2021efficient", read_from="copy", micro_batch=1, recompute="full")
            for layers, hidden, heads, pp, batch, gpus, tflops in rows]


# --- Megatron-DeepSpeed: MT-NLG 530B and BLOOM-176B ----------------------------------------------------

def mt_nlg() -> list[PublishedRun]:
    """Smith et al. 2022, section 2.4: 530B (105 layers, h 20480, 128 heads), TP 8 x PP 35 with DeepSpeed's
    pipeline, batch 1920 of 2048 tokens, bf16, activation checkpointing; seconds per iteration at 280, 350
    and 420 DGX A100 nodes. GPT-2's 50,257 tokens padded as Megatron pads (to a multiple of 128·t): 51,200.
    Micro-batch size and ZeRO stage not stated."""
    return [_run(f"MT-NLG 530B, {gpus:,} GPUs", gpt(105, 20480, 128, name="MT-NLG 530B"), selene(gpus),
                 "deepspeed", 1920, tp=8, pp=35, metric="seconds", published=seconds, source="smith2022mtnlg",
                 read_from="copy", zero_stages=(0, 1), recompute="full")
            for gpus, seconds in ((2240, 60.1), (2800, 50.2), (3360, 44.4))]


BLOOM_176B = gpt(70, 14336, 112, vocab=250880, name="BLOOM-176B", tied_embeddings=True)


def bloom() -> list[PublishedRun]:
    """BigScience's tr11-176B-ml (its README and slurm script): 70 layers, h 14336, 112 heads, 250,880 tokens
    (padded), tied embeddings; TP 4 x PP 12 x DP 8 on 384 A100 80GB (48 nodes of 8, four 100 Gb/s Omni-Path
    links per node: 50 Gb/s per GPU); micro-batch 2, batch 2048; full recomputation; bf16 with its BF16
    optimizer (ZeRO-1 in effect); the pipeline split `type:transformer|embedding` (the two embeddings count
    as layers: 5 + 10 x 6 + 5). Its log at iteration 85,376: 104.70 s per iteration."""
    cluster = clusters.cluster("a100-80gb", 384, network_gbit=50, name="384 A100 80GB (Jean Zay)")
    return [_run("BLOOM-176B", BLOOM_176B, cluster, "deepspeed", 2048, tp=4, pp=12, metric="seconds",
                 published=104.70, source="bigscience2022tr11", read_from="code", zero_stages=(1,), micro_batch=2,
                 chunks=1, recompute="full", balanced_stages=True)]


# --- MegaScale's Megatron-LM baseline (Jiang et al. 2024, Table 2) -----------------------------------

def megascale_megatron() -> list[PublishedRun]:
    """The Megatron-LM baseline (commit 285068c8) of MegaScale's strong-scaling table: a 175B of 96 layers,
    h 12288, 128 heads, vocabulary 64,000, 2048 tokens; TP 8 x PP 8, interleaved with v = 6; sequence
    parallelism; batch 768 up to 1,024 GPUs, 6144 from 3,072; 8 x 200 Gb/s RoCE per node. TP, PP and DP
    overlap and flash attention are MegaScale's additions (its Table 3), so the baseline has none; its
    distributed optimizer keeps the full gradient buffer (ZeRO-1 here). Micro-batch size not stated."""
    model = gpt(96, 12288, 128, vocab=64000, name="GPT 175B (MegaScale)")
    rows = [(768, 256, 40.0), (768, 512, 21.2), (768, 768, 15.2), (768, 1024, 11.9), (6144, 3072, 29.02),
            (6144, 6144, 14.78), (6144, 8192, 12.24), (6144, 12288, 8.57)]
    return [_run(f"MegaScale's Megatron-LM, {gpus:,} GPUs", model, clusters.cluster("a100-80gb", gpus),
                 "megatron-2021", batch, tp=8, pp=8, metric="seconds", published=seconds, source="jiang2024megascale",
                 read_from="paper", zero_stages=(1,), chunks=6, sequence_parallel=True)
            for batch, gpus, seconds in rows]


# --- Llama 3 405B (Llama Team 2024, Table 4) ---------------------------------------------------------

LLAMA3_405B = llama(126, 16384, 128, 53248, 8192, name="Llama 3 405B")
LLAMA3_PRACTICE = dict(cp_method="allgather", balanced_stages=True, pp_outermost=False)


def llama3() -> list[PublishedRun]:
    """Table 4: TP 8, PP 16, 16M tokens per batch; 8,192 GPUs (DP 64) at 430 TFLOP/s per GPU, 16,384 (DP
    128) at 400, and 16,384 with CP 16 (DP 8, 131,072-token sequences) at 380, "BF16 Model FLOPs
    Utilization (MFU; Chowdhery et al.)" times the peak. Section 3.3.2: ranks ordered TP, CP, PP, DP; FSDP
    sharding optimizer states and gradients, not weights (ZeRO-2); one layer fewer on the first and last
    stages; CP's K and V all-gathered before attention, exposed; no activation recomputation for the 8K
    rows. RoCE at 400 Gb/s per GPU."""
    rows = [(8192, 1, 8192, 430), (16384, 1, 8192, 400), (16384, 16, 131072, 380)]
    runs = []
    for gpus, cp, seq, tflops in rows:
        name = f"Llama 3 405B, {gpus:,} GPUs" + (f", CP {cp}, {seq // 1024}K tokens" if cp > 1 else "")
        runs.append(_run(name, dataclasses.replace(LLAMA3_405B, seq=seq), clusters.cluster("h100", gpus),
                         "megatron-core", 16 * 2**20 // seq, tp=8, pp=16, cp=cp, metric="model_tflops",
                         published=tflops, source="dubey2024llama3", read_from="copy", zero_stages=(2,),
                         recompute="none" if cp == 1 else "", **LLAMA3_PRACTICE))
    return runs


# --- NVIDIA's DGX Cloud benchmark recipes (NeMo, H100) ------------------------------------------------

def dgxc() -> list[PublishedRun]:
    """NVIDIA/dgxc-benchmarking's READMEs: step times of short benchmark runs on H100 (NeMo 24.09 and
    24.11, bf16, Megatron-Core with its overlaps), each with its full layout: GPT-3 175B (TP 4, PP 8,
    VP 12, micro-batch 1, 2048 tokens, batch 2 per GPU), Llama 3.1 405B (TP 8, PP 9, CP 2, VP 7,
    micro-batch 1, 8192 tokens, batch 252 per 576 GPUs) and Llama 3.1 70B (TP 4, PP 4, CP 2, VP 5,
    micro-batch 1, 8192 tokens, batch 2 per GPU). The cluster's network is not stated: DGX H100's."""
    runs = []
    model = gpt(96, 12288, 96, name="GPT-3 175B")
    for gpus, seconds in ((128, 8.91), (256, 8.95), (512, 9.09), (1024, 9.01), (2048, 9.02)):
        runs.append(_run(f"GPT-3 175B (NeMo), {gpus:,} GPUs", model, clusters.cluster("h100", gpus), "megatron-core",
                         2 * gpus, tp=4, pp=8, metric="seconds", published=seconds, source="dgxcbenchmarking2025",
                         read_from="code", zero_stages=(1,), micro_batch=1, chunks=12))
    for gpus, seconds in ((576, 17.20), (1152, 17.52), (2304, 17.62)):
        runs.append(_run(f"Llama 3.1 405B (NeMo), {gpus:,} GPUs", LLAMA3_405B, clusters.cluster("h100", gpus),
                         "megatron-core", 252 * gpus // 576, tp=8, pp=9, cp=2, metric="seconds", published=seconds,
                         source="dgxcbenchmarking2025", read_from="code", zero_stages=(1,), micro_batch=1, chunks=7))
    model = llama(80, 8192, 64, 28672, 8192, name="Llama 3.1 70B")
    for gpus, seconds in ((64, 14.72), (128, 14.73), (256, 14.8), (512, 14.89), (1024, 14.92), (2048, 14.98)):
        runs.append(_run(f"Llama 3.1 70B (NeMo), {gpus:,} GPUs", model, clusters.cluster("h100", gpus),
                         "megatron-core", 2 * gpus, tp=4, pp=4, cp=2, metric="seconds", published=seconds,
                         source="dgxcbenchmarking2025", read_from="code", zero_stages=(1,), micro_batch=1, chunks=5))
    return runs


def megatron_core() -> list[PublishedRun]:
    """Megatron-LM's README (Megatron-Core r0.8.0, "Performance Benchmarking"): weak scaling of GPT models
    on H100 with a vocabulary of 131,072 and 4096 tokens, DP 48, `--overlap-grad-reduce
    --overlap-param-gather --tp-comm-overlap`; MFU against 989 TFLOP/s. Its TFLOP/s are what
    Megatron-LM logs (`validation.megatron_core_flops_per_step`): the table's model sizes count the
    input embedding (1.7B at h = 2048), its FLOPs do not. Micro-batch size, interleaving and
    recomputation are not stated."""
    rows = [(16, 2048, 24, 1, 1, 48, 192, 408.8), (32, 4096, 30, 2, 1, 96, 192, 465.9),
            (48, 6144, 32, 4, 1, 192, 192, 489.1), (56, 7168, 48, 8, 1, 384, 192, 459.6),
            (64, 8192, 84, 8, 2, 768, 384, 419.7), (80, 10240, 92, 8, 4, 1536, 768, 420.5),
            (96, 12288, 96, 8, 6, 2304, 1152, 432.8), (128, 16384, 96, 8, 8, 3072, 1536, 474.4),
            (144, 18432, 112, 8, 16, 6144, 3072, 459.9)]
    return [_run(f"Megatron-Core GPT h={hidden:,}, {gpus:,} GPUs", gpt(layers, hidden, heads, vocab=131072, seq=4096),
                 clusters.cluster("h100", gpus), "megatron-core", batch, tp=tp, pp=pp, metric="megatron_core_tflops",
                 published=tflops, source="megatroncore2024readme", read_from="paper", zero_stages=(1,))
            for heads, hidden, layers, tp, pp, gpus, batch, tflops in rows]


# --- DeepSeek-V3 (DeepSeek-AI 2024) --------------------------------------------------------------------

# Sections 3.1-3.3 and 4.2: 2048 H800s (NVLink 400 GB/s both ways, one 400 Gb/s InfiniBand port per GPU), PP 16
# (DualPipe), EP 64 over 8 nodes, ZeRO-1 DP, no TP; 180K H800 GPU hours per trillion tokens; 4096-token sequences,
# batch 15,360. Each token's 8 routed experts (of 256) lie on at most M = 4 nodes; the shared expert runs on the
# token's own GPU; a token crosses InfiniBand once per chosen node and is forwarded over NVLink there, IB and
# NVLink "fully overlapped", by kernels on 20 of the H800's 132 SMs (3.2.2, 3.5.1); the linear layers' GEMMs in
# FP8, attention, embedding and output head in bf16 (3.3.1); dispatch in FP8, combine in bf16 (3.3.3). Modelled:
# 61 GPT-attention layers of h = 7168 (MLA not modelled), 256 routed experts top-8 plus the shared expert as a ninth
# active one, each expert an MLP of width 3072 (SwiGLU's three 7168 x 2048 matrices hold as many parameters); one
# multi-token-prediction module (section 2.2, depth 1) on the last stage with the output head.
DEEPSEEK_V3 = ModelShape(layers=61, hidden=7168, heads=128, vocab=129280, seq=4096, experts=256, top_k=9,
                         expert_hidden=3072, shared_experts=1, max_nodes=4, mtp_modules=1,
                         name="DeepSeek-V3 (approximated)")
H800_SMS, DEEPSEEK_V3_COMMUNICATION_SMS = 132, 20
# The best FP8 GEMM with DeepSeek-V3's fine-grained (1x128, 128x128) scaling in DeepGEMM's first release, measured
# on an H800 over the shapes DeepSeek-V3 uses: 1358 TFLOP/s (its README of 2025-02-25).
DEEPGEMM_BEST_FP8_FLOPS = 1358e12
DEEPSEEK_V3_PRACTICE = dict(ep_dispatch="node_limited", fp8_dispatch=True, fp8_gemms=True,
                            comm_sm_share=DEEPSEEK_V3_COMMUNICATION_SMS / H800_SMS, pipeline_schedule="dualpipe",
                            overlap_param_gather=True, ep_overlap=True, balanced_stages=True, pp_outermost=False)


def deepseek_v3() -> list[PublishedRun]:
    """The communication kernels' 20 SMs are taken from the GEMMs all step long (`comm_sm_share`), so the
    cluster's contention is not charged on top."""
    h800 = clusters.cluster("h800", 2048, fp8_peak_flops=clusters.H100_FP8_DENSE_FLOPS,
                            fp8_gemm_ceiling=DEEPGEMM_BEST_FP8_FLOPS / clusters.H100_FP8_DENSE_FLOPS, contention=0.0)
    return [_run("DeepSeek-V3 (MoE)", DEEPSEEK_V3, h800, "megatron-core", 15360, tp=1, pp=16, ep=64,
                 metric="tokens", published=1e12 / (180e3 * 3600), source="deepseekai2024v3", read_from="copy",
                 zero_stages=(1,), chunks=1, **DEEPSEEK_V3_PRACTICE)]


def published_runs() -> list[PublishedRun]:
    """Every run, the fitted table first."""
    return (megatron_table_1() + megatron_table_2() + mt_nlg() + bloom() + megascale_megatron() + llama3()
            + dgxc() + megatron_core() + deepseek_v3())
