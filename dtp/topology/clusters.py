"""GPUs and clusters the planner knows by name: each GPU's datasheet figures, the measured shares of
them that the practised model uses (each with its source, shown on the planner's pages), and
`cluster()`, which builds a `Cluster` of any number of them with any links.

Datasheets: A100 SXM (NVLink 3 "600GB/s" both directions, 300 GB/s leave a GPU; 312 TFLOP/s dense
bf16, 624 with 2:4 sparsity; HBM2e 1,555 GB/s on the 40GB, 2,039 GB/s on the 80GB), H100 SXM
(NVLink 4 900 GB/s both directions; 989.4 TFLOP/s dense bf16, 1,979 FP8; HBM3 3.35 TB/s), H800
(an H100 with NVLink at 400 GB/s both directions), H200 (an H100 with 141 GB of HBM3e at 4.8 TB/s).
DGX A100 and DGX H100: one InfiniBand port per GPU, HDR 200 Gb/s and NDR 400 Gb/s.

Measured shares, for the practised model:
- cuBLAS bf16 matmul, the best of a scan over large shapes (Bekman's "maximum achievable matmul
  FLOPS", ml-engineering): 267.9 of 312 TFLOP/s on an A100 SXM, 792.1 of 989 on an H100 SXM;
- NCCL over NVLink: "with the protocol overhead (~20%) NCCL can get an effective NVLink bandwidth
  of 370GB/s" of NVLink 4's 450 (S. Jeaugey, NVIDIA, nccl-tests issue 212);
- NCCL over InfiniBand: "24GB/s is the peak performance per 200G NIC" (nccl-tests issue 119),
  "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per NIC" (nccl-tests issue 267);
- FlashAttention-2: "50-73% of the theoretical maximum FLOPs/s on A100" (Dao 2023), "only 35%
  utilization on the H100 GPU" (Shah et al. 2024, FlashAttention-3's abstract);
- NCCL's latencies and the contention of overlapped work: dtp.topology.collectives.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtp.memory import formulas as memory
from dtp.topology import collectives
from dtp.topology.shapes import Cluster
from dtp.tp import tensor_parallel

NVLINK3_PER_DIRECTION_BYTES_PER_S = 600e9 / 2
INFINIBAND_HDR_GBIT_PER_S = 200
A100_BF16_DENSE_FLOPS = 312e12
A100_80GB_HBM_BYTES_PER_S = 2039e9
A100_40GB_HBM_BYTES_PER_S = 1555e9
H100_SXM_HBM_BYTES_PER_S = 3.35e12
H200_HBM_BYTES_PER_S = 4.8e12
H800_NVLINK_PER_DIRECTION = 400e9 / 2
H100_FP8_DENSE_FLOPS = 2 * tensor_parallel.H100_BF16_DENSE_FLOPS
A100_MAMF_FLOPS, H100_MAMF_FLOPS = 267.9e12, 792.1e12
A100_FLASH_ATTENTION_SHARE, H100_FLASH_ATTENTION_SHARE = 0.50, 0.35
NVLINK_NCCL_EFFICIENCY = 370 / 450
HDR_NCCL_EFFICIENCY, NDR_NCCL_EFFICIENCY = 24 / 25, 48 / 50


@dataclass(frozen=True)
class GPU:
    name: str
    memory_mib: int
    peak_flops: float
    hbm_bytes_per_s: float
    nvlink_per_direction: float
    network_gbit: float  # the DGX-class node's network port per GPU
    gemm_ceiling: float
    attention_ceiling: float
    network_efficiency: float


A100 = dict(peak_flops=A100_BF16_DENSE_FLOPS, nvlink_per_direction=NVLINK3_PER_DIRECTION_BYTES_PER_S,
            network_gbit=INFINIBAND_HDR_GBIT_PER_S, gemm_ceiling=A100_MAMF_FLOPS / A100_BF16_DENSE_FLOPS,
            attention_ceiling=A100_FLASH_ATTENTION_SHARE, network_efficiency=HDR_NCCL_EFFICIENCY)
H100 = dict(peak_flops=tensor_parallel.H100_BF16_DENSE_FLOPS,
            nvlink_per_direction=tensor_parallel.NVLINK4_PER_DIRECTION_BYTES_PER_S,
            network_gbit=tensor_parallel.INFINIBAND_NDR_GBIT_PER_S,
            gemm_ceiling=H100_MAMF_FLOPS / tensor_parallel.H100_BF16_DENSE_FLOPS,
            attention_ceiling=H100_FLASH_ATTENTION_SHARE, network_efficiency=NDR_NCCL_EFFICIENCY)
GPUS = {
    "a100-40gb": GPU("A100 40GB", 40960, hbm_bytes_per_s=A100_40GB_HBM_BYTES_PER_S, **A100),
    "a100-80gb": GPU("A100 80GB", memory.GPU_MEMORY_MIB["A100 80GB"], hbm_bytes_per_s=A100_80GB_HBM_BYTES_PER_S,
                     **A100),
    "h100": GPU("H100 80GB", memory.GPU_MEMORY_MIB["H100 80GB"], hbm_bytes_per_s=H100_SXM_HBM_BYTES_PER_S, **H100),
    "h800": GPU("H800", memory.GPU_MEMORY_MIB["H100 80GB"], hbm_bytes_per_s=H100_SXM_HBM_BYTES_PER_S,
                **{**H100, "nvlink_per_direction": H800_NVLINK_PER_DIRECTION}),
    "h200": GPU("H200", memory.GPU_MEMORY_MIB["H200"], hbm_bytes_per_s=H200_HBM_BYTES_PER_S, **H100),
}


def cluster(gpu: str, gpus: int, gpus_per_node: int = 8, network_gbit: float | None = None,
            nvlink_per_direction: float | None = None, name: str = "", **changes) -> Cluster:
    """`gpus` GPUs of type `gpu` (a key of GPUS) in nodes of `gpus_per_node`, with the GPU's own
    NVLink and a DGX-class network port per GPU unless `network_gbit` (Gb/s per GPU and direction)
    or `nvlink_per_direction` (bytes/s) say otherwise; NCCL's latencies and the default
    contention. `changes` replace any other field."""
    if gpu not in GPUS:
        raise ValueError(f"unknown GPU {gpu!r}: one of {', '.join(GPUS)}")
    if gpus < 1 or gpus_per_node < 1 or gpus % gpus_per_node:
        raise ValueError(f"{gpus} GPUs do not make whole nodes of {gpus_per_node}")
    spec = GPUS[gpu]
    nodes = gpus // gpus_per_node
    found = Cluster(nodes=nodes, gpus_per_node=gpus_per_node, memory_bytes=spec.memory_mib * 2**20,
                    intra_node_bytes_per_s=nvlink_per_direction or spec.nvlink_per_direction,
                    inter_node_bytes_per_s=tensor_parallel.gigabits_to_bytes_per_s(network_gbit or spec.network_gbit),
                    peak_flops=spec.peak_flops, name=name or f"{nodes} nodes of {gpus_per_node} {spec.name}",
                    hbm_bytes_per_s=spec.hbm_bytes_per_s, gemm_ceiling=spec.gemm_ceiling,
                    attention_ceiling=spec.attention_ceiling, intra_node_efficiency=NVLINK_NCCL_EFFICIENCY,
                    inter_node_efficiency=spec.network_efficiency, alpha_s=collectives.NCCL_ALPHA_S,
                    collective_base_s=collectives.NCCL_BASE_LATENCY_S, contention=collectives.DEFAULT_CONTENTION)
    return dataclasses.replace(found, **changes) if changes else found


A100_CLUSTER = cluster("a100-80gb", 1024, name="128 nodes of 8 A100 80GB")
H100_CLUSTER = cluster("h100", 1024, name="128 nodes of 8 H100 80GB")
