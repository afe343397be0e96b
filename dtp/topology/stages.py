"""Pipeline stages as practised: how many layers each stage holds, which stage holds the
embedding and the output layer, which interleaving a split allows, how many micro-batches each
stage keeps in flight, and how long a step takes when the stages are not equal.

- Equal stages (Megatron-LM's rule: the layers must divide evenly over the stages): L/p layers
  each, the embedding on the first stage and the output layer on the last, on top.
- Balanced stages (Llama 3, section 3.3.2: "one fewer layer on the first and the last stages";
  BLOOM's `--pp-partition-method 'type:transformer|embedding'`, Megatron-Core's
  `--account-for-embedding-in-pipeline-split` and `--account-for-loss-in-pipeline-split`): the
  embedding and the output layer count as one layer each, and the L + 2 units are split as evenly
  as they go, the extra units on interior stages.
- Given: any layers per stage, first to last (a framework's own partition).

The step of a pipeline whose stages take different times is set by its costliest stage: in the
steady state every stage waits for it, so m micro-batches take m times its time, and the fill and
drain add each other stage's time once (divided by v with v interleaved chunks per stage):
T = m·max(τ) + (Σ τ - max(τ))/v (for equal stages, Narayanan et al. 2021's (m + (p-1)/v)·τ).
tests/topology/test_topology_stages.py checks it against the course's schedule simulator.
"""
from __future__ import annotations


def split_layers(layers: int, stages: int, balanced: bool) -> tuple[int, ...]:
    """Layers per stage, first to last. Equal stages need p to divide L (ValueError otherwise);
    balanced stages count the embedding and the output layer as one layer each."""
    if stages < 1 or stages > layers:
        raise ValueError(f"a pipeline of {stages} stages cannot hold {layers} layers")
    if stages == 1:
        return (layers,)
    if not balanced:
        if layers % stages:
            raise ValueError(f"{layers} layers do not split evenly over {stages} stages")
        return (layers // stages,) * stages
    units, extra = divmod(layers + 2, stages)
    per_stage = [units] * stages
    # the extra units go to interior stages first, outward from the middle
    interior = sorted(range(1, stages - 1), key=lambda i: abs(i - (stages - 1) / 2)) + [0, stages - 1]
    for index in interior[:extra]:
        per_stage[index] += 1
    per_stage[0] -= 1
    per_stage[-1] -= 1
    if min(per_stage) < 1:
        raise ValueError(f"{stages} stages leave a stage without a layer ({layers} layers, embedding and output "
                         "counted as one each)")
    return tuple(per_stage)


def can_split(layers: int, stages: int, balanced: bool) -> bool:
    try:
        split_layers(layers, stages, balanced)
    except ValueError:
        return False
    return True


def stage_units(stage_layers: tuple[int, ...], balanced: bool) -> tuple[int, ...]:
    """What each stage holds, counting the embedding and the output layer as units when they
    were split as layers (balanced)."""
    if not balanced or len(stage_layers) == 1:
        return tuple(stage_layers)
    return tuple(n + (index == 0) + (index == len(stage_layers) - 1) for index, n in enumerate(stage_layers))


def interleaving_allowed(stage_layers: tuple[int, ...], chunks: int, micro_batches: int, balanced: bool) -> bool:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): every stage's units are
    split into v chunks of equal size (v divides them), and the micro-batches come in groups of
    p (m a multiple of p). v = 1 is always allowed."""
    if chunks == 1:
        return True
    p = len(stage_layers)
    return p > 1 and micro_batches % p == 0 and all(units % chunks == 0 for units in stage_units(stage_layers, balanced))


def in_flight_layers(stage_layers: tuple[int, ...], stage: int, micro_batches: int, chunks: int) -> float:
    """Layer activations a stage keeps at its peak, in units of one layer's for one micro-batch:
    1F1B keeps min(m, p - i) micro-batches on stage i (Narayanan et al. 2021); the interleaved
    schedule runs (p - i - 1)·2 + (v - 1)·p warm-up chunks before its first backward (Megatron's
    `get_forward_backward_func` schedule), so it keeps one more than that, each chunk L_i/v layers."""
    p, layers = len(stage_layers), stage_layers[stage]
    if chunks == 1:
        return layers * min(micro_batches, p - stage)
    held = min(micro_batches * chunks, 2 * (p - stage - 1) + (chunks - 1) * p + 1)
    return layers / chunks * held


def pipeline_seconds(stage_seconds: list[float], micro_batches: int, chunks: int = 1) -> dict[str, float]:
    """{"steady": m·max(τ), "fill_drain": (Σ τ - max(τ))/v} for stages of per-micro-batch times τ."""
    slowest = max(stage_seconds)
    return {"steady": micro_batches * slowest, "fill_drain": (sum(stage_seconds) - slowest) / chunks}
