"""Memory and parameters of each pipeline stage as practised: the embedding on the first stage,
the output layer (and its fp32 logits) on the last, each stage's own layers, and the micro-batches
each stage keeps in flight under its schedule. The practised planner (`cost_model="roofline"`)
uses it; the exercise's model keeps the memory chapter's calculator (`dtp.memory.calculator`:
all parameters split evenly over the stages, p micro-batches on the first).

Built from the same closed forms as the calculator: `dtp.zero.formulas` for the model states,
`dtp.memory.formulas` for a layer's activations and the logits, and `dtp.topology.costs` for
what an MLP other than the GPT's keeps.
"""
from __future__ import annotations

import functools

from dtp.memory import formulas as memory
from dtp.topology import stages
from dtp.topology.costs import layer_activation_bytes as layer_activation_bytes_of
from dtp.topology.shapes import block_parameter_counts
from dtp.zero import formulas as zero


def layers_per_stage(model, training, layout) -> tuple[int, ...]:
    """The layout's own layers per stage, or the split of `training.balanced_stages`'s rule."""
    if layout.stage_layers:
        if len(layout.stage_layers) != layout.pp or sum(layout.stage_layers) != model.layers \
                or min(layout.stage_layers) < 1:
            raise ValueError(f"stage_layers {tuple(layout.stage_layers)} must give each of the {layout.pp} stages at "
                             f"least one of the {model.layers} layers")
        return tuple(layout.stage_layers)
    return stages.split_layers(model.layers, layout.pp, training.balanced_stages)


@functools.lru_cache(maxsize=4096)
def largest_stage_parameters(model, stage_layers: tuple[int, ...]) -> dict[str, float]:
    """The parameters of the stage holding the most (the one whose gradients and optimizer take longest)."""
    found = [stage_parameters(model, stage_layers, index) for index in range(len(stage_layers))]
    return max(found, key=lambda counts: counts["non_expert"] + counts["experts"])


def stage_parameters(model, stage_layers: tuple[int, ...], index: int) -> dict[str, float]:
    """{"non_expert", "experts"} parameters of stage `index` (before the TP split): its layers, the
    embedding on the first stage, the final norm and output layer on the last (a tied output layer's
    copy of the embedding too, when the two are on different stages)."""
    block = block_parameter_counts(model)
    layers, last = stage_layers[index], index == len(stage_layers) - 1
    if last:  # the multi-token-prediction modules' blocks and projections sit with the output head
        layers += model.mtp_modules
    mlps = 0 if model.is_moe else block["mlp"]
    non_expert = layers * (block["attention"] + mlps)
    if index == 0:
        non_expert += block["embedding"]
    if last:
        non_expert += block["output"] + (model.vocab * model.hidden if model.tied_embeddings and index > 0 else 0) \
            + model.mtp_modules * 2 * model.hidden**2
    return {"non_expert": non_expert, "experts": layers * model.experts * block["expert"] if model.is_moe else 0.0}


@functools.lru_cache(maxsize=64)
def _bytes_per_parameter(recipe: str) -> dict[str, int]:
    return zero.bytes_per_parameter_by_component(recipe)


def model_states(model, training, layout, parameters: dict[str, float]) -> dict[str, float]:
    """Weights, gradients and optimizer states on one GPU of a stage holding `parameters`: the
    non-expert ones split t ways and ZeRO-sharded over the dp·cp ranks that hold them, the experts
    split t·e ways and sharded over dp/e; unsharded gradients kept whole while ZeRO-2/3
    accumulate once per step (dtp.zero.formulas.accumulation_gradient_bytes_held)."""
    groups = [(parameters["non_expert"] / layout.tp, layout.dp * layout.cp)]
    if model.is_moe:
        groups.append((parameters["experts"] / (layout.tp * layout.ep), layout.dp // layout.ep))
    per_parameter = _bytes_per_parameter(training.recipe)
    sharded = zero.SHARDED[layout.zero_stage]
    states = {component: sum(n * per_parameter[component] / (d if component in sharded else 1) for n, d in groups)
              for component in zero.COMPONENTS}
    if layout.zero_stage >= 2 and not layout.reduce_every_micro_batch:
        states["gradients"] = sum(zero.accumulation_gradient_bytes_held(n, d, layout.zero_stage, False,
                                                                        per_parameter["gradients"]) for n, d in groups)
    return states


def layer_activation_bytes(model, training, layout) -> float:
    """Bytes one layer keeps for one micro-batch on one GPU (dtp.topology.costs.layer_activation_bytes);
    flash attention keeps no s x s scores, as selective recomputation does not."""
    recompute = training.recompute
    if training.flash_attention and recompute == "none":
        recompute = "selective"
    return layer_activation_bytes_of(model, training, layout, recompute)


def stage_memory(model, training, layout, stage_layers: tuple[int, ...], index: int) -> dict[str, float]:
    """Bytes by component on one GPU of stage `index`."""
    breakdown = model_states(model, training, layout, stage_parameters(model, stage_layers, index))
    held = stages.in_flight_layers(stage_layers, index, layout.micro_batches, training.chunks)
    breakdown["activations"] = held * layer_activation_bytes(model, training, layout)
    last = index == len(stage_layers) - 1
    breakdown["logits"] = memory.logits_bytes(model.seq, training.micro_batch, model.vocab, layout.tp, layout.cp) \
        if last else 0.0
    return breakdown


def peak_stage_memory(model, training, layout, stage_layers: tuple[int, ...]) -> tuple[int, dict[str, float]]:
    """The stage whose GPUs need the most memory, and its breakdown: of the first stage (most
    micro-batches in flight, the embedding), the last (the output layer, the logits) and the
    first stage holding the most layers (the others hold fewer micro-batches or fewer layers)."""
    p = len(stage_layers)
    candidates = {0, p - 1, stage_layers.index(max(stage_layers))}
    found = {index: stage_memory(model, training, layout, stage_layers, index) for index in candidates}
    worst = max(found, key=lambda index: sum(found[index].values()))
    return worst, found[worst]
