"""ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC20) in closed form: what each of Nd data-parallel GPUs holds and sends per step.

Stage 0 is plain data parallelism. Stage 1 (the paper's P_os) shards the optimizer states over
the Nd ranks, stage 2 (P_os+g) the gradients too, stage 3 (P_os+g+p) the weights too. Bytes per
parameter come from the memory chapter's recipes (`dtp.memory.formulas.RECIPES`: mixed-precision Adam is
2 + 2 + 12), so `model_state_bytes_per_gpu(psi, 64, 1)` is 2Ψ + 2Ψ + 12Ψ/64.

Two levels of detail:
- per GPU for any Ψ (the planner of the topology chapter calls these): `model_state_bytes_per_gpu`,
  `memory_saving_factor`, `communication_bytes_per_gpu`, `fewest_gpus_to_fit`, and for hybrid
  sharding `hybrid_sharding_bytes_per_gpu` and `hybrid_sharding_elements_per_gpu`;
- exact bytes for a run of the course (fp32, padded shards): `held_bytes_per_rank`,
  `sent_bytes_per_rank`, which tests/zero/test_zero_formulas.py checks against measurements.

Sharding convention of the exact formulas: a tensor of u elements is split into Nd pieces of
c = ceil(u/Nd) elements, the last one zero-padded, so that every rank holds c elements of it and
all-gather and reduce-scatter move equal pieces. The padding is memory that exists and bytes that
travel, so it counts. A "unit" is what is sharded as one tensor: each parameter (FSDP2's way), or
a flat buffer of several parameters (FSDP1's FlatParameter).
"""
from __future__ import annotations

import math

from dtp.dp.costs import ring_all_reduce_bytes_per_rank
from dtp.memory import formulas as memory

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "data parallel", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
COMPONENTS = ("weights", "gradients", "optimizer states")
# What each stage shards over the data-parallel ranks.
SHARDED: dict[int, tuple[str, ...]] = {0: (), 1: ("optimizer states",), 2: ("optimizer states", "gradients"),
                                       3: ("optimizer states", "gradients", "weights")}

# --- per GPU, any size ------------------------------------------------------------------------


def _check_stage(stage: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")


def bytes_per_parameter_by_component(recipe: str = "mixed_adam") -> dict[str, int]:
    """A recipe of `dtp.memory.formulas.RECIPES` grouped into weights, gradients and optimizer states
    (fp32 master weights count as optimizer state, as in the paper's K = 12)."""
    grouped = dict.fromkeys(COMPONENTS, 0)
    for entry, nbytes in memory.RECIPES[recipe].items():
        grouped[memory.component_of(entry)] += nbytes
    return grouped


def model_state_breakdown_per_gpu(n_params: float, n_gpus: int, stage: int,
                                  recipe: str = "mixed_adam") -> dict[str, float]:
    """Bytes of weights, gradients and optimizer states on each of `n_gpus` data-parallel GPUs
    for a model of `n_params` parameters (Ψ): a sharded component is divided by Nd."""
    _check_stage(stage)
    return {component: n_params * nbytes / (n_gpus if component in SHARDED[stage] else 1)
            for component, nbytes in bytes_per_parameter_by_component(recipe).items()}


def model_state_bytes_per_gpu(n_params: float, n_gpus: int, stage: int, recipe: str = "mixed_adam") -> float:
    """Model-state bytes per GPU (activations come on top). Mixed-precision Adam:
    stage 0: 16Ψ, stage 1: 2Ψ + 2Ψ + 12Ψ/Nd, stage 2: 2Ψ + 14Ψ/Nd, stage 3: 16Ψ/Nd."""
    return sum(model_state_breakdown_per_gpu(n_params, n_gpus, stage, recipe).values())


def memory_saving_factor(n_gpus: int, stage: int, recipe: str = "mixed_adam") -> float:
    """How many times less than plain data parallelism each GPU holds (independent of Ψ)."""
    return model_state_bytes_per_gpu(1.0, 1, 0, recipe) / model_state_bytes_per_gpu(1.0, n_gpus, stage, recipe)


def saving_factor_limit(stage: int, recipe: str = "mixed_adam") -> float:
    """The saving factor as Nd grows without bound: only the replicated components remain
    (4 for stage 1 and 8 for stage 2 of mixed-precision Adam; stage 3 has no limit)."""
    _check_stage(stage)
    per_component = bytes_per_parameter_by_component(recipe)
    replicated = sum(v for k, v in per_component.items() if k not in SHARDED[stage])
    return math.inf if replicated == 0 else sum(per_component.values()) / replicated


def communication_elements_per_gpu(n_params: float, n_gpus: int, stage: int) -> float:
    """Elements each GPU sends per training step with ring collectives. A ring reduce-scatter or
    all-gather of Ψ elements sends (Nd-1)/Nd·Ψ per GPU, an all-reduce twice that. Stages 0 to 2
    send 2(Nd-1)/Nd·Ψ (an all-reduce, or a reduce-scatter of gradients plus an all-gather of
    weights, which is the same thing); stage 3 gathers the weights twice (forward and backward)
    and reduce-scatters the gradients: 3(Nd-1)/Nd·Ψ. The paper's 2Ψ and 3Ψ are the Nd → ∞ limits."""
    _check_stage(stage)
    collectives = 3 if stage == 3 else 2
    return collectives * (n_gpus - 1) / n_gpus * n_params


def communication_bytes_per_gpu(n_params: float, n_gpus: int, stage: int, bytes_per_element: int = 2) -> float:
    """Bytes each GPU sends per step (16-bit gradients and weights by default)."""
    return communication_elements_per_gpu(n_params, n_gpus, stage) * bytes_per_element


def hybrid_sharding_bytes_per_gpu(n_params: float, shard_group: int, recipe: str = "mixed_adam") -> float:
    """Hybrid sharding (HSDP): ZeRO-3 within groups of N_s ranks, replicated across the groups.
    Each GPU holds 16Ψ/N_s, whatever the number of groups."""
    return model_state_bytes_per_gpu(n_params, shard_group, 3, recipe)


def hybrid_sharding_elements_per_gpu(n_params: float, shard_group: int, replicas: int) -> dict[str, float]:
    """Elements each GPU sends per step with hybrid sharding over N_s x N_r ranks: ZeRO-3's two
    all-gathers and reduce-scatter within its group, 3(N_s-1)/N_s·Ψ, and an all-reduce of its
    averaged piece across the groups, 2(N_r-1)/N_r·Ψ/N_s."""
    return {"within a group": communication_elements_per_gpu(n_params, shard_group, 3),
            "across groups": communication_elements_per_gpu(n_params / shard_group, replicas, 0)}


def fewest_gpus_to_fit(n_params: float, device_bytes: float, stage: int, recipe: str = "mixed_adam",
                       reserved_bytes: float = 0.0) -> int | None:
    """The smallest Nd whose model states per GPU fit in `device_bytes - reserved_bytes`
    (reserve room for activations), or None when no Nd does: stages 0 to 2 keep some
    components whole on every GPU, a floor that no number of GPUs lowers."""
    _check_stage(stage)
    room = device_bytes - reserved_bytes
    per_component = bytes_per_parameter_by_component(recipe)
    replicated = n_params * sum(v for k, v in per_component.items() if k not in SHARDED[stage])
    sharded = n_params * sum(v for k, v in per_component.items() if k in SHARDED[stage])
    if sharded == 0:
        return 1 if replicated <= room else None
    if replicated >= room:
        return None
    return max(1, math.ceil(sharded / (room - replicated)))


# --- mixed precision and gradient accumulation (the planner uses these too) -----------------

def mixed_precision_bytes_per_gpu(n_params: float, n_gpus: int, stage: int, param_bytes: int = 2,
                                  gradient_bytes: int = 2, master_bytes: int = 4,
                                  optimizer_state_bytes: int = 8) -> dict[str, float]:
    """Model-state bytes on each of Nd GPUs when compute weights are `param_bytes` wide, gradients
    `gradient_bytes` (FSDP2's `reduce_dtype`; bf16 recipes often keep fp32 gradients, 4), and the
    optimizer keeps fp32 master weights and `optimizer_state_bytes` per parameter (Adam: 8).
    2 + 2 + 4 + 8 = 16 is the paper's recipe; with fp32 gradients it is 2 + 4 + 12 = 18, and
    ZeRO-1's saving then tends to 18/6 = 3 rather than 16/4 = 4.

    What each stage shards: 1 the master weights and optimizer states, 2 the gradients too, 3 the
    compute weights too (stage 3's gathered units and full gradients in flight come on top:
    `zero3_transient_bytes`)."""
    _check_stage(stage)
    divide = {component: n_gpus if component in SHARDED[stage] else 1 for component in COMPONENTS}
    return {"weights": n_params * param_bytes / divide["weights"],
            "gradients": n_params * gradient_bytes / divide["gradients"],
            "optimizer states": n_params * (master_bytes + optimizer_state_bytes) / divide["optimizer states"]}


def zero3_transient_bytes(unit_params: float, param_bytes: int = 2, gradient_bytes: int = 2,
                          prefetch: bool = True) -> float:
    """The floor under ZeRO-3's 16Ψ/Nd, which no Nd lowers: the unit running (its gathered weights),
    the next one gathered ahead (`prefetch`), and the unit's full gradient in backward until its
    reduce-scatter has run. `unit_params` is the largest unit's parameter count. Activations come
    on top."""
    return unit_params * ((2 if prefetch else 1) * param_bytes + gradient_bytes)


def accumulation_gradient_bytes_held(n_params: float, n_gpus: int, stage: int, reduce_every_micro_batch: bool,
                                     gradient_bytes: int = 2) -> float:
    """Gradient bytes each GPU holds while it accumulates over micro-batches (one unit's full
    gradient in flight left out). Two ways: reduce-scatter every micro-batch and add up pieces
    (stages 2 and 3 then hold Ψ/Nd), or accumulate full gradients and reduce once, after the last
    micro-batch (FSDP2's `set_requires_gradient_sync(False)`, DDP's `no_sync`): Ψ, and its piece.
    Stages 0 and 1 hold full gradients either way."""
    _check_stage(stage)
    if stage < 2:
        return n_params * gradient_bytes
    sharded = n_params * gradient_bytes / n_gpus
    return sharded if reduce_every_micro_batch else n_params * gradient_bytes + sharded


def accumulation_bytes_sent_per_gpu(n_params: float, n_gpus: int, micro_batches: int, stage: int,
                                    reduce_every_micro_batch: bool, param_bytes: int = 2,
                                    gradient_bytes: int = 2) -> dict[str, float]:
    """Bytes each GPU sends per optimizer step of `micro_batches` micro-batches, ring collectives.
    Gradients: stage 0 all-reduces, 2(Nd-1)/Nd·Ψ, stages 1 to 3 reduce-scatter, (Nd-1)/Nd·Ψ,
    once per micro-batch or once per step (stage 1 reduces in its step, so always once).
    Weights: stages 1 and 2 all-gather them once per step, stage 3 twice per micro-batch (forward
    and backward), whichever way it accumulates: accumulating in full saves only gradient traffic."""
    _check_stage(stage)
    ring = (n_gpus - 1) / n_gpus * n_params
    reductions = micro_batches if reduce_every_micro_batch and stage != 1 else 1
    gradients = reductions * ring * gradient_bytes * (2 if stage == 0 else 1)
    weights = {0: 0, 1: ring, 2: ring, 3: 2 * micro_batches * ring}[stage] * param_bytes
    return {"gradients": gradients, "weights": weights}


# --- exact, for a run of the course -----------------------------------------------------------

def shard_numel(numel: int, n: int) -> int:
    """Elements of a unit of `numel` elements that each of n ranks holds: ceil(numel/n)."""
    return -(-numel // n)


def padded_numel(numel: int, n: int) -> int:
    """n·ceil(numel/n): the unit with its padding, the size that reduce-scatter and all-gather move."""
    return n * shard_numel(numel, n)


# fp32 Adam, as the graded runs train (so that they compare exactly with plain data parallelism).
FP32_ITEMSIZE = 4
ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, one fp32 value each per element


def held_bytes_per_rank(parameter_sizes: list[int], n: int, stage: int, units: list[int] | None = None,
                        itemsize: int = FP32_ITEMSIZE, padded: bool = True) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer states (Adam's two moments) that one rank holds
    when the course's runs train in fp32 with Adam: plain data parallelism (stage 0) or the
    course's ZeRO-k, sharding each unit (default: each parameter) into padded pieces.

    With C = sum over units of ceil(u/n):
      stage 0: weights 4Ψ,      gradients 4Ψ, optimizer 8Ψ
      stage 1: weights 4Ψ + 4C, gradients 4Ψ, optimizer 8C
      stage 2: weights 4Ψ + 4C, gradients 4C, optimizer 8C
      stage 3: weights 4C,      gradients 4C, optimizer 8C
    In stages 1 and 2 the optimizer steps a copy of the rank's piece of the weights (in mixed
    precision that copy is the fp32 master copy), while forward and backward use the full ones.
    `padded=False` gives the textbook's C = Ψ/n instead."""
    _check_stage(stage)
    psi = sum(parameter_sizes)
    units = list(parameter_sizes) if units is None else list(units)
    if sum(units) != psi:
        raise ValueError(f"units {units} do not add up to the {psi} parameters")
    shard = sum(shard_numel(u, n) for u in units) if padded else psi / n
    if stage == 0:
        held = {"weights": psi, "gradients": psi, "optimizer states": ADAM_MOMENTS * psi}
    else:
        held = {"weights": shard if stage == 3 else psi + shard,
                "gradients": shard if stage >= 2 else psi,
                "optimizer states": ADAM_MOMENTS * shard}
    return {component: count * itemsize for component, count in held.items()}


def ring_bytes_sent(op: str, logged_bytes: float, n: int) -> float:
    """Bytes one rank sends in a ring implementation of a collective, from the bytes the course's
    CommunicationLog records for it (this rank's input): an all-gather of pieces of c bytes sends
    (n-1)·c; a reduce-scatter of S bytes (n-1)/n·S; an all-reduce of S bytes 2(n-1)/n·S."""
    if op == "all_gather":
        return (n - 1) * logged_bytes
    if op == "reduce_scatter":
        return (n - 1) / n * logged_bytes
    if op == "all_reduce":
        return ring_all_reduce_bytes_per_rank(n, logged_bytes)
    raise ValueError(f"no ring byte count for {op!r}")


def sent_bytes_per_rank(units: list[int], n: int, stage: int, itemsize: int = FP32_ITEMSIZE) -> float:
    """Bytes a rank sends per step with ring collectives, each unit padded to n·ceil(u/n):
    stage 0 all-reduces each unit, 2(n-1)/n·u (no padding: an all-reduce needs none); stages 1
    and 2 reduce-scatter its gradient and all-gather its weights, 2(n-1)·ceil(u/n); stage 3
    all-gathers the weights once more, for backward: 3(n-1)·ceil(u/n)."""
    _check_stage(stage)
    if stage == 0:
        return sum(ring_all_reduce_bytes_per_rank(n, u * itemsize) for u in units)
    collectives = 3 if stage == 3 else 2
    return sum(collectives * (n - 1) * shard_numel(u, n) * itemsize for u in units)


# --- layouts: which units a run sharded -------------------------------------------------------

def units_from_pieces(piece_sizes: list[int], parameter_sizes: list[int], n: int,
                      ordered: bool = False) -> list[int] | None:
    """The units of a run, from the sizes of the pieces it holds or all-gathers (one per unit)
    and the parameter sizes in model order: a split of the parameters into consecutive groups
    whose padded pieces are exactly `piece_sizes` (in that order if `ordered`, else in any
    order); None if there is none. Unordered, several splits can fit the same pieces; they then
    hold and send the same bytes."""
    def split(start: int, left: list[int]) -> list[int] | None:
        if start == len(parameter_sizes):
            return [] if not left else None
        total = 0
        for stop in range(start, len(parameter_sizes)):
            total += parameter_sizes[stop]
            piece = shard_numel(total, n)
            candidates = left[:1] if ordered else left
            if not candidates or piece > max(candidates):
                break
            if piece in candidates:
                rest = list(left)
                rest.remove(piece)
                found = split(stop + 1, rest)
                if found is not None:
                    return [total] + found
        return None

    return split(0, list(piece_sizes) if ordered else sorted(piece_sizes))


def unshard(pieces_by_rank: list[list], units: list[int]) -> list:
    """Full units from the pieces each rank holds (rank r's j-th piece is its piece of unit j):
    concatenate in rank order and drop the padding. Works on numpy arrays."""
    import numpy as np
    return [np.concatenate([np.ravel(pieces[j]) for pieces in pieces_by_rank])[:u] for j, u in enumerate(units)]


# --- the book's figures -----------------------------------------------------------------------

def memory_per_gpu_figure(n_params: float, gpu_counts, recipe: str = "mixed_adam", device_bytes: float = 80 * 2**30):
    """Model states per GPU against Nd for each stage (log-log), with a GPU's memory dashed."""
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    gpus = list(gpu_counts)
    for stage in STAGES:
        axis.plot(gpus, [model_state_bytes_per_gpu(n_params, n, stage, recipe) / 1e9 for n in gpus],
                  marker="o", markersize=3, label=f"{STAGE_NAMES[stage]}")
    axis.axhline(device_bytes / 1e9, color="black", linestyle="--", linewidth=1,
                 label=f"one GPU: {device_bytes / 2**30:g} GiB = {device_bytes / 1e9:.1f} GB")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("data-parallel GPUs $N_d$")
    axis.set_ylabel("model states per GPU (GB)")
    axis.set_title(f"Ψ = {n_params / 1e9:g}B parameters, {recipe} ({sum(memory.RECIPES[recipe].values())} bytes each)")
    axis.grid(True, which="both", alpha=0.3)
    axis.legend()
    figure.tight_layout()
    plt.close(figure)
    return figure


def full_weights_figure(histories: dict[str, list[tuple[str, int]]], all_weights_bytes: int):
    """Bytes of gathered (full) weights alive after every operation of one training step, one
    panel per run, with the bytes of all the weights dashed and backward shaded."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(histories), 1, figsize=(7, 2.2 * len(histories) + 0.6), sharey=True,
                                squeeze=False)
    for axis, (label, history) in zip(axes[:, 0], histories.items()):
        axis.step(range(len(history)), [alive / 1e3 for _, alive in history], where="post", color="tab:blue",
                  label="full weights alive")
        phases = [phase for phase, _ in history]
        if "backward" in phases:
            axis.axvspan(phases.index("backward"), len(phases), color="gray", alpha=0.15, label="backward")
        axis.axhline(all_weights_bytes / 1e3, color="black", linestyle="--", linewidth=1, label="all the weights")
        axis.set_title(label, fontsize=10)
        axis.set_ylabel("kB alive")
        axis.set_xlim(0, len(history))
        axis.grid(True, alpha=0.3)
    axes[-1, 0].set_xlabel("operation of one training step (forward, then backward), in order")
    handles, names = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, names, loc="upper center", ncol=len(names), frameon=False)
    figure.tight_layout(rect=(0, 0, 1, 0.93))
    plt.close(figure)
    return figure
