"""What a collective costs beyond its bytes: a start-up latency per collective and per ring step,
and the slowdown of computation that runs beside communication.

Latency, from NCCL's own performance model (the one its tuner uses to pick an algorithm,
`src/graph/tuning.cc` in github.com/NVIDIA/nccl: `baseLatencies` and `hwLatencies`, "Simple"
protocol, which large messages use): a ring collective over n ranks on k nodes costs a base
latency plus one hardware latency per ring step, NVLink's for the steps inside a node and the
network's for those between nodes. An all-reduce takes 2(n - 1) steps, 2(k - 1) of them between
nodes; a reduce-scatter or an all-gather half that. A point-to-point message costs the base and
one step. So a ring's latency grows linearly with the nodes it spans: 2(k - 1) network steps for
an all-reduce over k nodes, which is why Megatron-Core's gradient buckets grow with the DP size
(`bucket_size = max(40000000, 1000000 * dp_size)` parameters, megatron/core/distributed).

Contention, ε: a communication kernel runs on SMs the computation then lacks (DeepSeek-V3,
section 3.2.2: 20 of the H800's 132 SMs run its all-to-alls), so computation that overlaps
communication runs at 1/(1 + ε) of its speed: ε = 20/112 with those figures.
`Cluster.contention` carries ε; `Cluster.alpha_s` and `Cluster.collective_base_s` the latencies.

Both are the overlap chapter's model (dtp.overlap.model): a collective costs α + bytes/bandwidth
(`collective_time`), and its functions take `alpha` and `contention` (ε) as arguments. This module
only says what α is for one collective on a cluster (NCCL's tuner), and the planner's step time
(dtp.topology.step) passes it and ε to those functions.
"""
from __future__ import annotations

import math

from dtp.overlap import model as overlap
from dtp.topology.mesh import INTER_NODE, INTRA_NODE

# NCCL's tuning constants (src/graph/tuning.cc, ncclTunerConstantsDefaults), microseconds, Ring, Simple protocol
NCCL_BASE_LATENCY_S = 8.4e-6
NCCL_STEP_LATENCY_S = {INTRA_NODE: 3.4e-6, INTER_NODE: 14.0e-6}  # hwLatencies NVLINK and NET
# DeepSeek-V3 (section 3.2.2): 20 of the H800's 132 SMs run the communication while the rest compute
DEFAULT_CONTENTION = overlap.GPU_CONTENTION
NCCL_ALPHA_S = tuple(NCCL_STEP_LATENCY_S.items())

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "send", "all_to_all")


def ring_steps(kind: str, ranks: int, nodes: int) -> tuple[int, int]:
    """(steps inside a node, steps between nodes) of a ring collective of `ranks` on `nodes`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if ranks <= 1:
        return 0, 0
    if kind in ("send", "all_to_all"):  # one step: point to point, or every peer at once
        return (0, 1) if nodes > 1 else (1, 0)
    factor = 2 if kind == "all_reduce" else 1
    between = factor * (nodes - 1)
    return factor * (ranks - 1) - between, between


def collective_latency_s(cluster, kind: str, ranks: int, nodes: int) -> float:
    """Start-up seconds of one collective: base + steps · α(link), as NCCL's tuner models a ring."""
    if ranks <= 1:
        return 0.0
    inside, between = ring_steps(kind, ranks, nodes)
    return cluster.collective_base_s + inside * cluster.alpha(INTRA_NODE) + between * cluster.alpha(INTER_NODE)


def nodes_of_group(size: int, stride: int, gpus_per_node: int) -> int:
    """Nodes a group of `size` ranks `stride` apart spans (nodes hold consecutive ranks)."""
    if size <= 1:
        return 1
    span = (size - 1) * stride + 1
    if stride >= gpus_per_node:
        return size
    return max(1, math.ceil(span / gpus_per_node))
