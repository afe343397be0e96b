"""What everyday training code sees of each ZeRO wrapper, measured on a CPU gloo mesh with the
pinned torch: the chapter's `ZeRO3` and `ShardedOptimizer` (dtp.zero.sharded), FSDP2's
`fully_shard` and `ZeroRedundancyOptimizer` under DDP, on dtp.zero.compare's GPT.

For each: what `named_parameters()` yields (names, shapes, the share of elements a rank stores),
the norm torch's `clip_grad_norm_` returns on them against one process's, whether the optimizer is
a `torch.optim.Optimizer` a `StepLR` drives, the dtype a LayerNorm computes in under bf16 when
asked to keep fp32, and what becomes of the gradient of a module left unsharded. `compare_interfaces`
returns the facts, `interface_rows` the book's table rows written from them.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from dtp.common.world import run_world
from dtp.zero.compare import ADAMW, ROWS, comparison_batches, comparison_loss, comparison_model, fsdp2, zero3
from dtp.zero.sharded import NORMALIZATION_LAYERS, MixedPrecision, ShardedOptimizer

COLUMNS = ("ZeRO3", "ShardedOptimizer", "FSDP2 fully_shard", "ZeroRedundancyOptimizer")
GAMMA = 0.5  # StepLR(step_size=1, gamma): the learning rate after one step


def _stored(p) -> int:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.numel()


def _number(t) -> float:
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


def _same_on_every_rank(t: torch.Tensor) -> bool:
    first = t.detach().clone()
    dist.broadcast(first, 0)
    equal = torch.tensor(float(torch.equal(first, t)))
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    return bool(equal.item())


def _wrap(column: str, model, world_size: int, stage: int = 2):
    """(module to call, optimizer, module whose named_parameters() user code reads)."""
    if column == "ZeRO3":
        module = zero3(model)
        return module, torch.optim.AdamW(module.parameters(), **ADAMW), module.module
    if column == "ShardedOptimizer":
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, **ADAMW), model
    if column == "FSDP2 fully_shard":
        module = fsdp2(model, world_size)
        return module, torch.optim.AdamW(module.parameters(), **ADAMW), module
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    return (DistributedDataParallel(model), ZeroRedundancyOptimizer(
        [p for p in model.parameters() if p.requires_grad], optimizer_class=torch.optim.AdamW, **ADAMW), model)


def _facts_rank(rank: int, world_size: int, column: str) -> dict:
    share = ROWS // world_size
    tokens = comparison_batches(1)[0][rank * share:(rank + 1) * share]
    module, optimizer, shown = _wrap(column, comparison_model(), world_size)
    named = list(shown.named_parameters())
    facts = {"names": [(name, tuple(p.shape)) for name, p in named], "types": sorted({type(p).__name__ for _, p in named}),
             "stored": sum(_stored(p) for _, p in named) / sum(p.numel() for _, p in named)}
    comparison_loss(module, tokens).backward()
    facts["torch clip norm"] = _number(torch.nn.utils.clip_grad_norm_([p for _, p in named], math.inf))
    if column == "ShardedOptimizer":
        facts["own clip norm"] = float(optimizer.clip_grad_norm_(math.inf))
        stage1_model = comparison_model()
        ShardedOptimizer(stage1_model.parameters(), torch.optim.AdamW, stage=1, **ADAMW)
        comparison_loss(stage1_model, tokens).backward()
        facts["torch clip norm, stage 1"] = float(torch.nn.utils.clip_grad_norm_(stage1_model.parameters(), math.inf))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    optimizer.step()
    scheduler.step()
    facts["an Optimizer"] = isinstance(optimizer, torch.optim.Optimizer)
    facts["the wrapper is the optimizer"] = column in ("ShardedOptimizer", "ZeroRedundancyOptimizer")
    facts["lr after a step"] = optimizer.param_groups[0]["lr"]
    facts.update(_mixed_facts(column, world_size, tokens))
    return facts


def _mixed_facts(column: str, world_size: int, tokens) -> dict:
    """bf16 with the LayerNorms asked to keep fp32, and the final norm left unsharded."""
    model = comparison_model()
    whole = [model.final_norm.weight, model.final_norm.bias]
    if column == "ZeRO3":
        module = zero3(model, mixed=True, norms_fp32=True, replicated=[model.final_norm])
    elif column == "FSDP2 fully_shard":
        module = fsdp2(model, world_size, mixed=True, norms_fp32=True, ignored=set(whole))
    elif column == "ShardedOptimizer":
        try:
            ShardedOptimizer(model.parameters(), torch.optim.AdamW,
                             mixed_precision=MixedPrecision(full_precision=NORMALIZATION_LAYERS), **ADAMW)
            return {"norms fp32": "accepted"}
        except ValueError as error:
            return {"norms fp32": f"refused: {error}"}
    else:
        return {}
    seen = {}
    norm = model.blocks[0].norm1
    norm.register_forward_hook(lambda m, args, out: seen.update(weight=m.weight.dtype, input=args[0].dtype,
                                                                output=out.dtype))
    comparison_loss(module, tokens).backward()
    return {"norms fp32": seen, "unsharded type": type(model.final_norm.weight).__name__,
            "unsharded grads averaged": _same_on_every_rank(model.final_norm.weight.grad)}


def one_process_norm() -> float:
    model = comparison_model()
    comparison_loss(model, comparison_batches(1)[0]).backward()
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))


def compare_interfaces(world_size: int = 2) -> dict:
    """{column: facts (rank 0's)} for COLUMNS, and one process's gradient norm ("one process")."""
    facts = {column: run_world(_facts_rank, world_size, (column,), timeout_s=120)[0] for column in COLUMNS}
    facts["one process"] = {"norm": one_process_norm(),
                            "names": [(name, tuple(p.shape)) for name, p in comparison_model().named_parameters()]}
    return facts


def _gap(norm: float, reference: float) -> str:
    gap = abs(norm - reference) / reference
    return "exactly one process's" if gap == 0 else f"one process's to {gap:.0e}"


def interface_rows(facts: dict) -> list[tuple[str, ...]]:
    """The rows of the book's table: what user code does, then one cell per column of COLUMNS."""
    reference, names = facts["one process"]["norm"], facts["one process"]["names"]

    def shown(column):
        f = facts[column]
        kept = "the model's names and full shapes" if f["names"] == names else "names or shapes changed"
        return f"{kept}; {'/'.join(f['types'])}, {f['stored']:.0%} of the elements stored per rank"

    def clipped(column):
        f = facts[column]
        if column == "ShardedOptimizer":
            return (f"stage 1: {f['torch clip norm, stage 1'] / reference:.2f}× the norm (a rank's own gradients), "
                    f"stage 2: {f['torch clip norm']:g} (none left); `optimizer.clip_grad_norm_`: "
                    f"{_gap(f['own clip norm'], reference)}")
        return f"the global norm: {_gap(f['torch clip norm'], reference)}"

    def optimizer(column):
        f = facts[column]
        who = "the wrapper is one" if f["the wrapper is the optimizer"] else "your own torch optimizer"
        return f"{who}; StepLR: lr {ADAMW['lr']:g} → {f['lr after a step']:g}"

    def norms(column):
        value = facts[column].get("norms fp32")
        if value is None:
            return "no mixed precision"
        if isinstance(value, str):
            return value.split(":")[0]
        return f"LayerNorm: {value['weight']} weights and inputs, {value['output']} out".replace("torch.", "")

    def unsharded(column):
        f = facts[column]
        if "unsharded type" not in f:
            return "every module (weights are not sharded)"
        how = "averaged" if f["unsharded grads averaged"] else "not reduced (left to you)"
        api = "`replicated=[...]`" if column == "ZeRO3" else "`ignored_params`"
        return f"{api}: a whole {f['unsharded type']}, gradients {how}"

    return [("`named_parameters()`", *map(shown, COLUMNS)),
            ("torch's `clip_grad_norm_` on them", *map(clipped, COLUMNS)),
            ("a `torch.optim.Optimizer`", *map(optimizer, COLUMNS)),
            ("LayerNorms in fp32 under bf16", *map(norms, COLUMNS)),
            ("a module left unsharded", *map(unsharded, COLUMNS))]
