"""The practised planner's search: every layout a framework would run for a model on a cluster,
its memory per GPU and its step time (`dtp.topology.planner.evaluate` with the practised model),
fastest first.

What it searches (each choice as a framework accepts it, `dtp.topology.frameworks`):
- TP t: divides a node's GPUs, the heads, the K/V heads (Megatron splits the K/V groups over TP)
  and the sequence; CP c up to `training.max_context_parallel` (dense models), dividing the
  sequence into 2c chunks; PP p with the layers split evenly (p divides L) or balanced (the
  embedding and the output layer counted as layers: any p); DP = GPUs / (t·c·p);
- EP e dividing DP and the experts, the experts tensor-parallel or whole (MoE);
- the micro-batch size b (`training.micro_batch_choices`, else 1, 2, 4, 8) with m = B/(DP·b) whole;
  the interleaving v among the framework's (every v dividing each stage's layers, m a multiple of
  p; `training.chunk_choices` narrows them); recomputation none, selective (without flash
  attention, which keeps no scores anyway) or full; the ZeRO stages the framework runs with PP,
  stages 2 and 3 reducing every micro-batch or once.

It stays fast by computing memory before time, and by timing a ZeRO choice only at the least
recomputation with which it fits: more recomputation adds work and saves nothing else.
"""
from __future__ import annotations

import dataclasses
import math

from dtp.topology import frameworks, stages
from dtp.topology.planner import evaluate
from dtp.topology.shapes import LAYOUT_FIELDS, SEARCHED_FIELDS, PlannedLayout
from dtp.topology.stage_memory import peak_stage_memory

MICRO_BATCHES = (1, 2, 4, 8)
MAX_CHUNKS = 8
SPLITS = ("even", "balanced")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_sizes(model, cluster) -> list[int]:
    return [t for t in divisors(cluster.gpus_per_node)
            if model.heads % t == 0 and (model.kv_heads or model.heads) % t == 0 and model.seq % t == 0]


def pipeline_splits(model, pp: int, training, splits=SPLITS) -> list[tuple[tuple[int, ...], bool]]:
    """(layers per stage, balanced) for each way `splits` allows of putting the layers on p stages."""
    found = []
    for split in splits:
        balanced = split == "balanced"
        if (pp == 1 and balanced) or not stages.can_split(model.layers, pp, balanced):
            continue
        layers = stages.split_layers(model.layers, pp, balanced)
        if all(layers != known for known, _ in found):
            found.append((layers, balanced))
    return found


def configurations(model, cluster, training, splits=SPLITS):
    """(tp, cp, pp, stage layers, balanced, dp, b, m, v) of every pipeline the framework runs."""
    sizes = training.micro_batch_choices or MICRO_BATCHES
    for tp in tensor_parallel_sizes(model, cluster):
        for pp in range(1, model.layers + 1):
            if cluster.gpus % (tp * pp):
                continue
            for cp in divisors(min(cluster.gpus // (tp * pp), training.max_context_parallel)):
                if (cluster.gpus // (tp * pp)) % cp or (cp > 1 and (model.is_moe or model.seq % (2 * cp * tp))):
                    continue
                dp = cluster.gpus // (tp * cp * pp)
                for layers, balanced in pipeline_splits(model, pp, training, splits):
                    practised = dataclasses.replace(training, balanced_stages=balanced)
                    chunks = [v for v in frameworks.chunk_choices(practised, layers)
                              if v <= MAX_CHUNKS and (not training.chunk_choices or v in training.chunk_choices)]
                    for b in sizes:
                        if training.global_batch % (dp * b):
                            continue
                        m = training.global_batch // (dp * b)
                        for v in chunks:
                            if frameworks.accepts(practised, layers, m, v):
                                yield tp, cp, pp, layers, balanced, dp, b, m, v


def sharding_choices(model, training, tp, pp, dp):
    """(ep, expert_tp, ZeRO stage, reduce every micro-batch) for one pipeline."""
    eps = divisors(math.gcd(dp, model.experts)) if model.is_moe else [1]
    for ep in eps:
        expert_tps = [tp] + ([1] if model.is_moe and tp > 1 and model.experts % (tp * ep) == 0 else [])
        for expert_tp in expert_tps:
            for stage in frameworks.zero_stages(training, pp):
                for every in ((0, 1) if stage >= 2 else (0,)):
                    yield ep, expert_tp, stage, every


def recomputations(training) -> tuple[str, ...]:
    """Least work first; with flash attention "selective" keeps and saves what "none" does."""
    return ("none", "full") if training.flash_attention else ("none", "selective", "full")


def plan(model, cluster, training, progress=None, splits=SPLITS) -> dict:
    """{"rows": every fitting layout's row, fastest first (each with its "recompute" and "stage_layers"; rows
    differing only in a choice that changes nothing, such as the ZeRO stage where memory is ample, tie),
    "most_frugal": (bytes, layout) of the layout needing the least memory, fitting or not, "searched":
    how many pipelines were considered}. `progress(done, total)` is called as the search goes."""
    training = dataclasses.replace(training, cost_model="roofline")
    pipelines = list(configurations(model, cluster, training, splits))
    rows, frugal = [], (math.inf, None)
    for done, (tp, cp, pp, layers, balanced, dp, b, m, v) in enumerate(pipelines, 1):
        base = dataclasses.replace(training, balanced_stages=balanced, micro_batch=b, chunks=v)
        pending = list(sharding_choices(model, training, tp, pp, dp))
        for recompute in recomputations(training):
            practised = dataclasses.replace(base, recompute=recompute)
            still = []
            for ep, expert_tp, stage, every in pending:
                layout = PlannedLayout(tp, pp, dp, ep, stage, m, every, expert_tp, cp=cp, micro_batch=b, chunks=v,
                                       stage_layers=layers)
                _, breakdown = peak_stage_memory(model, practised, layout, layers)
                needed = sum(breakdown.values())
                if needed < frugal[0]:
                    frugal = (needed, dict(layout=layout, recompute=recompute))
                if needed > cluster.memory_bytes:
                    still.append((ep, expert_tp, stage, every))
                    continue
                rows.append(dict(evaluate(model, cluster, practised, layout), recompute=recompute,
                                 balanced_stages=balanced))
            pending = still
            if not pending:
                break
        if progress:
            progress(done, len(pipelines))
    rows.sort(key=lambda row: (row["step_time_s"], *[row[field] for field in LAYOUT_FIELDS + SEARCHED_FIELDS]))
    return {"rows": rows, "most_frugal": frugal, "searched": len(pipelines)}


def stage_split_name(row) -> str:
    """Layers per stage in a few characters: "8 x 12", or the ends and the largest ("5, 6 ..., 5")."""
    layers = row["stage_layers"]
    if len(set(layers)) == 1:
        return f"{len(layers)} x {layers[0]}"
    return "+".join(map(str, layers)) if len(layers) <= 4 else f"{layers[0]}, {max(layers)} ..., {layers[-1]}"
